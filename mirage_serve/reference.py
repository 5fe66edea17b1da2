"""Execute any μGraph with torch: the ground truth and the CPU fallback.

The executor is written once against an *algebra* (how to add, multiply,
exponentiate, reduce, take a running max); :class:`FloatAlgebra` is ordinary
floating point in any torch dtype on any device, and the finite-field verifier
supplies its own. Block graphs run with their exact semantics, vectorised over
the grid: a tile is a tensor ``[G0, G1, G2, *tile_shape]`` (size 1 along grid
dims it does not vary over), the for-loop runs ``forloop_range`` iterations,
accumulators update in operator order, and operators after them run once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mirage_serve.mugraph.graph import BlockGraph, KernelGraph, MuGraphError, Op
from mirage_serve.mugraph.shapes import TensorInfo, block_tile_infos

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class FloatAlgebra:
    """Floating-point semantics in ``dtype`` (float64 for ground truth)."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        self.dtype = dtype

    # values are plain tensors; structural ops apply directly
    def map(self, x: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return f(x)

    def shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)

    def cat(self, xs: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        return torch.cat(list(xs), dim)

    def lift(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def matmul(self, a, b, trans_b: bool = False):
        return a @ (b.transpose(-1, -2) if trans_b else b)

    def binary(self, fn: str, a, b):
        if fn == "add":
            return a + b
        if fn == "sub":
            return a - b
        if fn == "mul":
            return a * b
        if fn == "div":
            return a / b
        raise MuGraphError(f"unknown binary fn {fn!r}")

    def unary(self, fn: str, x, scalar: float | None = None):
        if fn == "exp":
            return torch.exp(x)
        if fn == "silu":
            return torch.nn.functional.silu(x)
        if fn == "sqrt":
            return torch.sqrt(x)
        if fn == "rsqrt":
            return torch.rsqrt(x)
        if fn == "square":
            return x * x
        if fn == "neg":
            return -x
        if fn == "recip":
            return 1.0 / x
        if fn == "mul_scalar":
            return x * scalar
        if fn == "add_scalar":
            return x + scalar
        raise MuGraphError(f"unknown unary fn {fn!r}")

    def sum(self, x, dim: int, keepdim: bool = True):
        return x.sum(dim, keepdim=keepdim)

    def max(self, x, dim: int, keepdim: bool = True):
        return x.amax(dim, keepdim=keepdim)

    def scale_by_count(self, x, n: int):
        """x / n for a positive integer count n."""
        return x / n

    def running_max(self, prev, x_rowmax, first: bool):
        """The max so far after seeing this iteration's row maxima."""
        return x_rowmax if first else torch.maximum(prev, x_rowmax)

    def rms_norm(self, x, w, eps: float):
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
        return y if w is None else y * w


def sum_to(alg, x, size: int):
    """out[..., c] = Σ_k x[..., c + size*k]."""
    n = alg.shape(x)[-1]
    return alg.sum(alg.map(x, lambda t: t.reshape(*t.shape[:-1], n // size, size)), -2, keepdim=False)


def apply_op(alg, op: Op, ins: list[Any], rank: int | None = None) -> Any:
    """One tile or kernel operator (not accum, input or customized).

    In block graphs values carry three leading grid dims, so a non-negative
    ``dim`` attribute is turned into its negative form using the tile ``rank``."""
    k = op.kind

    def dim(default: int) -> int:
        d = op.attr("dim", default)
        return d - rank if rank is not None and d >= 0 else d

    if k == "matmul":
        a, b = ins
        if rank is not None and len(alg.shape(b)) < len(alg.shape(a)):  # a rank-2 b is shared by a's batch dims
            a, b = _align_tile_ranks(alg, a, b)
        return alg.matmul(a, b, bool(op.attr("trans_b", False)))
    if k == "unary":
        return alg.unary(op.attr("fn"), ins[0], op.attr("scalar"))
    if k == "binary":
        a, b = ins
        if rank is not None:
            a, b = _align_tile_ranks(alg, a, b)
        return alg.binary(op.attr("fn"), a, b)
    if k == "reduce":
        fn = op.attr("fn")
        f = alg.sum if fn == "sum" else alg.max
        return f(ins[0], dim(-1), bool(op.attr("keepdim", True)))
    if k == "rms_norm":
        x, w = ins[0], ins[1] if len(ins) > 1 else None
        if rank is not None and w is not None:
            x, w = _align_tile_ranks(alg, x, w)
        return alg.rms_norm(x, w, float(op.attr("eps", 0.0)))
    if k == "concat":
        return alg.cat(_expand_grid(alg, ins) if rank is not None else ins, dim(0))
    if k == "sum_to":
        return sum_to(alg, ins[0], op.attr("size"))
    raise MuGraphError(f"cannot execute operator kind {k!r} here")


def _align_tile_ranks(alg, a, b):
    """Block level: give the lower-rank tile leading 1s after its 3 grid dims, so
    tiles broadcast against each other and grid dims only against grid dims."""
    ra, rb = len(alg.shape(a)), len(alg.shape(b))
    if ra < rb:
        a = alg.map(a, lambda t, n=rb - ra: t.reshape(*t.shape[:3], *(1,) * n, *t.shape[3:]))
    elif rb < ra:
        b = alg.map(b, lambda t, n=ra - rb: t.reshape(*t.shape[:3], *(1,) * n, *t.shape[3:]))
    return a, b


def _expand_grid(alg, xs: list[Any]) -> list[Any]:
    """Block level: tiles that vary over different grid dims (size 1 along the
    others) expanded to the common grid, so they can be concatenated."""
    shapes = [alg.shape(x) for x in xs]
    grid = [max(s[g] for s in shapes) for g in range(3)]
    return [alg.map(x, lambda t, g=grid: t.expand(*g, *t.shape[3:])) if list(s[:3]) != grid else x for x, s in zip(xs, shapes, strict=True)]


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    g = tuple(grid) + (1,) * (3 - len(grid))
    return g[0], g[1], g[2]


def load_tile_fn(shape: tuple[int, ...], grid: tuple[int, ...], imap: tuple[int, ...], fdim: int, rng: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A function (tensor, iteration) -> its tiles for every block, ``[G0,G1,G2,*tile]``.

    Along a dim split by both the grid and the loop, block ``b`` owns chunk ``b`` of
    the grid split and iteration ``i`` loads sub-chunk ``i`` of it."""
    r = len(shape)
    g3 = _grid3(grid)
    a = [1] * r
    gmapped = [-1, -1, -1]
    for gi, d in enumerate(imap):
        if d >= 0 and grid[gi] > 1:
            a[d] = grid[gi]
            gmapped[gi] = d
    rr = [rng if d == fdim else 1 for d in range(r)]
    t = [shape[d] // (a[d] * rr[d]) for d in range(r)]
    split = [x for d in range(r) for x in (a[d], rr[d], t[d])]
    mapped_dims = [d for d in gmapped if d >= 0]
    order = [2 * d for d in mapped_dims] + [2 * d for d in range(r) if d not in mapped_dims] + [2 * d + 1 for d in range(r)]
    out_shape = [g3[gi] if gmapped[gi] >= 0 else 1 for gi in range(3)] + t

    def load(x: torch.Tensor, i: int) -> torch.Tensor:
        y = x.reshape(split)
        y = y[tuple(idx for d in range(r) for idx in (slice(None), i if d == fdim else 0, slice(None)))]
        return y.permute(order).reshape(out_shape)

    return load


def store_tile_fn(tile: tuple[int, ...], grid: tuple[int, ...], omap: tuple[int, ...], out_shape: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function ``[b0,b1,b2,*tile]`` -> the kernel tensor a block output writes."""
    g3 = _grid3(grid)
    om = tuple(omap) + (-1,) * (3 - len(omap))
    partial = [g for g in range(3) if om[g] == -1 and g3[g] > 1]
    axes = list(partial)
    for d in range(len(tile)):
        for g in range(3):
            if om[g] == d and g3[g] > 1:
                axes.append(g)
        axes.append(3 + d)
    rest = [g for g in range(3) if g not in axes]
    perm = rest + axes

    def store(v: torch.Tensor) -> torch.Tensor:
        v = v.expand(*g3, *tile)
        return v.permute(perm).reshape(out_shape)

    return store


def run_block(block: BlockGraph, args: list[Any], alg, arg_infos: list[TensorInfo], out_infos: list[TensorInfo] | None = None) -> list[Any]:
    """Run a block graph over its whole grid; returns the kernel tensors it writes."""
    tiles = block_tile_infos(block, arg_infos)
    if out_infos is None:
        from mirage_serve.mugraph.shapes import infer_block

        out_infos = infer_block(block, arg_infos)
    rng = block.forloop_range
    n_in = len(block.inputs)
    vals: list[Any] = [None] * len(tiles)
    loaders = [
        load_tile_fn(arg_infos[bi.source].shape, block.grid, bi.input_map, bi.forloop_dim, rng) for bi in block.inputs
    ]
    for j, bi in enumerate(block.inputs):
        if bi.forloop_dim == -1:
            vals[j] = alg.map(args[bi.source], lambda x, f=loaders[j]: f(x, 0))
    for j, op in enumerate(block.ops):
        if tiles[n_in + j].phase == "invariant":
            vals[n_in + j] = apply_op(alg, op, [vals[t] for t in op.inputs], len(tiles[op.inputs[0]].shape))

    state: dict[int, Any] = {}
    prev_max: dict[int, Any] = {}  # rescaled accumulator id -> the max it was last scaled to
    for it in range(rng):
        for j, bi in enumerate(block.inputs):
            if bi.forloop_dim != -1:
                vals[j] = alg.map(args[bi.source], lambda x, f=loaders[j], i=it: f(x, i))
        for j, op in enumerate(block.ops):
            tid = n_in + j
            ph = tiles[tid].phase
            if op.kind == "accum":
                _accum_step(alg, op, tid, [vals[t] for t in op.inputs], op.inputs, state, prev_max, it, vals)
            elif ph in ("loop", "both"):
                vals[tid] = apply_op(alg, op, [vals[t] for t in op.inputs], len(tiles[op.inputs[0]].shape))
    for j, op in enumerate(block.ops):
        tid = n_in + j
        ph = tiles[tid].phase
        if op.kind == "accum":
            vals[tid] = _accum_final(alg, op, state[tid], tiles[op.inputs[0]].shape[-1], rng)
        elif ph in ("post", "both"):
            vals[tid] = apply_op(alg, op, [vals[t] for t in op.inputs], len(tiles[op.inputs[0]].shape))

    outs = []
    for bo, info in zip(block.outputs, out_infos, strict=True):
        store = store_tile_fn(tiles[bo.tensor].shape, block.grid, bo.output_map, info.shape)
        outs.append(alg.map(vals[bo.tensor], store))
    return outs


def _accum_step(alg, op: Op, tid: int, ins: list[Any], in_ids, state, prev_max, it: int, vals) -> None:
    fn = op.attr("fn")
    x = ins[0]
    if fn == "max_last":
        new = alg.running_max(state.get(tid), alg.max(x, -1), it == 0)
        state[tid] = new
        vals[tid] = new  # later ops in this iteration see m_i
        return
    if fn == "sum":
        contrib = x
    elif fn in ("sum_last", "rescaled_sum_last"):
        contrib = alg.sum(x, -1)
    elif fn == "sum_to":
        contrib = sum_to(alg, x, op.attr("size"))
    elif fn in ("mean_sq_last", "rms_last"):
        contrib = alg.sum(alg.binary("mul", x, x), -1)
    elif fn == "rescaled_sum":
        contrib = x
    else:
        raise MuGraphError(f"unknown accumulator {fn!r}")
    if fn.startswith("rescaled"):
        m = ins[1]
        extra = len(alg.shape(m)) - len(alg.shape(x))
        if extra > 0:  # a max of higher rank has leading 1s (shape rule): drop them after the grid dims
            m = alg.map(m, lambda t: t.reshape(*t.shape[:3], *t.shape[3 + extra :]))
        elif extra < 0:  # a max of lower rank broadcasts over the tile's leading dims, not over grid dims
            m = alg.map(m, lambda t: t.reshape(*t.shape[:3], *(1,) * -extra, *t.shape[3:]))
        if it == 0:
            state[tid] = contrib
        else:
            factor = alg.unary("exp", alg.binary("sub", prev_max[tid], m))
            state[tid] = alg.binary("add", alg.binary("mul", state[tid], factor), contrib)
        prev_max[tid] = m
        return
    state[tid] = contrib if it == 0 else alg.binary("add", state[tid], contrib)


def _accum_final(alg, op: Op, value: Any, last: int, rng: int) -> Any:
    fn = op.attr("fn")
    if fn in ("mean_sq_last", "rms_last"):
        value = alg.scale_by_count(value, last * rng)
        if fn == "rms_last":
            value = alg.unary("sqrt", value)
    return value


def run_graph(graph: KernelGraph, inputs: Sequence[Any], alg) -> list[Any]:
    """Run a kernel graph under an algebra; ``inputs`` in input-op order (already lifted)."""
    info = graph.info
    if len(inputs) != len(graph.input_ids):
        raise MuGraphError(f"graph takes {len(graph.input_ids)} inputs, got {len(inputs)}")
    vals: list[Any] = []
    n_in = 0
    for op in graph.ops:
        if op.kind == "input":
            x = inputs[n_in]
            want = info[len(vals)].shape
            if tuple(alg.shape(x)) != tuple(want):
                raise MuGraphError(f"input {n_in} ({op.attr('name')!r}) has shape {list(alg.shape(x))}, expected {list(want)}")
            vals.append(x)
            n_in += 1
        elif op.kind == "customized":
            first = len(vals)
            arg_infos = [info[t] for t in op.inputs]
            out_infos = list(info[first : first + op.num_outputs])
            vals.extend(run_block(op.block, [vals[t] for t in op.inputs], alg, arg_infos, out_infos))
        else:
            vals.append(apply_op(alg, op, [vals[t] for t in op.inputs]))
    return [vals[t] for t in graph.outputs]


def execute(graph: KernelGraph, inputs: Sequence[torch.Tensor], dtype: torch.dtype = torch.float64, cast_outputs: bool = False) -> list[torch.Tensor]:
    """Run ``graph`` on torch tensors, computing in ``dtype`` (float64 by default).

    With ``cast_outputs`` the results are cast to the dtypes the graph declares
    (what a fallback for a patched model wants)."""
    alg = FloatAlgebra(dtype)
    outs = run_graph(graph, [alg.lift(x) for x in inputs], alg)
    if cast_outputs:
        info = graph.info
        outs = [o.to(TORCH_DTYPES[info[t].dtype]) for o, t in zip(outs, graph.outputs, strict=True)]
    return outs


def random_inputs(graph: KernelGraph, generator: torch.Generator | None = None, dtype: torch.dtype | None = None, device: str | torch.device = "cpu", scale: float = 1.0) -> list[torch.Tensor]:
    """Fresh standard-normal inputs for a graph (declared dtypes unless ``dtype``)."""
    outs = []
    for t in graph.input_ids:
        info = graph.info[t]
        x = torch.randn(info.shape, generator=generator, dtype=torch.float64) * scale
        outs.append(x.to(device=device, dtype=dtype or TORCH_DTYPES[info.dtype]))
    return outs
