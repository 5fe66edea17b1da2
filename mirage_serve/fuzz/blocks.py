"""Random block graphs built operator by operator, without a spec.

Unlike :mod:`mirage_serve.fuzz.programs` these need not mean anything: any
graph the IR accepts is fair (any input map and for-loop dim, reductions over
any tile dim, concat, sum_to, every accumulator, partial outputs, up to three
grid dims). They test the code generator and the reference against each other,
and the verifier against float64 on their mutants.
"""

from __future__ import annotations

import random

from mirage_serve.mugraph.graph import ACCUM_FNS, BINARY_FNS, UNARY_FNS, BlockBuilder, GraphBuilder, KernelGraph, MuGraphError, Op
from mirage_serve.mugraph.shapes import _PHASE_RANK, TensorInfo, _infer_accum, infer_tile_op

TILE_DIMS = (1, 2, 3, 4, 4, 8, 16)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _infer(op: Op, tiles: list[TensorInfo], maxes: set[int], tid: int) -> TensorInfo:
    ins = [tiles[t] for t in op.inputs]
    if op.kind == "accum":
        return _infer_accum(op, ins, list(op.inputs), maxes, "fuzz")
    info = infer_tile_op(op, ins, "fuzz")
    phases = {t.phase for t in ins}
    if "loop" in phases and "post" in phases:
        raise MuGraphError("mixes phases")
    return TensorInfo(info.shape, info.dtype, max(phases, key=_PHASE_RANK.__getitem__) if phases else "invariant")


def random_block_graph(rng: random.Random, dtype: str | None = None) -> KernelGraph:
    """A random valid kernel graph with one customized operator (and sometimes a kernel op after it)."""
    for _ in range(100):
        try:
            return _attempt(rng, dtype or rng.choice(("float32", "float32", "bfloat16", "float16")))
        except MuGraphError:
            continue
    raise MuGraphError("no random block graph in 100 attempts")


def _attempt(rng: random.Random, dtype: str) -> KernelGraph:
    n_grid = rng.choice((1, 1, 2, 2, 3))
    grid = [rng.choice((1, 2, 2, 3, 4)) for _ in range(n_grid)]
    while _numel(tuple(grid)) > 8:
        grid[rng.randrange(n_grid)] = 1
    loop = rng.choice((1, 2, 2, 3, 4))
    pool = [rng.choice(TILE_DIMS) for _ in range(3)]
    g = GraphBuilder()
    b = BlockBuilder(tuple(grid), loop)
    tiles: list[TensorInfo] = []
    kins = []
    for j in range(rng.randint(1, 3)):
        rank = rng.choice((1, 2, 2, 3))
        start = rng.randrange(0, 4 - rank)
        tile = [pool[start + d] if rng.random() < 0.85 else 1 for d in range(rank)]
        shape = list(tile)
        imap = []
        used: set[int] = set()
        for gd in range(n_grid):
            free = [d for d in range(rank) if d not in used]
            d = rng.choice(free + [-1] * 2) if free else -1
            imap.append(d)
            if d >= 0:
                used.add(d)
                shape[d] *= grid[gd]
        fdim = rng.choice(list(range(rank)) + [-1])
        if fdim >= 0:
            shape[fdim] *= loop
        if _numel(tuple(shape)) > 2048:
            raise MuGraphError("too large")
        kins.append(g.input(f"x{j}", tuple(shape), dtype))
        b.input(j, tuple(imap), fdim)
        tiles.append(TensorInfo(tuple(tile), dtype, "loop" if fdim >= 0 and loop >= 1 else "invariant"))
    maxes: set[int] = set()
    for _ in range(rng.randint(1, 7)):
        for _try in range(20):
            op = _random_tile_op(rng, tiles, maxes)
            try:
                info = _infer(op, tiles, maxes, len(tiles))
            except MuGraphError:
                continue
            if not 1 <= len(info.shape) <= 3 or _numel(info.shape) > 1024:
                continue
            if op.kind == "accum" and op.attr("fn") == "max_last":
                maxes.add(len(tiles))
            b.ops.append(op)
            tiles.append(info)
            break
    outs = [t for t in range(len(tiles)) if tiles[t].phase != "loop"]
    if not outs:
        raise MuGraphError("nothing to output")
    chosen = sorted(set([outs[-1]] + ([rng.choice(outs)] if rng.random() < 0.3 else [])))
    for t in chosen:
        rank = len(tiles[t].shape)
        om, used = [], set()
        for _ in range(n_grid):
            free = [d for d in range(rank) if d not in used]
            d = rng.choice(free + [-1]) if free else -1
            if d >= 0:
                used.add(d)
            om.append(d)
        b.output(t, tuple(om))
    res = g.customized(kins, b.build())
    graph_outs = list(res)
    if rng.random() < 0.3:  # combine the first output's partial or leading dim at kernel level
        first = res[0]
        gi = GraphBuilder()
        gi.ops, gi._n = list(g.ops), g._n
        info = KernelGraph(tuple(g.ops), tuple(res)).validate().info[first]
        if len(info.shape) > 1:
            graph_outs[0] = gi.reduce(rng.choice(("sum", "max")), first, 0, keepdim=False)
            g = gi
    return g.build(graph_outs)


def _random_tile_op(rng: random.Random, tiles: list[TensorInfo], maxes: set[int]) -> Op:
    n = len(tiles)
    last = n - 1 if rng.random() < 0.5 else rng.randrange(n)
    r = rng.random()
    if r < 0.22:
        fn = rng.choice(UNARY_FNS)
        return Op.make("unary", (last,), fn=fn, scalar=rng.choice((0.5, 2.0, -1.0, 0.3)) if fn in ("mul_scalar", "add_scalar") else None)
    if r < 0.42:
        return Op.make("binary", (last, rng.randrange(n)) if rng.random() < 0.5 else (rng.randrange(n), last), fn=rng.choice(BINARY_FNS))
    if r < 0.55:
        return Op.make("matmul", (last, rng.randrange(n)), trans_b=rng.random() < 0.5 or None)
    if r < 0.65:
        rank = len(tiles[last].shape)
        return Op.make("reduce", (last,), fn=rng.choice(("sum", "max")), dim=rng.randrange(-rank, rank), keepdim=rng.random() < 0.7)
    if r < 0.7:
        w = rng.randrange(n)
        return Op.make("rms_norm", (last, w) if rng.random() < 0.5 else (last,), eps=rng.choice((1e-6, 0.1)))
    if r < 0.75:
        rank = len(tiles[last].shape)
        return Op.make("concat", (last, rng.randrange(n)), dim=rng.randrange(rank))
    if r < 0.8:
        return Op.make("sum_to", (last,), size=rng.choice((1, 2, 4)))
    fn = rng.choice(ACCUM_FNS)
    if fn.startswith("rescaled"):
        if not maxes:
            fn = "max_last"
        else:
            return Op.make("accum", (last, rng.choice(sorted(maxes))), fn=fn)
    return Op.make("accum", (last,), fn=fn, size=rng.choice((1, 2, 4)) if fn == "sum_to" else None)
