"""Named reference programs (specs) with dimension parameters, as kernel graphs.

Weights follow torch's ``nn.Linear`` storage (``[out, in]``, used with
``trans_b``) so that patched models need no transposed copies; upstream Mirage's
benchmark programs (``mirage_*``) keep upstream's ``[in, out]`` layout and the
shapes of ../shared/mirage-mugraphs/ as defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from mirage_serve.mugraph.graph import GraphBuilder, KernelGraph, MuGraphError


@dataclass(frozen=True)
class Spec:
    name: str
    params: tuple[str, ...]
    defaults: dict[str, int]
    build: Callable[..., KernelGraph]
    doc: str
    # which params are read from which input dims, to infer dims from a candidate
    dims_from_inputs: tuple[tuple[str, int, int], ...] = ()
    # inputs whose dim 0 grows with the batch (padded or masked when fewer rows run)
    row_inputs: tuple[int, ...] = (0,)


SPECS: dict[str, Spec] = {}


def _register(name: str, params: tuple[str, ...], defaults: dict[str, int], doc: str, dims_from_inputs=(), row_inputs=(0,)):
    def deco(fn: Callable[..., KernelGraph]) -> Callable[..., KernelGraph]:
        SPECS[name] = Spec(name, params, defaults, fn, doc, tuple(dims_from_inputs), tuple(row_inputs))
        return fn

    return deco


@_register(
    "rmsnorm_linear",
    ("batch", "hidden", "out"),
    {},
    "transformers' RMSNorm (eps, weight) then a linear: Y = rms_norm(X, g) @ W^T",
    (("batch", 0, 0), ("hidden", 0, 1), ("out", 2, 0)),
)
def rmsnorm_linear(batch: int, hidden: int, out: int, dtype: str = "float32", eps: float = 1e-6) -> KernelGraph:
    g = GraphBuilder()
    x = g.input("X", (batch, hidden), dtype)
    w_norm = g.input("G", (hidden,), dtype)
    w = g.input("W", (out, hidden), dtype)
    return g.build([g.matmul(g.rms_norm(x, w_norm, eps), w, trans_b=True)])


@_register(
    "add_rmsnorm_linear",
    ("batch", "hidden", "out"),
    {},
    "residual add, RMSNorm, linear; outputs (H = X + R, rms_norm(H, g) @ W^T)",
    (("batch", 0, 0), ("hidden", 0, 1), ("out", 3, 0)),
    row_inputs=(0, 1),
)
def add_rmsnorm_linear(batch: int, hidden: int, out: int, dtype: str = "float32", eps: float = 1e-6) -> KernelGraph:
    g = GraphBuilder()
    x = g.input("X", (batch, hidden), dtype)
    r = g.input("R", (batch, hidden), dtype)
    w_norm = g.input("G", (hidden,), dtype)
    w = g.input("W", (out, hidden), dtype)
    h = g.binary("add", x, r)
    return g.build([h, g.matmul(g.rms_norm(h, w_norm, eps), w, trans_b=True)])


@_register(
    "attention_decode",
    ("batch", "q_heads", "kv_heads", "head_dim", "kv_len"),
    {},
    "GQA decode attention for one query token, softmax with max-subtraction. "
    "Q [batch*kv_heads, q_heads/kv_heads, head_dim], K and V [batch*kv_heads, kv_len, head_dim]",
    row_inputs=(0, 1, 2),
)
def attention_decode(batch: int, q_heads: int, kv_heads: int, head_dim: int, kv_len: int, dtype: str = "float32", scale: float | None = None) -> KernelGraph:
    if q_heads % kv_heads:
        raise MuGraphError(f"attention_decode: q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    g = GraphBuilder()
    q = g.input("Q", (batch * kv_heads, group, head_dim), dtype)
    k = g.input("K", (batch * kv_heads, kv_len, head_dim), dtype)
    v = g.input("V", (batch * kv_heads, kv_len, head_dim), dtype)
    s = g.unary("mul_scalar", g.matmul(q, k, trans_b=True), scalar=scale)
    e = g.unary("exp", g.binary("sub", s, g.reduce("max", s, -1)))
    o = g.binary("div", g.matmul(e, v), g.reduce("sum", e, -1))
    return g.build([o])


def attention_dims_from_shapes(shapes: list[tuple[int, ...]]) -> dict[str, int]:
    """attention_decode's dims from (Q, K, V) shapes; batch and kv_heads are not separable, so kv_heads=1."""
    (bk, group, d), (_, kv_len, _) = shapes[0], shapes[1]
    return {"batch": bk, "q_heads": group, "kv_heads": 1, "head_dim": d, "kv_len": kv_len}


