"""Candidate μGraphs (schedules) of the serving specs, generated programmatically for the benchmark.

These are *not* search results: they are the hand-written fused μGraphs of
``tests/handwritten.py`` (imported by path) instantiated over grid sizes and
loop ranges (split-KV attention also over the combine's head-dim split), plus
two schedules written here (split-K RMSNorm→Linear with a combine kernel, a
two-kernel LoRA), all built with the μGraph builders, i.e. forms the search can
express. One rule per spec derives them from the shapes (never from a case
label); codegen parameters are not chosen here: :func:`mirage_serve.tune.search.tune`
searches them on the GPU for every candidate, float-checking each point.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path

from mirage_serve.mugraph import BlockBuilder, GraphBuilder, KernelGraph

REPO = Path(__file__).resolve().parents[1]
MUGRAPH_SOURCE = "hand-written fused μGraphs (tests/handwritten.py) and benchmark-generated schedules (benchmarks/variants.py), not the superoptimizer"


def _load_handwritten():
    path = REPO / "tests" / "handwritten.py"
    if "mirage_handwritten" in sys.modules:
        return sys.modules["mirage_handwritten"]
    spec = importlib.util.spec_from_file_location("mirage_handwritten", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the hand-written μGraphs from {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mirage_handwritten"] = mod
    spec.loader.exec_module(mod)
    return mod


hw = _load_handwritten()


from mirage_serve.tune.search import Candidate  # noqa: E402

# ---------------------------------------------------------------- schedules written here


def split_k_rmsnorm_linear(batch: int, hidden: int, out: int, n_blocks: int, splits: int, loop: int, combine_blocks: int,
                           eps: float = 1e-6, dtype: str = "float32") -> KernelGraph:
    """Kernel 1: grid (column blocks, K splits); each block accumulates x·g @ W^T over its K range
    and the mean of squares of its x range; partial sums go to memory.
    Kernel 2: sums the K partials, averages the per-split means of squares over the splits and the
    column blocks (every column block wrote the same values; an average, unlike picking one with a
    max, stays inside the finite-field verifier's algebra), scales by rsqrt(ms + eps)."""
    g = GraphBuilder()
    x, gn, w = g.input("X", (batch, hidden), dtype), g.input("G", (hidden,), dtype), g.input("W", (out, hidden), dtype)
    b = BlockBuilder((n_blocks, splits), loop)
    tx, tg, tw = b.input(0, (-1, 1), 1), b.input(1, (-1, 0), 0), b.input(2, (0, 1), 1)
    acc = b.accum("sum", b.matmul(b.binary("mul", tx, tg), tw, trans_b=True))
    ms = b.accum("mean_sq_last", tx)
    b.output(acc, (1, -1))  # [splits, batch, out]
    b.output(ms, (-1, -1))  # [n_blocks, splits, batch, 1]
    p_acc, p_ms = g.customized([x, gn, w], b.build())
    c = BlockBuilder((combine_blocks,), 1)
    ca, cm = c.input(0, (2,), -1), c.input(1, (0,), -1)
    total = c.reduce("sum", ca, 0, keepdim=False)
    ms_split = c.reduce("sum", cm, 0, keepdim=False)  # [splits, batch, 1]: the sum over this program's share of column blocks
    mean = c.unary("mul_scalar", c.reduce("sum", ms_split, 0, keepdim=False), scalar=1.0 / (splits * (n_blocks // combine_blocks)))
    c.output(c.binary("mul", total, c.unary("rsqrt", c.unary("add_scalar", mean, scalar=eps))), (1,))
    (y,) = g.customized([p_acc, p_ms], c.build())
    return g.build([y])


def norm_then_linear(batch: int, hidden: int, out: int, n_blocks: int, loop: int, norm_blocks: int, eps: float = 1e-6,
                     dtype: str = "float32") -> KernelGraph:
    """Kernel 1: grid over row blocks, each normalises its whole rows, x·g·rsqrt(mean(x²) + eps), into
    a tensor of the graph's dtype (as transformers' RMSNorm rounds before its linear).
    Kernel 2: a plain tiled matmul of those rows with W^T, both operands streamed along K straight
    into the tensor cores (no per-tile arithmetic between the load and the MMA)."""
    g = GraphBuilder()
    x, gn, w = g.input("X", (batch, hidden), dtype), g.input("G", (hidden,), dtype), g.input("W", (out, hidden), dtype)
    b1 = BlockBuilder((norm_blocks,), 1)
    tx, tg = b1.input(0, (0,), -1), b1.input(1, (-1,), -1)
    ms = b1.unary("mul_scalar", b1.reduce("sum", b1.binary("mul", tx, tx), 1), scalar=1.0 / hidden)
    b1.output(b1.binary("mul", b1.binary("mul", tx, tg), b1.unary("rsqrt", b1.unary("add_scalar", ms, scalar=eps))), (0,))
    (xn,) = g.customized([x, gn], b1.build())
    b2 = BlockBuilder((n_blocks,), loop)
    tx2, tw = b2.input(0, (-1,), 1), b2.input(1, (0,), 1)
    b2.output(b2.accum("sum", b2.matmul(tx2, tw, trans_b=True)), (1,))
    (y,) = g.customized([xn, w], b2.build())
    return g.build([y])


def two_kernel_lora(batch: int, k: int, n: int, rank: int, n_blocks: int, loop: int, xa_splits: int, xa_loop: int,
                    scale: float = 2.0, dtype: str = "float32") -> KernelGraph:
    """Kernel 1: split-K partials of X @ A^T ([splits, batch, rank]); kernel 2: a GEMV over W
    whose epilogue sums those partials and adds s·(X A^T) B^T for its columns, so A is read once
    instead of once per block."""
    g = GraphBuilder()
    x, w, a, bb = (g.input("X", (batch, k), dtype), g.input("W", (n, k), dtype), g.input("A", (rank, k), dtype), g.input("B", (n, rank), dtype))
    b1 = BlockBuilder((xa_splits,), xa_loop)
    tx, ta = b1.input(0, (1,), 1), b1.input(1, (1,), 1)
    b1.output(b1.accum("sum", b1.matmul(tx, ta, trans_b=True)), (-1,))
    (pxa,) = g.customized([x, a], b1.build())  # [splits, batch, rank]
    b2 = BlockBuilder((n_blocks,), loop)
    tx2, tw, tb, tp = b2.input(0, (-1,), 1), b2.input(1, (0,), 1), b2.input(2, (0,), -1), b2.input(3, (-1,), -1)
    main = b2.accum("sum", b2.matmul(tx2, tw, trans_b=True))
    xa = b2.reduce("sum", tp, 0, keepdim=False)
    low = b2.unary("mul_scalar", b2.matmul(xa, tb, trans_b=True), scalar=scale)
    b2.output(b2.binary("add", main, low), (1,))
    (y,) = g.customized([x, w, bb, pxa], b2.build())
    return g.build([y])


# ---------------------------------------------------------------- candidates per spec


def _divides(n: int, d: int) -> bool:
    return d >= 1 and n % d == 0


def _combine_blocks(out: int, n_blocks: int) -> int:
    """Grid of the combine kernel: a divisor of the first kernel's column blocks with >= 64 columns a block."""
    for cb in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        if n_blocks % cb == 0 and out // cb >= 64:
            return cb
    return 1


def rmsnorm_linear_candidates(batch: int, hidden: int, out: int, dtype: str, eps: float = 1e-6) -> list[Candidate]:
    """One kernel over the whole K (few columns a program, long K chunks for one row: GEMV-shaped;
    32-128 columns and 128-512 long chunks for tile matmuls: the weight tile is the MMA's M side; 16
    columns lost at every batch >= 8 of the 2026-12-03 runs, and at batch 32 fewer, longer chunks won
    by 2x; 48 columns, padded to 64 in registers, where the output divides: at 6144 that is 128
    programs, one wave on 132 SMs, against 96 for 64 columns); at batch >= 2 also the rows normalised
    by a kernel of their own first and a plain tiled matmul after it (no arithmetic between its loads
    and the MMA, which Triton can then keep in flight across iterations with ``dot_acc``); and split-K
    partials with a combine kernel."""
    cs: list[Candidate] = []
    gemv = batch == 1
    tiles = itertools.product((4, 8, 16), (512, 1024)) if gemv else ((32, 128), (32, 256), (32, 512), (48, 128), (48, 256), (48, 512), (64, 128),
                                                                       (64, 256), (64, 512), (128, 128), (128, 256))
    for c, kc in tiles:
        if _divides(out, c) and _divides(hidden, kc):
            cs.append(Candidate(f"fused c{c} k{kc}", hw.fused_rmsnorm_linear(batch, hidden, out, out // c, hidden // kc, eps=eps, dtype=dtype),
                                "one kernel, whole K a program"))
    if not gemv:  # the rows normalised by a first kernel, then a plain tiled matmul (its operands straight into the MMA)
        nb = math.gcd(batch, 32)
        for c, kc in ((32, 256), (48, 128), (48, 256), (64, 128), (64, 256), (128, 128), (128, 256)):
            if _divides(out, c) and _divides(hidden, kc):
                cs.append(Candidate(f"norm2 c{c} k{kc}", norm_then_linear(batch, hidden, out, out // c, hidden // kc, nb, eps=eps, dtype=dtype),
                                    "normalise the rows, then a plain tiled matmul"))
    splits = ((64, 4, 256), (64, 8, 256)) if gemv else ((32, 2, 256), (64, 2, 256), (64, 4, 256), (128, 2, 256), (128, 4, 128))
    for c, s, kc in splits:
        kc = min(kc, hidden // s)
        if _divides(out, c) and _divides(hidden, s * kc):
            nb = out // c
            cs.append(Candidate(f"splitk c{c} s{s} k{kc}",
                                split_k_rmsnorm_linear(batch, hidden, out, nb, s, hidden // (s * kc), _combine_blocks(out, nb), eps=eps, dtype=dtype),
                                "split-K partials + combine kernel"))
    return cs


ATTENTION_VARIABLE_DIMS = ((1, 1), (2, 1))  # K and V: the KV length may be any size up to the bucket


def attention_candidates(batch: int, q_heads: int, kv_heads: int, head_dim: int, kv_len: int, dtype: str) -> list[Candidate]:
    """Flash-decoding split-KV schedules with 32-1024 programs, 32, 64 or 128 keys an iteration, the
    combine over head-dim quarters (4 programs a KV head; faster than one at every shape of the
    2026-12-03 H200 run) and, where that leaves it fewer than 64 programs, also eighths; every one
    serves any KV length up to ``kv_len``. Fewer than 64 programs only at KV <= 1024 (for the one-launch
    form, ``fused_combine``, whose serial combine per KV head grows with the splits)."""
    bk = batch * kv_heads
    cs: list[Candidate] = []
    d_splits = sorted({4, 8} if bk * 4 < 64 and head_dim % 8 == 0 else {4})
    for splits in (2, 4, 8, 16, 32, 64, 128):
        per = kv_len // splits
        if not (32 <= bk * splits <= 1024) or (bk * splits < 64 and kv_len > 1024) or kv_len % splits or per < 32 or (per < 256 and bk * splits < 128 and kv_len > 2048):
            continue
        for keys in (32, 64, 128):
            if per % keys or head_dim % 4 or (keys == 32 and per > 256):
                continue
            for ds in d_splits:
                g = hw.split_kv_attention(batch, q_heads, kv_heads, head_dim, kv_len, splits, per // keys, dtype=dtype, d_split=ds)
                cs.append(Candidate(f"splitkv s{splits} t{keys} cd{ds}", g, f"split-KV online softmax + combine over head-dim 1/{ds}s",
                                    ATTENTION_VARIABLE_DIMS))
    return cs


def lora_candidates(batch: int, k: int, n: int, rank: int, dtype: str) -> list[Candidate]:
    """One kernel (X A^T accumulated in the main loop, A re-read by every program), and two kernels
    (split-K X A^T first; the GEMV over W streams while it runs and adds s (X A^T) B^T after its loop);
    K chunks of 512 and 1024 (the two-kernel form won at every shape of the 2026-12-03 run). At batch >= 8
    the two-kernel form also with 4 and 2 X A^T programs instead of 16: the GEMV's epilogue then sums
    4 or 2 partials of [batch, rank] instead of 16 (at batch 32, 128 KB a program after the loop, read
    by all 128 programs), and the longer X A^T kernel still runs under the GEMV's loop (PDL)."""
    cs: list[Candidate] = []
    chunks = (512, 1024)
    for c, kc in itertools.product((8, 16, 32), chunks):
        if _divides(n, c) and _divides(k, kc) and _divides(k, 16 * 256):
            if kc == 512:
                cs.append(Candidate(f"fused c{c} k{kc}", hw.fused_lora(batch, k, n, rank, n // c, k // kc, dtype=dtype), "one kernel, A re-read per block"))
            cs.append(Candidate(f"2kernel c{c} k{kc}", two_kernel_lora(batch, k, n, rank, n // c, k // kc, 16, k // (16 * 256), dtype=dtype),
                                "split-K X@A^T, then GEMV with low-rank epilogue"))
            for xs in (4, 2) if batch >= 8 and c >= 16 else ():
                if _divides(k, xs * 256):
                    cs.append(Candidate(f"2kernel c{c} k{kc} xs{xs}", two_kernel_lora(batch, k, n, rank, n // c, k // kc, xs, k // (xs * 256), dtype=dtype),
                                        f"{xs}-way split-K X@A^T, then GEMV with low-rank epilogue"))
    return cs


def gated_mlp_candidates(batch: int, hidden: int, inter: int, dtype: str) -> list[Candidate]:
    cs: list[Candidate] = []
    for c, kc in itertools.product((8, 16, 32), (512, 1024)):
        if _divides(inter, c) and _divides(hidden, kc):
            cs.append(Candidate(f"fused c{c} k{kc}", hw.fused_gated_mlp(batch, hidden, inter, inter // c, hidden // kc, dtype=dtype),
                                "one kernel, both matmuls share the X tile"))
    return cs


def candidates_for(spec: str, dims: dict[str, int], dtype: str, **options: float) -> list[Candidate]:
    """The candidate μGraphs the benchmark tunes for one case (``options``: the spec's, e.g. ``eps``)."""
    if spec == "rmsnorm_linear":
        return rmsnorm_linear_candidates(dims["batch"], dims["hidden"], dims["out"], dtype, **options)
    if spec == "attention_decode":
        return attention_candidates(dims["batch"], dims["q_heads"], dims["kv_heads"], dims["head_dim"], dims["kv_len"], dtype)
    if spec == "lora_linear":
        return lora_candidates(dims["batch"], dims["in"], dims["out"], dims["rank"], dtype)
    if spec == "gated_mlp":
        return gated_mlp_candidates(dims["batch"], dims["hidden"], dims["intermediate"], dtype)
    raise ValueError(f"no candidates for spec {spec!r}")
