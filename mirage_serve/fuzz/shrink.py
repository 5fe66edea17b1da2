"""Minimise a failing graph (or pair of graphs) while the failure reproduces.

Greedy: try every smaller variant of the current graphs in a fixed order and
restart from the first one for which ``still_fails`` holds, until none does or
the budget runs out. The variants (each validated by the IR first):

* fewer graph outputs; operators bypassed (their uses read an operand of the
  same shape instead) at kernel and block level, then dead code removed;
* grid dims set to 1, a smaller for-loop range;
* input dims shrunk: every occurrence of a size in the input shapes replaced
  together (a size shared by several inputs is one axis), then one at a time.

Pairs (candidate, spec) shrink each side alone and their input shapes together,
so that both keep one signature.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from mirage_serve.mugraph.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, MuGraphError, Op

Graphs = dict[str, KernelGraph]


def _valid(g: KernelGraph) -> KernelGraph | None:
    try:
        return g.validate()
    except (MuGraphError, ValueError, IndexError):
        return None


def _size(g: KernelGraph) -> tuple[int, int, int]:
    """(operators and outputs, input elements, grid and loop sizes): smaller is simpler."""
    ops = sum(1 + (len(op.block.ops) + len(op.block.outputs) if op.block is not None else 0) for op in g.ops if op.kind != "input")
    ops += len(g.outputs)
    tiling = sum(sum(op.block.grid) + op.block.forloop_range for op in g.ops if op.block is not None)
    numel = 0
    for t in g.input_ids:
        n = 1
        for s in g.info[t].shape:
            n *= s
        numel += n
    return ops, numel, tiling


# ----------------------------------------------------------------------------- kernel-level edits


def rebuild(graph: KernelGraph, subst: dict[int, int] | None = None, outputs: tuple[int, ...] | None = None, keep_inputs: bool = True) -> KernelGraph:
    """``graph`` with tensor uses substituted, unused operators removed (and unused
    inputs too unless ``keep_inputs``), tensors renumbered."""
    subst = subst or {}
    outputs = tuple(subst.get(t, t) for t in (outputs if outputs is not None else graph.outputs))

    def res(t: int) -> int:
        while t in subst:
            t = subst[t]
        return t

    prod = graph.tensor_producers
    live_ops: set[int] = set()
    stack = [prod[res(t)][0] for t in outputs]
    while stack:
        i = stack.pop()
        if i in live_ops:
            continue
        live_ops.add(i)
        stack.extend(prod[res(t)][0] for t in graph.ops[i].inputs)
    ops: list[Op] = []
    env: dict[int, int] = {}
    n = 0
    for i, op in enumerate(graph.ops):
        first = prod.index((i, 0)) if op.num_outputs else None
        if i not in live_ops and not (keep_inputs and op.kind == "input"):
            continue
        ops.append(Op(op.kind, tuple(env[res(t)] for t in op.inputs), op.attrs, op.block))
        for j in range(op.num_outputs):
            env[first + j] = n
            n += 1
    return KernelGraph(tuple(ops), tuple(env[res(t)] for t in outputs))


def _block_rebuild(blk: BlockGraph, subst: dict[int, int]) -> tuple[BlockGraph, list[int]]:
    """Block graph with tile uses substituted and dead tiles removed; also returns the
    kernel-input sources still used (in order), the new block reading them renumbered."""
    n_in = len(blk.inputs)

    def res(t: int) -> int:
        while t in subst:
            t = subst[t]
        return t

    live: set[int] = set()
    stack = [res(bo.tensor) for bo in blk.outputs]
    while stack:
        t = stack.pop()
        if t in live:
            continue
        live.add(t)
        if t >= n_in:
            stack.extend(res(x) for x in blk.ops[t - n_in].inputs)
    env: dict[int, int] = {}
    inputs = []
    sources: list[int] = []
    for j, bi in enumerate(blk.inputs):
        if j in live:
            if bi.source not in sources:
                sources.append(bi.source)
            env[j] = len(inputs)
            inputs.append(BlockInput(sources.index(bi.source), bi.input_map, bi.forloop_dim))
    ops = []
    for j, op in enumerate(blk.ops):
        t = n_in + j
        if t in live:
            env[t] = len(inputs) + len(ops)
            ops.append(Op(op.kind, tuple(env[res(x)] for x in op.inputs), op.attrs, op.block))
    outs = tuple(BlockOutput(env[res(bo.tensor)], bo.output_map) for bo in blk.outputs)
    return BlockGraph(blk.grid, blk.forloop_range, tuple(inputs), tuple(ops), outs), sources


def _with_block(graph: KernelGraph, i: int, blk: BlockGraph, sources: list[int] | None = None) -> KernelGraph:
    op = graph.ops[i]
    ins = op.inputs if sources is None else tuple(op.inputs[s] for s in sources)
    ops = list(graph.ops)
    ops[i] = Op(op.kind, ins, op.attrs, blk)
    return KernelGraph(tuple(ops), graph.outputs)


def variants(graph: KernelGraph, keep_signature: bool) -> Iterator[KernelGraph]:
    """Smaller candidates of one graph (see the module docstring), most reducing first."""
    info = graph.info
    prod = graph.tensor_producers
    if len(graph.outputs) > 1 and not keep_signature:
        for t in graph.outputs:
            yield rebuild(graph, outputs=(t,), keep_inputs=False)
    # bypass kernel operators
    for i, op in reversed(list(enumerate(graph.ops))):
        if op.kind in ("input",) or op.num_outputs != 1:
            continue
        t = prod.index((i, 0))
        for x in dict.fromkeys(op.inputs):
            if info[x].shape == info[t].shape and info[x].dtype == info[t].dtype:
                yield rebuild(graph, {t: x}, keep_inputs=keep_signature)
    # bypass block operators
    for i, op in enumerate(graph.ops):
        if op.kind != "customized":
            continue
        blk = op.block
        from mirage_serve.mugraph.shapes import block_tile_infos

        try:
            tiles = block_tile_infos(blk, [info[t] for t in op.inputs])
        except MuGraphError:
            continue
        n_in = len(blk.inputs)
        for j in reversed(range(len(blk.ops))):
            t = n_in + j
            for x in dict.fromkeys(blk.ops[j].inputs):
                if tiles[x].shape == tiles[t].shape:
                    nb, src = _block_rebuild(blk, {t: x})
                    yield rebuild(_with_block(graph, i, nb, src), keep_inputs=keep_signature)
        # a dead block output removed (not the customized op's last output, which keeps tensors numbered)
        for k in range(len(blk.outputs)):
            if len(blk.outputs) > 1:
                first = prod.index((i, 0))
                if first + k not in graph.outputs and not any(first + k in o.inputs for o in graph.ops):
                    outs = blk.outputs[:k] + blk.outputs[k + 1 :]
                    nb, src = _block_rebuild(replace(blk, outputs=outs), {})
                    yield _drop_block_output(graph, i, k, nb, src)
    # grid and loop
    for i, op in enumerate(graph.ops):
        if op.kind != "customized":
            continue
        blk = op.block
        for g, size in enumerate(blk.grid):
            if size > 1:
                yield _with_block(graph, i, replace(blk, grid=blk.grid[:g] + (1,) + blk.grid[g + 1 :]))
        for r in range(1, blk.forloop_range):
            if blk.forloop_range % r == 0:
                yield _with_block(graph, i, replace(blk, forloop_range=r))


def _drop_block_output(graph: KernelGraph, i: int, k: int, nb: BlockGraph, src: list[int]) -> KernelGraph:
    """Remove output ``k`` of customized op ``i`` (unused), renumbering later tensors."""
    prod = graph.tensor_producers
    first = prod.index((i, 0))
    old_n = graph.ops[i].num_outputs

    def m(t: int) -> int:
        if t < first + k:
            return t
        if t == first + k:
            raise MuGraphError("the dropped output is used")
        return t - 1

    ops = []
    for j, op in enumerate(graph.ops):
        if j == i:
            ops.append(Op(op.kind, tuple(op.inputs[s] for s in src), op.attrs, nb))
        else:
            ops.append(Op(op.kind, tuple(m(t) for t in op.inputs), op.attrs, op.block))
    assert old_n == len(nb.outputs) + 1
    return KernelGraph(tuple(ops), tuple(m(t) for t in graph.outputs))


def input_shapes(graph: KernelGraph) -> list[tuple[int, ...]]:
    return [graph.info[t].shape for t in graph.input_ids]


def with_input_shapes(graph: KernelGraph, shapes: list[tuple[int, ...]]) -> KernelGraph:
    ops, k = [], 0
    for op in graph.ops:
        if op.kind == "input":
            op = Op.make("input", (), name=op.attr("name"), shape=tuple(shapes[k]), dtype=op.attr("dtype", "float32"), strides=op.attr("strides"))
            k += 1
        ops.append(op)
    return KernelGraph(tuple(ops), graph.outputs)


def shape_moves(shapes: list[tuple[int, ...]]) -> Iterator[list[tuple[int, ...]]]:
    """Smaller input shapes: a size replaced everywhere, then at single positions."""
    values = sorted({s for sh in shapes for s in sh if s > 1}, reverse=True)
    for v in values:
        for w in sorted({1, v // 2, v // 3, v // 4, 2} - {0, v}):
            if w < v:
                yield [tuple(w if s == v else s for s in sh) for sh in shapes]
    for a, sh in enumerate(shapes):
        for d, v in enumerate(sh):
            for w in sorted({1, v // 2} - {0, v}):
                new = list(shapes)
                new[a] = sh[:d] + (w,) + sh[d + 1 :]
                yield new


def minimise(graphs: Graphs, still_fails: Callable[[Graphs], bool], budget_s: float = 120.0, max_steps: int = 400, joint_only: bool = False) -> Graphs:
    """Greedy minimisation of ``graphs`` (one graph, or a pair with a shared signature).
    ``joint_only``: only shrink the input shapes of all graphs together (for pairs whose
    failure is that they differ: shrinking one side alone would keep "differ" true)."""
    deadline = time.monotonic() + budget_s
    cur = dict(graphs)
    pair = len(cur) > 1
    steps = 0

    def candidates(c: Graphs) -> Iterator[Graphs]:
        names = list(c)
        shapes = input_shapes(c[names[0]])
        for new in shape_moves(shapes):
            out = {n: _valid(with_input_shapes(g, new)) for n, g in c.items()}
            if all(v is not None for v in out.values()):
                yield out
        for n in [] if joint_only else names:
            for v in variants(c[n], keep_signature=pair):
                v = _valid(v)
                if v is not None and _size(v) < _size(c[n]):
                    yield {**c, n: v}

    progress = True
    while progress and steps < max_steps and time.monotonic() < deadline:
        progress = False
        for cand in candidates(cur):
            steps += 1
            if steps >= max_steps or time.monotonic() >= deadline:
                break
            try:
                ok = still_fails(cand)
            except Exception:  # noqa: BLE001 - a candidate that breaks differently is not the same failure
                ok = False
            if ok:
                cur = cand
                progress = True
                break
    return cur