@_register(
    "lora_linear",
    ("batch", "in", "out", "rank"),
    {},
    "LoRA linear (peft storage): Y = X @ W^T + s * (X @ A^T) @ B^T",
    (("batch", 0, 0), ("in", 0, 1), ("out", 1, 0), ("rank", 2, 0)),
)
def lora_linear(batch: int, out: int, rank: int, dtype: str = "float32", scale: float = 2.0, **kw: int) -> KernelGraph:
    k = kw["in"]
    g = GraphBuilder()
    x = g.input("X", (batch, k), dtype)
    w = g.input("W", (out, k), dtype)
    a = g.input("A", (rank, k), dtype)
    b = g.input("B", (out, rank), dtype)
    low = g.unary("mul_scalar", g.matmul(g.matmul(x, a, trans_b=True), b, trans_b=True), scalar=scale)
    return g.build([g.binary("add", g.matmul(x, w, trans_b=True), low)])


@_register(
    "gated_mlp",
    ("batch", "hidden", "intermediate"),
    {},
    "gated MLP up path: silu(X @ Wg^T) * (X @ Wu^T)",
    (("batch", 0, 0), ("hidden", 0, 1), ("intermediate", 1, 0)),
)
def gated_mlp(batch: int, hidden: int, intermediate: int, dtype: str = "float32") -> KernelGraph:
    g = GraphBuilder()
    x = g.input("X", (batch, hidden), dtype)
    wg = g.input("Wg", (intermediate, hidden), dtype)
    wu = g.input("Wu", (intermediate, hidden), dtype)
    return g.build([g.binary("mul", g.unary("silu", g.matmul(x, wg, trans_b=True)), g.matmul(x, wu, trans_b=True))])


# Upstream Mirage's benchmark programs (float16 there; rms(x) = x / sqrt(mean(x^2)), no eps, no weight).


@_register("mirage_rmsnorm", ("batch", "hidden", "out"), {"batch": 2, "hidden": 4096, "out": 6144}, "rms(X) @ W",
           (("batch", 0, 0), ("hidden", 0, 1), ("out", 1, 1)))
def mirage_rmsnorm(batch: int = 2, hidden: int = 4096, out: int = 6144, dtype: str = "float16") -> KernelGraph:
    g = GraphBuilder()
    x = g.input("X", (batch, hidden), dtype)
    w = g.input("W", (hidden, out), dtype)
    return g.build([g.matmul(g.rms_norm(x), w)])


def _mirage_attention(heads: int, q_len: int, head_dim: int, kv_len: int, dtype: str, qknorm: bool) -> KernelGraph:
    g = GraphBuilder()
    q = g.input("Q", (heads, q_len, head_dim), dtype)
    k = g.input("K", (heads, head_dim, kv_len), dtype)
    v = g.input("V", (heads, kv_len, head_dim), dtype)
    if qknorm:
        q, v = g.rms_norm(q), g.rms_norm(v)
    e = g.unary("exp", g.matmul(q, k))
    return g.build([g.matmul(g.binary("div", e, g.reduce("sum", e, -1)), v)])


_ATT_DIMS = (("heads", 0, 0), ("q_len", 0, 1), ("head_dim", 0, 2), ("kv_len", 1, 2))


@_register("mirage_gqa", ("heads", "q_len", "head_dim", "kv_len"), {"heads": 2, "q_len": 256, "head_dim": 64, "kv_len": 4096},
           "E = exp(Q @ K); (E / sum(E, -1)) @ V", _ATT_DIMS)
def mirage_gqa(heads: int = 2, q_len: int = 256, head_dim: int = 64, kv_len: int = 4096, dtype: str = "float16") -> KernelGraph:
    return _mirage_attention(heads, q_len, head_dim, kv_len, dtype, qknorm=False)


@_register("mirage_qknorm_gqa", ("heads", "q_len", "head_dim", "kv_len"), {"heads": 2, "q_len": 256, "head_dim": 64, "kv_len": 4096},
           "E = exp(rms(Q) @ K); (E / sum(E, -1)) @ rms(V)", _ATT_DIMS)
def mirage_qknorm_gqa(heads: int = 2, q_len: int = 256, head_dim: int = 64, kv_len: int = 4096, dtype: str = "float16") -> KernelGraph:
    return _mirage_attention(heads, q_len, head_dim, kv_len, dtype, qknorm=True)


