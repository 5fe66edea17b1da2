"""Hand-written fused μGraphs for the serving specs, shared by several tests."""

from __future__ import annotations

import math

from mirage_serve.mugraph import BlockBuilder, GraphBuilder, KernelGraph


def fused_rmsnorm_linear(batch: int, hidden: int, out: int, n_blocks: int, loop: int, eps: float = 1e-6, dtype: str = "float32") -> KernelGraph:
    """One kernel: stream X, g and W along K; accumulate X·g @ W^T and the mean of squares together."""
    g = GraphBuilder()
    x, gn, w = g.input("X", (batch, hidden), dtype), g.input("G", (hidden,), dtype), g.input("W", (out, hidden), dtype)
    b = BlockBuilder((n_blocks,), loop)
    tx, tg, tw = b.input(0, (-1,), 1), b.input(1, (-1,), 0), b.input(2, (0,), 1)
    acc = b.accum("sum", b.matmul(b.binary("mul", tx, tg), tw, trans_b=True))
    ms = b.accum("mean_sq_last", tx)
    y = b.binary("mul", acc, b.unary("rsqrt", b.unary("add_scalar", ms, scalar=eps)))
    b.output(y, (1,))
    (yk,) = g.customized([x, gn, w], b.build())
    return g.build([yk])


def split_kv_attention(batch: int, q_heads: int, kv_heads: int, head_dim: int, kv_len: int, splits: int, loop: int, dtype: str = "float32",
                       d_split: int = 1) -> KernelGraph:
    """Flash-decoding: kernel 1 splits the KV length over the grid with an online softmax;
    kernel 2 rescales the partial results by their maxima and combines them (``d_split`` > 1: its
    grid also splits the head dim, so more, smaller programs read the partials)."""
    group, bk = q_heads // kv_heads, batch * kv_heads
    g = GraphBuilder()
    q = g.input("Q", (bk, group, head_dim), dtype)
    k = g.input("K", (bk, kv_len, head_dim), dtype)
    v = g.input("V", (bk, kv_len, head_dim), dtype)
    b = BlockBuilder((bk, splits), loop)
    tq, tk, tv = b.input(0, (0, -1), -1), b.input(1, (0, 1), 1), b.input(2, (0, 1), 1)
    s = b.unary("mul_scalar", b.matmul(tq, tk, trans_b=True), scalar=1.0 / math.sqrt(head_dim))
    m = b.accum("max_last", s)
    p = b.unary("exp", b.binary("sub", s, m))
    lsum = b.accum("rescaled_sum_last", p, m)
    o = b.accum("rescaled_sum", b.matmul(p, tv), m)
    for t in (m, lsum, o):
        b.output(t, (0, -1))
    pm, pl, po = g.customized([q, k, v], b.build())  # [splits, bk, group, 1|d]
    ds = d_split > 1
    c = BlockBuilder((bk, d_split) if ds else (bk,), 1)
    cm, cl, co = c.input(0, (1, -1) if ds else (1,), -1), c.input(1, (1, -1) if ds else (1,), -1), c.input(2, (1, 3) if ds else (1,), -1)
    mx = c.reduce("max", cm, 0)
    f = c.unary("exp", c.binary("sub", cm, mx))
    num = c.reduce("sum", c.binary("mul", co, f), 0, keepdim=False)
    den = c.reduce("sum", c.binary("mul", cl, f), 0, keepdim=False)
    c.output(c.binary("div", num, den), (0, 2) if ds else (0,))
    (out,) = g.customized([pm, pl, po], c.build())
    return g.build([out])


def fused_lora(batch: int, k: int, n: int, rank: int, n_blocks: int, loop: int, scale: float = 2.0, dtype: str = "float32") -> KernelGraph:
    """One kernel, two phases: X@W^T and X@A^T accumulate in the loop; the rank-r term is added after it."""
    g = GraphBuilder()
    x, w, a, bb = (g.input("X", (batch, k), dtype), g.input("W", (n, k), dtype), g.input("A", (rank, k), dtype), g.input("B", (n, rank), dtype))
    b = BlockBuilder((n_blocks,), loop)
    tx, tw, ta, tb = b.input(0, (-1,), 1), b.input(1, (0,), 1), b.input(2, (-1,), 1), b.input(3, (0,), -1)
    main = b.accum("sum", b.matmul(tx, tw, trans_b=True))
    xa = b.accum("sum", b.matmul(tx, ta, trans_b=True))
    low = b.unary("mul_scalar", b.matmul(xa, tb, trans_b=True), scalar=scale)
    b.output(b.binary("add", main, low), (1,))
    (y,) = g.customized([x, w, a, bb], b.build())
    return g.build([y])


def fused_gated_mlp(batch: int, hidden: int, inter: int, n_blocks: int, loop: int, dtype: str = "float32") -> KernelGraph:
    """One kernel: both matmuls share the X tile in the loop; silu·mul after it."""
    g = GraphBuilder()
    x, wg, wu = g.input("X", (batch, hidden), dtype), g.input("Wg", (inter, hidden), dtype), g.input("Wu", (inter, hidden), dtype)
    b = BlockBuilder((n_blocks,), loop)
    tx, tg, tu = b.input(0, (-1,), 1), b.input(1, (0,), 1), b.input(2, (0,), 1)
    ag = b.accum("sum", b.matmul(tx, tg, trans_b=True))
    au = b.accum("sum", b.matmul(tx, tu, trans_b=True))
    b.output(b.binary("mul", b.unary("silu", ag), au), (1,))
    (y,) = g.customized([x, wg, wu], b.build())
    return g.build([y])


def fused_add_rmsnorm_linear(batch: int, hidden: int, out: int, n_blocks: int, loop: int, eps: float = 1e-6, dtype: str = "float32") -> KernelGraph:
    """Two kernels: the residual add (H = X + R) with its own grid, then the fused RMSNorm→matmul on H."""
    g = GraphBuilder()
    x, r = g.input("X", (batch, hidden), dtype), g.input("R", (batch, hidden), dtype)
    gn, w = g.input("G", (hidden,), dtype), g.input("W", (out, hidden), dtype)
    a = BlockBuilder((n_blocks,), 1)
    a.output(a.binary("add", a.input(0, (1,), -1), a.input(1, (1,), -1)), (1,))
    (h,) = g.customized([x, r], a.build())
    b = BlockBuilder((n_blocks,), loop)
    th, tg, tw = b.input(0, (-1,), 1), b.input(1, (-1,), 0), b.input(2, (0,), 1)
    acc = b.accum("sum", b.matmul(b.binary("mul", th, tg), tw, trans_b=True))
    ms = b.accum("mean_sq_last", th)
    b.output(b.binary("mul", acc, b.unary("rsqrt", b.unary("add_scalar", ms, scalar=eps))), (1,))
    (y,) = g.customized([h, gn, w], b.build())
    return g.build([h, y])
