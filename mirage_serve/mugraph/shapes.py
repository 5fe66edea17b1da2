"""Shape and dtype inference with validation for kernel and block graphs.

Every error is a :class:`MuGraphError` whose message names the operator (by
position and kind), the dimension involved and what was expected.

Phases of block-graph tensors: ``invariant`` (loaded without a for-loop dim, or
computed only from such tiles; usable anywhere), ``loop`` (one value per
iteration), ``post`` (after an accumulator; computed once) and ``both`` (the
running max of a ``max_last`` accumulator: m_i inside the loop, m_R after it).
An operator may not mix ``loop`` and ``post`` inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirage_serve.mugraph.graph import (
    ACCUM_FNS,
    BINARY_FNS,
    DTYPES,
    MAX_GRID_DIMS,
    MAX_RANK,
    REDUCE_FNS,
    TILE_KINDS,
    UNARY_FNS,
    BlockGraph,
    KernelGraph,
    MuGraphError,
    Op,
)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    phase: str = "global"  # block tiles: invariant | loop | post | both

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


_PHASE_RANK = {"invariant": 0, "both": 1, "loop": 2, "post": 2}


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def broadcast_shapes(a: tuple[int, ...], b: tuple[int, ...], where: str) -> tuple[int, ...]:
    n = max(len(a), len(b))
    pa, pb = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for d, (x, y) in enumerate(zip(pa, pb, strict=True)):
        if x != y and x != 1 and y != 1:
            raise MuGraphError(f"{where}: shapes {list(a)} and {list(b)} do not broadcast (dim {d}: {x} vs {y})")
        out.append(max(x, y))
    return tuple(out)


def _norm_dim(dim: int, rank: int, where: str) -> int:
    if not -rank <= dim < rank:
        raise MuGraphError(f"{where}: dim {dim} out of range for rank {rank}")
    return dim % rank


def _check_shape(shape: tuple[int, ...], where: str) -> None:
    if not 1 <= len(shape) <= MAX_RANK:
        raise MuGraphError(f"{where}: rank {len(shape)} not supported (1..{MAX_RANK})")
    for d, s in enumerate(shape):
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise MuGraphError(f"{where}: dim {d} has size {s!r}; sizes must be positive integers")


def infer_tile_op(op: Op, ins: list[TensorInfo], where: str) -> TensorInfo:
    """Output shape of a tile/element operator shared by both levels (not accum)."""
    kind = op.kind
    if kind == "matmul":
        if len(ins) != 2:
            raise MuGraphError(f"{where}: matmul takes 2 inputs, got {len(ins)}")
        a, b = ins[0].shape, ins[1].shape
        if len(a) < 2 or len(b) < 2:
            raise MuGraphError(f"{where}: matmul needs rank >= 2 operands, got {list(a)} and {list(b)}")
        bk, bn = (b[-1], b[-2]) if op.attr("trans_b") else (b[-2], b[-1])
        if a[-1] != bk:
            raise MuGraphError(
                f"{where}: inner dims differ: a{list(a)} has {a[-1]} columns, b{list(b)} has {bk} "
                f"{'columns (trans_b)' if op.attr('trans_b') else 'rows'}"
            )
        if len(b) != 2 and a[:-2] != b[:-2]:
            raise MuGraphError(f"{where}: batch dims differ: {list(a[:-2])} vs {list(b[:-2])} (b may also be rank 2)")
        return TensorInfo(a[:-1] + (bn,), ins[0].dtype)
    if kind == "unary":
        fn = op.attr("fn")
        if fn not in UNARY_FNS:
            raise MuGraphError(f"{where}: unknown unary fn {fn!r}; known: {list(UNARY_FNS)}")
        if (fn in ("mul_scalar", "add_scalar")) != (op.attr("scalar") is not None):
            raise MuGraphError(f"{where}: 'scalar' is required for mul_scalar/add_scalar and only for them")
        _arity(ins, 1, where)
        return TensorInfo(ins[0].shape, ins[0].dtype)
    if kind == "binary":
        fn = op.attr("fn")
        if fn not in BINARY_FNS:
            raise MuGraphError(f"{where}: unknown binary fn {fn!r}; known: {list(BINARY_FNS)}")
        _arity(ins, 2, where)
        return TensorInfo(broadcast_shapes(ins[0].shape, ins[1].shape, where), ins[0].dtype)
    if kind == "reduce":
        fn = op.attr("fn")
        if fn not in REDUCE_FNS:
            raise MuGraphError(f"{where}: unknown reduction {fn!r}; known: {list(REDUCE_FNS)}")
        _arity(ins, 1, where)
        shape = ins[0].shape
        d = _norm_dim(op.attr("dim", -1), len(shape), where)
        if op.attr("keepdim", True):
            out = shape[:d] + (1,) + shape[d + 1 :]
        else:
            out = shape[:d] + shape[d + 1 :]
            if not out:
                raise MuGraphError(f"{where}: reducing the only dim without keepdim leaves a scalar")
        return TensorInfo(out, ins[0].dtype)
    if kind == "rms_norm":
        if len(ins) not in (1, 2):
            raise MuGraphError(f"{where}: rms_norm takes x and optionally a weight, got {len(ins)} inputs")
        if len(ins) == 2:
            if ins[1].shape[-1] != ins[0].shape[-1]:
                raise MuGraphError(
                    f"{where}: weight's last dim {ins[1].shape[-1]} != hidden size {ins[0].shape[-1]} of x{list(ins[0].shape)}"
                )
            out = broadcast_shapes(ins[0].shape, ins[1].shape, where)
            if out != ins[0].shape:
                raise MuGraphError(
                    f"{where}: weight{list(ins[1].shape)} would broadcast x{list(ins[0].shape)} to {list(out)}; "
                    "rms_norm keeps the shape of x, so the weight must broadcast to it"
                )
        return TensorInfo(ins[0].shape, ins[0].dtype)
    if kind == "concat":
        if not ins:
            raise MuGraphError(f"{where}: concat needs at least one input")
        rank = len(ins[0].shape)
        d = _norm_dim(op.attr("dim", 0), rank, where)
        total = 0
        for j, t in enumerate(ins):
            if len(t.shape) != rank or any(t.shape[k] != ins[0].shape[k] for k in range(rank) if k != d):
                raise MuGraphError(
                    f"{where}: input {j} shape {list(t.shape)} does not match {list(ins[0].shape)} except in dim {d}"
                )
            total += t.shape[d]
        return TensorInfo(ins[0].shape[:d] + (total,) + ins[0].shape[d + 1 :], ins[0].dtype)
    if kind == "sum_to":
        _arity(ins, 1, where)
        return TensorInfo(_sum_to_shape(ins[0].shape, op.attr("size"), where), ins[0].dtype)
    raise MuGraphError(f"{where}: unknown operator kind {kind!r}")


def _arity(ins: list[TensorInfo], n: int, where: str) -> None:
    if len(ins) != n:
        raise MuGraphError(f"{where}: takes {n} input(s), got {len(ins)}")


def _sum_to_shape(shape: tuple[int, ...], size: object, where: str) -> tuple[int, ...]:
    if not isinstance(size, int) or size < 1 or shape[-1] % size:
        raise MuGraphError(f"{where}: sum_to size {size!r} must divide the last dim {shape[-1]}")
    return shape[:-1] + (size,)


def infer_kernel(graph: KernelGraph) -> tuple[TensorInfo, ...]:
    """Infer (and validate) every tensor of a kernel graph."""
    infos: list[TensorInfo] = []
    for i, op in enumerate(graph.ops):
        where = f"kernel op {i} ({op.describe()})"
        for t in op.inputs:
            if not 0 <= t < len(infos):
                raise MuGraphError(f"{where}: reads tensor {t}, which is not produced before it")
        ins = [infos[t] for t in op.inputs]
        if op.kind == "input":
            shape = op.attr("shape")
            if not isinstance(shape, tuple):
                raise MuGraphError(f"{where}: input needs a 'shape'")
            _check_shape(shape, where)
            dtype = op.attr("dtype", "float32")
            if dtype not in DTYPES:
                raise MuGraphError(f"{where}: dtype {dtype!r} not supported; use one of {list(DTYPES)}")
            infos.append(TensorInfo(shape, dtype))
        elif op.kind == "customized":
            if op.block is None:
                raise MuGraphError(f"{where}: customized operator without a block graph")
            infos.extend(infer_block(op.block, ins, where))
        elif op.kind == "accum" or op.kind == "sum_to":
            raise MuGraphError(f"{where}: {op.kind!r} is a block-level operator")
        else:
            out = infer_tile_op(op, ins, where)
            _check_shape(out.shape, where)
            infos.append(out)
    if not graph.outputs:
        raise MuGraphError("kernel graph has no outputs")
    for t in graph.outputs:
        if not 0 <= t < len(infos):
            raise MuGraphError(f"kernel graph output {t} is not a tensor of the graph ({len(infos)} tensors)")
    return tuple(infos)


def tile_shape_of_input(shape: tuple[int, ...], grid: tuple[int, ...], imap: tuple[int, ...], fdim: int, rng: int, where: str) -> tuple[int, ...]:
    """Tile shape that one block loads per iteration from a tensor of ``shape``."""
    rank = len(shape)
    if len(imap) != len(grid):
        raise MuGraphError(f"{where}: input_map has {len(imap)} entries for a {len(grid)}-dim grid")
    tile = list(shape)
    used: dict[int, int] = {}
    for g, d in enumerate(imap):
        if d == -1:
            continue
        if not 0 <= d < rank:
            raise MuGraphError(f"{where}: input_map[{g}] = {d} is not a dim of a rank-{rank} tensor")
        if d in used:
            raise MuGraphError(f"{where}: tensor dim {d} is split by grid dims {used[d]} and {g}")
        used[d] = g
        if tile[d] % grid[g]:
            raise MuGraphError(f"{where}: dim {d} (size {tile[d]}) does not divide evenly over grid dim {g} (size {grid[g]})")
        tile[d] //= grid[g]
    if fdim != -1:
        if not 0 <= fdim < rank:
            raise MuGraphError(f"{where}: forloop_dim {fdim} is not a dim of a rank-{rank} tensor")
        if tile[fdim] % rng:
            raise MuGraphError(
                f"{where}: for-loop dim {fdim} (size {tile[fdim]} per block) does not divide into {rng} iterations"
            )
        tile[fdim] //= rng
    return tuple(tile)


def output_shape_of_tile(tile: tuple[int, ...], grid: tuple[int, ...], omap: tuple[int, ...], where: str) -> tuple[int, ...]:
    """Kernel tensor shape that a block output of tile shape ``tile`` writes."""
    if len(omap) != len(grid):
        raise MuGraphError(f"{where}: output_map has {len(omap)} entries for a {len(grid)}-dim grid")
    shape = list(tile)
    used: dict[int, int] = {}
    partial: list[int] = []
    for g, d in enumerate(omap):
        if d == -1:
            if grid[g] > 1:
                partial.append(grid[g])
            continue
        if not 0 <= d < len(tile):
            raise MuGraphError(f"{where}: output_map[{g}] = {d} is not a dim of the rank-{len(tile)} tile")
        if d in used:
            raise MuGraphError(f"{where}: output dim {d} is tiled by grid dims {used[d]} and {g}")
        used[d] = g
        shape[d] *= grid[g]
    out = tuple(partial) + tuple(shape)
    if len(out) > MAX_RANK:
        raise MuGraphError(f"{where}: output rank {len(out)} (with {len(partial)} partial dims) exceeds {MAX_RANK}")
    return out


def infer_block(block: BlockGraph, kernel_inputs: list[TensorInfo], where: str = "block graph") -> list[TensorInfo]:
    """Validate a block graph against the kernel tensors it reads; return the
    infos of the kernel tensors it writes (one per block output)."""
    return [info for info, _ in _infer_block_full(block, kernel_inputs, where)[1]]


def block_tile_infos(block: BlockGraph, kernel_inputs: list[TensorInfo], where: str = "block graph") -> list[TensorInfo]:
    """Infos (shape, dtype, phase) of every tile tensor of a block graph."""
    return _infer_block_full(block, kernel_inputs, where)[0]


def _infer_block_full(block: BlockGraph, kernel_inputs: list[TensorInfo], where: str):
    grid, rng = block.grid, block.forloop_range
    if not 1 <= len(grid) <= MAX_GRID_DIMS or any((not isinstance(g, int)) or g < 1 for g in grid):
        raise MuGraphError(f"{where}: grid {list(grid)} must have 1..{MAX_GRID_DIMS} positive dims")
    if not isinstance(rng, int) or rng < 1:
        raise MuGraphError(f"{where}: forloop_range {rng!r} must be a positive integer")
    tiles: list[TensorInfo] = []
    for j, bi in enumerate(block.inputs):
        w = f"{where}, block input {j}"
        if not 0 <= bi.source < len(kernel_inputs):
            raise MuGraphError(f"{w}: source {bi.source} is not one of the {len(kernel_inputs)} kernel inputs")
        src = kernel_inputs[bi.source]
        shape = tile_shape_of_input(src.shape, grid, bi.input_map, bi.forloop_dim, rng, w)
        tiles.append(TensorInfo(shape, src.dtype, "invariant" if bi.forloop_dim == -1 else "loop"))
    max_outputs: set[int] = set()
    for i, op in enumerate(block.ops):
        tid = len(tiles)
        w = f"{where}, block op {i} ({op.describe()})"
        for t in op.inputs:
            if not 0 <= t < tid:
                raise MuGraphError(f"{w}: reads tile {t}, which is not produced before it")
        ins = [tiles[t] for t in op.inputs]
        if op.kind == "accum":
            info = _infer_accum(op, ins, list(op.inputs), max_outputs, w)
            if op.attr("fn") == "max_last":
                max_outputs.add(tid)
        elif op.kind in TILE_KINDS:
            info = infer_tile_op(op, ins, w)
            phases = {t.phase for t in ins}
            if "loop" in phases and "post" in phases:
                raise MuGraphError(f"{w}: mixes a per-iteration tile with an accumulated one; accumulate first")
            phase = max(phases, key=_PHASE_RANK.__getitem__) if phases else "invariant"
            info = TensorInfo(info.shape, info.dtype, phase)
        else:
            raise MuGraphError(f"{w}: {op.kind!r} is not a block-level operator")
        if not 1 <= len(info.shape) <= MAX_RANK:
            raise MuGraphError(f"{w}: tile rank {len(info.shape)} not supported")
        tiles.append(info)
    if not block.outputs:
        raise MuGraphError(f"{where}: block graph has no outputs")
    outs = []
    for j, bo in enumerate(block.outputs):
        w = f"{where}, block output {j}"
        if not 0 <= bo.tensor < len(tiles):
            raise MuGraphError(f"{w}: tile {bo.tensor} does not exist")
        t = tiles[bo.tensor]
        if t.phase == "loop":
            raise MuGraphError(f"{w}: tile {bo.tensor} is a per-iteration value; outputs must be accumulated first")
        outs.append((TensorInfo(output_shape_of_tile(t.shape, grid, bo.output_map, w), t.dtype), t))
    return tiles, outs


def _infer_accum(op: Op, ins: list[TensorInfo], in_ids: list[int], max_outputs: set[int], where: str) -> TensorInfo:
    fn = op.attr("fn")
    if fn not in ACCUM_FNS:
        raise MuGraphError(f"{where}: unknown accumulator {fn!r}; known: {list(ACCUM_FNS)}")
    rescaled = fn.startswith("rescaled")
    _arity(ins, 2 if rescaled else 1, where)
    x = ins[0]
    if x.phase == "post":
        raise MuGraphError(f"{where}: accumulates tile {in_ids[0]}, which is already accumulated")
    if rescaled:
        if in_ids[1] not in max_outputs:
            raise MuGraphError(f"{where}: second input must be the output of a max_last accumulator")
        b = broadcast_shapes(x.shape, ins[1].shape, where)
        lead = len(b) - len(x.shape)
        if b[lead:] != x.shape or any(d != 1 for d in b[:lead]):
            raise MuGraphError(f"{where}: the running max {list(ins[1].shape)} would broadcast the accumulated tile "
                               f"{list(x.shape)} to {list(b)}; a rescaled accumulator's max must broadcast into its tile")
    shape = x.shape
    if fn in ("sum_last", "mean_sq_last", "rms_last", "max_last", "rescaled_sum_last"):
        shape = shape[:-1] + (1,)
    elif fn == "sum_to":
        shape = _sum_to_shape(shape, op.attr("size"), where)
    elif op.attr("size") is not None:
        raise MuGraphError(f"{where}: only sum_to takes a size")
    return TensorInfo(shape, x.dtype, "both" if fn == "max_last" else "post")