@_register("mirage_lora", ("batch", "in", "out", "rank"), {"batch": 16, "in": 256, "out": 4096, "rank": 16}, "X @ W + (X @ A) @ B",
           (("batch", 0, 0), ("in", 0, 1), ("out", 1, 1), ("rank", 2, 1)))
def mirage_lora(batch: int = 16, out: int = 4096, rank: int = 16, dtype: str = "float16", **kw: int) -> KernelGraph:
    k = kw.get("in", 256)
    g = GraphBuilder()
    x = g.input("X", (batch, k), dtype)
    w = g.input("W", (k, out), dtype)
    a = g.input("A", (k, rank), dtype)
    b = g.input("B", (rank, out), dtype)
    return g.build([g.binary("add", g.matmul(x, w), g.matmul(g.matmul(x, a), b))])


@_register("mirage_gated_mlp", ("batch", "hidden", "intermediate"), {"batch": 8, "hidden": 4096, "intermediate": 4096},
           "silu(X @ W1) * (X @ W2)", (("batch", 0, 0), ("hidden", 0, 1), ("intermediate", 1, 1)))
def mirage_gated_mlp(batch: int = 8, hidden: int = 4096, intermediate: int = 4096, dtype: str = "float16") -> KernelGraph:
    g = GraphBuilder()
    x = g.input("X", (batch, hidden), dtype)
    w1 = g.input("W1", (hidden, intermediate), dtype)
    w2 = g.input("W2", (hidden, intermediate), dtype)
    return g.build([g.binary("mul", g.unary("silu", g.matmul(x, w1)), g.matmul(x, w2))])


@_register("mirage_ntrans", ("batch", "hidden"), {"batch": 8, "hidden": 4096}, "rms(X + alpha * (rms(H) + X))",
           (("batch", 0, 0), ("hidden", 0, 1)))
def mirage_ntrans(batch: int = 8, hidden: int = 4096, dtype: str = "float16") -> KernelGraph:
    g = GraphBuilder()
    h = g.input("H", (batch, hidden), dtype)
    x = g.input("X", (batch, hidden), dtype)
    alpha = g.input("alpha", (batch, hidden), dtype)
    inner = g.binary("add", g.rms_norm(h), x)
    return g.build([g.rms_norm(g.binary("add", x, g.binary("mul", alpha, inner)))])


def build_spec(name: str, dims: dict[str, int] | None = None, dtype: str | None = None, **options) -> KernelGraph:
    """Build a named spec; unknown names and missing or unknown dims get a clear error."""
    spec = SPECS.get(name)
    if spec is None:
        raise MuGraphError(f"unknown spec {name!r}; known specs: {', '.join(sorted(SPECS))}")
    dims = dict(dims or {})
    unknown = set(dims) - set(spec.params)
    if unknown:
        raise MuGraphError(f"spec {name!r} has no dim(s) {sorted(unknown)}; its dims are {list(spec.params)}")
    full = {**spec.defaults, **dims}
    missing = [p for p in spec.params if p not in full]
    if missing:
        raise MuGraphError(f"spec {name!r} needs dim(s) {missing} (e.g. --dims {','.join(f'{p}=N' for p in spec.params)})")
    from mirage_serve.cache.keys import MAX_DIM

    for k, v in full.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise MuGraphError(f"spec {name!r}: dim {k}={v!r} must be a positive integer")
        if v > MAX_DIM:
            raise MuGraphError(f"spec {name!r}: dim {k}={v} is over {MAX_DIM} (2^24), the largest dim a kernel cache key holds")
    kwargs = dict(full, **options)
    if dtype is not None:
        kwargs["dtype"] = dtype
    return spec.build(**kwargs)


def infer_dims(name: str, input_shapes: list[tuple[int, ...]]) -> dict[str, int]:
    """Read a spec's dims off a candidate's input shapes."""
    spec = SPECS.get(name)
    if spec is None:
        raise MuGraphError(f"unknown spec {name!r}; known specs: {', '.join(sorted(SPECS))}")
    if name == "attention_decode":
        return attention_dims_from_shapes(input_shapes)
    dims = {}
    for param, idx, d in spec.dims_from_inputs:
        if idx >= len(input_shapes) or d >= len(input_shapes[idx]):
            raise MuGraphError(f"cannot read dim {param!r} of spec {name!r} from input shapes {input_shapes}; pass --dims")
        dims[param] = input_shapes[idx][d]
    return dims
