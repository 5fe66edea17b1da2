"""``mirage-serve show FILE``: print a μGraph file readably, or re-emit its canonical JSON.

FILE may be our canonical JSON (one graph) or an upstream Mirage file (an array
of graphs); the format is detected from the content. With several graphs all are
shown unless ``--index N`` picks one; ``--json`` prints one canonical document per
line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mirage_serve.mugraph.graph import KernelGraph, MuGraphError, Op
from mirage_serve.mugraph.mirage_import import import_mirage_obj, is_mirage_json
from mirage_serve.mugraph.serialize import content_hash, graph_from_obj, to_json
from mirage_serve.mugraph.shapes import TensorInfo, block_tile_infos

_PHASES = {"invariant": "loop-invariant", "loop": "per iteration", "post": "after the loop", "both": "running max"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``mirage-serve show``."""
    parser.add_argument("file", type=Path, help="a μGraph file: canonical mirage-serve JSON or upstream Mirage JSON")
    parser.add_argument("--json", action="store_true", help="print canonical JSON instead (one graph per line)")
    parser.add_argument("--index", type=int, metavar="N", help="show only graph N (0-based) of a file holding several")


def load_graphs(path: str | Path) -> list[KernelGraph]:
    """Every graph in a μGraph file, detecting canonical or upstream Mirage JSON."""
    try:
        obj = json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MuGraphError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise MuGraphError(f"{path}: JSON nested too deeply") from None
    if isinstance(obj, dict):
        return [graph_from_obj(obj)]
    if is_mirage_json(obj):
        return import_mirage_obj(obj)
    raise MuGraphError(
        f"{path}: neither a mirage-serve μGraph (a JSON object with 'format') nor an upstream Mirage file "
        "(a JSON array of kernel graphs)"
    )


def _t(info: TensorInfo) -> str:
    return f"{info.dtype}{list(info.shape)}"


def _op_label(op: Op, args: str) -> str:
    """``unary.exp(t3)``, ``reduce.sum(t2, dim=1, keepdim=True)``, ``matmul(t0, t1, trans_b=True)``."""
    name = f"{op.kind}.{op.attr('fn')}" if op.attr("fn") is not None else op.kind
    rest = "".join(f", {k}={v}" for k, v in op.attrs if k != "fn")
    return f"{name}({args}{rest})"


def format_graph(graph: KernelGraph) -> str:
    """A readable listing: every operator with tensor ids, shapes and dtypes, and every
    customized operator's block graph (grid, loop, maps, tiles, accumulators, outputs)."""
    info = graph.info
    lines = [
        f"kernel graph: {len(graph.input_ids)} input(s), {len(graph.ops) - len(graph.input_ids)} operator(s) "
        f"({len(graph.customized_ops)} customized), {len(graph.outputs)} output(s); content hash {content_hash(graph)[:16]}"
    ]
    tid = 0
    for i, op in enumerate(graph.ops):
        outs = list(range(tid, tid + op.num_outputs))
        tid += op.num_outputs
        if op.kind == "input":
            strides = f" strides {list(op.attr('strides'))}" if op.attr("strides") else ""
            lines.append(f"  t{outs[0]} = input {op.attr('name')!r}: {_t(info[outs[0]])}{strides}")
            continue
        args = ", ".join(f"t{t}" for t in op.inputs)
        if op.kind != "customized":
            lines.append(f"  t{outs[0]} = {_op_label(op, args)}: {_t(info[outs[0]])}")
            continue
        lhs = ", ".join(f"t{t}" for t in outs)
        lines.append(f"  {lhs} = customized({args})  [kernel op {i}]")
        lines.extend(_format_block(op, [info[t] for t in op.inputs], outs, info))
    lines.append(f"  outputs: {', '.join(f't{t}' for t in graph.outputs)}")
    return "\n".join(lines)


def _format_block(op: Op, arg_infos: list[TensorInfo], outs: list[int], info: tuple[TensorInfo, ...]) -> list[str]:
    b = op.block
    tiles = block_tile_infos(b, arg_infos)
    pad = "      "
    lines = [f"{pad}grid {list(b.grid)} ({b.num_blocks} blocks), forloop_range {b.forloop_range}"]
    for j, bi in enumerate(b.inputs):
        fl = f"forloop_dim {bi.forloop_dim}" if bi.forloop_dim >= 0 else "no for-loop dim"
        lines.append(
            f"{pad}b{j} = load t{op.inputs[bi.source]} (arg {bi.source}) input_map {list(bi.input_map)}, {fl}: "
            f"tile {_t(tiles[j])}, {_PHASES[tiles[j].phase]}"
        )
    n_in = len(b.inputs)
    for j, bop in enumerate(b.ops):
        t = n_in + j
        args = ", ".join(f"b{x}" for x in bop.inputs)
        lines.append(f"{pad}b{t} = {_op_label(bop, args)}: {_t(tiles[t])}, {_PHASES[tiles[t].phase]}")
    for j, bo in enumerate(b.outputs):
        partial = [g for g, d in enumerate(bo.output_map) if d == -1 and b.grid[g] > 1]
        note = f" (partial results over grid dim(s) {partial})" if partial else ""
        lines.append(f"{pad}t{outs[j]} <- b{bo.tensor} output_map {list(bo.output_map)}: {_t(info[outs[j]])}{note}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Print the graph(s) of ``args.file``; errors go to stderr with exit status 2."""
    try:
        graphs = load_graphs(args.file)
        if args.index is not None:
            if not 0 <= args.index < len(graphs):
                raise MuGraphError(f"{args.file} holds {len(graphs)} graph(s); --index must be 0..{len(graphs) - 1}, got {args.index}")
            chosen = [(args.index, graphs[args.index])]
        else:
            chosen = list(enumerate(graphs))
    except (MuGraphError, OSError) as e:
        print(f"mirage-serve show: {e}", file=sys.stderr)
        return 2
    try:
        for k, (i, g) in enumerate(chosen):
            if args.json:
                print(to_json(g))
                continue
            if len(graphs) > 1:
                print(("\n" if k else "") + f"# graph {i} of {len(graphs)} in {args.file}")
            print(format_graph(g))
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (e.g. piped into head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
