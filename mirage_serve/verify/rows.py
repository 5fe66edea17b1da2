"""Row-separable graphs: verifying a large instance on a few of its rows.

Decode attention's inputs are stacks of independent problems: row ``i`` of Q, K and V (one
batch element and KV head) determines row ``i`` of the output and nothing else. When both a
candidate and its spec are *row-separable* in the sense checked here, the graph applies one and
the same function to every group of ``T`` consecutive rows, so the two agree on ``N`` rows if
and only if they agree on any ``N' < N`` rows (``N'`` a multiple of ``T``): the smaller instance
has exactly the same per-group computation, only fewer groups. :func:`verify_equivalent`
(``max_rows``) uses this to verify buckets whose full-size evaluation would not fit in memory.

A kernel graph is row-separable along dim 0 of its inputs (all inputs must have the same
number ``N`` of rows there) when every tensor it computes keeps a *row dim* of size ``N``, row
``j`` of which depends only on row ``j``'s group of the inputs:

* element-wise operators, reductions and normalisations over other dims, concatenation along
  other dims and batched matmuls whose batch dim is the row dim keep it (groups of one row);
* a customized operator keeps it when one grid dim ``g`` splits the row dim of *every* block
  input (no input is replicated across ``g`` or streamed along its rows by the for-loop) and
  every block output is tiled by ``g`` back into a row dim of size ``N``; its groups are the
  ``N / grid[g]`` rows one program reads. Block programs have no access to their grid position,
  so every program runs the same computation on its own rows.

The group size ``T`` of the graph is the least common multiple of its operators' groups.
Anything else (a reduction over rows, a broadcast across rows, inputs with explicit strides, an
operator not listed above) makes the graph not row-separable, and it is verified at full size.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mirage_serve.mugraph.graph import KernelGraph, MuGraphError, Op

# peak memory of verifying on CPU relative to the inputs' float64 size: the verifier evaluates both
# graphs in float64 and over Z_p in int64; measured at ~4x (attention_decode b=16, kv_len=16384:
# 17.6 GB RSS for 4.3 GB of K and V in float64)
VERIFY_MEMORY_FACTOR = 4


@dataclass(frozen=True)
class RowSplit:
    """How a row-separable graph splits: ``rows`` (N), the group size, and for each customized
    operator (by op index) the grid dim that splits the rows."""

    rows: int
    group: int
    grid_dims: tuple[tuple[int, int], ...]


def verify_memory_bytes(spec: KernelGraph, rows: int | None = None) -> int:
    """Rough peak memory of verifying against ``spec`` on CPU (with ``rows`` of its rows, when given
    and the inputs have that many or more)."""
    total = 0
    for t in spec.input_ids:
        shape = spec.info[t].shape
        n = math.prod(shape)
        if rows is not None and shape and shape[0] > rows:
            n = n // shape[0] * rows
        total += n
    return VERIFY_MEMORY_FACTOR * 8 * total


def rows_within_memory(spec: KernelGraph, available: int | None = None) -> int | None:
    """None when verifying against ``spec`` at full size fits in ``available`` bytes (default: the
    system's available memory; None when unknown); otherwise the most rows whose verification
    fits in half of it (0 when not even one does)."""
    if available is None:
        from mirage_serve.memory import available_memory_bytes

        available = available_memory_bytes()
    if available is None or verify_memory_bytes(spec) <= available:
        return None
    return (available // 2) // max(1, verify_memory_bytes(spec, rows=1))


def row_split(graph: KernelGraph) -> RowSplit | None:
    """The graph's :class:`RowSplit` if it is row-separable (see the module docstring), else None."""
    try:
        info = graph.info
    except MuGraphError:
        return None
    row_dim: dict[int, int] = {}
    rows: int | None = None
    group = 1
    grid_dims: list[tuple[int, int]] = []
    t = 0  # id of the next tensor produced
    for i, op in enumerate(graph.ops):
        if op.kind == "input":
            shape = info[t].shape
            if op.attr("strides") is not None or not shape or (rows is not None and shape[0] != rows):
                return None
            rows = shape[0]
            row_dim[t] = 0
            t += 1
            continue
        ins = [row_dim.get(x) for x in op.inputs]
        if any(r is None for r in ins):
            return None
        if op.kind == "customized":
            found = _customized_rows(op, [info[x].shape for x in op.inputs], ins)
            if found is None:
                return None
            g, out_dims = found
            n_rows = info[op.inputs[0]].shape[ins[0]] if op.inputs else 0
            for j, d in enumerate(out_dims):
                if info[t + j].shape[d] != n_rows:
                    return None
                row_dim[t + j] = d
            group = math.lcm(group, n_rows // op.block.grid[g])
            grid_dims.append((i, g))
            t += op.num_outputs
            continue
        r = _kernel_op_rows(op, [info[x].shape for x in op.inputs], ins, info[t].shape, rows)
        if r is None:
            return None
        row_dim[t] = r
        t += 1
    if rows is None or not graph.outputs or any(row_dim.get(o) != 0 for o in graph.outputs):
        return None
    return RowSplit(rows, group, tuple(grid_dims))


def _kernel_op_rows(op: Op, shapes: list[tuple[int, ...]], ins: list[int], out: tuple[int, ...], rows: int | None) -> int | None:
    """Row dim of a kernel-level operator's output, or None when it mixes or broadcasts rows."""
    r = ins[0]
    rank = len(shapes[0])
    if any(x != r for x in ins) or any(len(s) != rank for s in shapes) or any(s[r] != rows for s in shapes):
        return None  # operands of different ranks (a broadcast across rows) or with rows in different dims
    out_r: int | None = None
    if op.kind in ("unary", "binary"):
        out_r = r
    elif op.kind == "matmul":
        out_r = r if r < rank - 2 else None  # rows are a batch dim of both operands
    elif op.kind == "reduce":
        d = op.attr("dim", -1) % rank
        out_r = None if d == r else (r - 1 if d < r and not op.attr("keepdim", True) else r)
    elif op.kind == "rms_norm":
        out_r = r if len(op.inputs) == 1 and r != rank - 1 else None
    elif op.kind == "concat":
        out_r = r if op.attr("dim", 0) % rank != r else None
    if out_r is None or out_r >= len(out) or out[out_r] != rows:
        return None
    return out_r


def _customized_rows(op: Op, shapes: list[tuple[int, ...]], ins: list[int]) -> tuple[int, list[int]] | None:
    """(grid dim splitting the rows, row dim of each output) of a customized operator, or None."""
    block = op.block
    if block is None or not block.inputs:
        return None
    for g in range(len(block.grid)):
        if all(bi.input_map[g] == ins[bi.source] and bi.forloop_dim != ins[bi.source] for bi in block.inputs):
            out_dims = []
            for bo in block.outputs:
                d = bo.output_map[g]
                if d == -1:
                    break
                partial = sum(1 for h, dd in enumerate(bo.output_map) if dd == -1 and block.grid[h] > 1)
                out_dims.append(partial + d)
            else:
                return g, out_dims
    return None


def with_rows(graph: KernelGraph, rows: int) -> KernelGraph:
    """``graph`` on ``rows`` rows instead of its own: the inputs' dim 0 and each customized
    operator's row grid dim are rescaled, nothing else changes. ``rows`` must be a multiple of
    the graph's group size; raises ValueError when the graph is not row-separable."""
    split = row_split(graph)
    if split is None:
        raise ValueError("the graph is not row-separable along dim 0 of its inputs")
    if rows <= 0 or rows % split.group:
        raise ValueError(f"{rows} rows is not a positive multiple of the graph's row group ({split.group})")
    if rows == split.rows:
        return graph
    dims = dict(split.grid_dims)
    ops = []
    for i, op in enumerate(graph.ops):
        if op.kind == "input":
            shape = (rows, *op.attr("shape")[1:])
            op = Op.make("input", (), None, **{**op.a, "shape": shape})
        elif op.kind == "customized":
            g = dims[i]
            per_block = split.rows // op.block.grid[g]
            grid = list(op.block.grid)
            grid[g] = rows // per_block
            op = dataclasses.replace(op, block=dataclasses.replace(op.block, grid=tuple(grid)))
        ops.append(op)
    return KernelGraph(tuple(ops), graph.outputs).validate()


def common_group(*graphs: KernelGraph) -> tuple[int, int] | None:
    """(rows, group size) shared by row-separable graphs over the same rows, else None."""
    splits = [row_split(g) for g in graphs]
    if any(s is None for s in splits) or len({s.rows for s in splits}) != 1:
        return None
    return splits[0].rows, math.lcm(*(s.group for s in splits))


def reduced_rows(rows: int, group: int, max_rows: int) -> int | None:
    """The most rows, a multiple of ``group`` dividing ``rows`` and at most ``max_rows``, or None."""
    best = None
    for n in range(group, min(rows, max_rows) + 1, group):
        if rows % n == 0:
            best = n
    return best
