"""Extra fused μGraphs for the codegen tests: split-K with a combine, a two-kernel add+RMSNorm+linear."""

from __future__ import annotations

from mirage_serve.mugraph import BlockBuilder, GraphBuilder, KernelGraph


def split_k_rmsnorm_linear(batch: int, hidden: int, out: int, n_blocks: int, splits: int, loop: int, eps: float = 1e-6, dtype: str = "float32") -> KernelGraph:
    """Kernel 1 splits K over grid dim 1 (partial outputs); torch ops combine and normalise."""
    g = GraphBuilder()
    x, gn, w = g.input("X", (batch, hidden), dtype), g.input("G", (hidden,), dtype), g.input("W", (out, hidden), dtype)
    b = BlockBuilder((n_blocks, splits), loop)
    tx, tg, tw = b.input(0, (-1, 1), 1), b.input(1, (-1, 0), 0), b.input(2, (0, 1), 1)
    acc = b.accum("sum", b.matmul(b.binary("mul", tx, tg), tw, trans_b=True))
    ss = b.accum("sum_last", b.unary("square", tx))
    b.output(acc, (1, -1))  # [splits, batch, out]
    b.output(ss, (-1, -1))  # [n_blocks, splits, batch, 1]
    p, q = g.customized([x, gn, w], b.build())
    num = g.reduce("sum", p, 0, keepdim=False)
    den = g.reduce("sum", g.reduce("sum", q, 0, keepdim=False), 0, keepdim=False)
    inv = g.unary("rsqrt", g.unary("add_scalar", g.unary("mul_scalar", den, scalar=1.0 / (n_blocks * hidden)), scalar=eps))
    return g.build([g.binary("mul", num, inv)])


def two_kernel_add_rmsnorm_linear(batch: int, hidden: int, out: int, n_blocks: int, loop: int, eps: float = 1e-6, dtype: str = "float32") -> KernelGraph:
    """Kernel 1: H = X + R and its sum of squares per row; kernel 2: (H·g) @ W^T scaled by the RMS."""
    g = GraphBuilder()
    x, r = g.input("X", (batch, hidden), dtype), g.input("R", (batch, hidden), dtype)
    gn, w = g.input("G", (hidden,), dtype), g.input("W", (out, hidden), dtype)
    a = BlockBuilder((batch,), 1)
    ax, ar = a.input(0, (0,), -1), a.input(1, (0,), -1)
    h = a.binary("add", ax, ar)
    a.output(h, (0,))
    a.output(a.reduce("sum", a.unary("square", h), 1), (0,))
    hk, ssk = g.customized([x, r], a.build())
    b = BlockBuilder((n_blocks,), loop)
    th, tg, tw, ts = b.input(0, (-1,), 1), b.input(1, (-1,), 0), b.input(2, (0,), 1), b.input(3, (-1,), -1)
    acc = b.accum("sum", b.matmul(b.binary("mul", th, tg), tw, trans_b=True))
    scale = b.unary("rsqrt", b.unary("add_scalar", b.unary("mul_scalar", ts, scalar=1.0 / hidden), scalar=eps))
    b.output(b.binary("mul", acc, scale), (1,))
    (y,) = g.customized([hk, gn, w, ssk], b.build())
    return g.build([hk, y])
