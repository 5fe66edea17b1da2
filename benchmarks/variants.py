"""Schedule variants of the serving specs, generated programmatically for the benchmark.

These are *not* search results: they are the hand-written fused μGraphs of
``tests/handwritten.py`` (imported by path) instantiated over grid sizes, loop
ranges and warps, plus a few schedules written here (split-K RMSNorm→Linear with
a combine kernel, a two-kernel LoRA). Every variant is checked against the
float64 reference of its spec in the same GPU run that times it.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass
class Variant:
    """One μGraph plus codegen params to compile it with."""

    name: str
    graph: KernelGraph
    params: dict[str, Any] = field(default_factory=dict)
    schedule: str = ""


# ---------------------------------------------------------------- schedules written here


def split_k_rmsnorm_linear(batch: int, hidden: int, out: int, n_blocks: int, splits: int, loop: int, combine_blocks: int,
                           eps: float = 1e-6, dtype: str = "float32") -> KernelGraph:
    """Kernel 1: grid (column blocks, K splits); each block accumulates x·g @ W^T over its K range
    and the mean of squares of its x range; partial sums go to memory.
    Kernel 2: sums the K partials, averages the per-split means of squares (every column block
    wrote the same value: max over them picks it exactly), scales by rsqrt(ms + eps)."""
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
    ms_split = c.reduce("max", cm, 0, keepdim=False)  # [splits, batch, 1]
    mean = c.unary("mul_scalar", c.reduce("sum", ms_split, 0, keepdim=False), scalar=1.0 / splits)
    c.output(c.binary("mul", total, c.unary("rsqrt", c.unary("add_scalar", mean, scalar=eps))), (1,))
    (y,) = g.customized([p_acc, p_ms], c.build())
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


# ---------------------------------------------------------------- variant lists per spec


def _divides(n: int, d: int) -> bool:
    return d >= 1 and n % d == 0


DOT16 = {"matmul": "dot", "dot_precision": "input"}  # tl.dot on bf16 operands, rows padded to 16


def rmsnorm_linear_variants(batch: int, hidden: int, out: int, dtype: str, wide: bool = False) -> list[Variant]:
    """GEMV-style fused kernels (4-32 columns a program over the whole K, K chunks 256-1024),
    and split-K schedules with a combine kernel for batches above 1; above batch 1 both
    GEMV math (``fma``) and ``tl.dot`` on narrow tiles."""
    vs: list[Variant] = []
    cols = (4, 8, 16, 32) if wide else ((8, 16) if batch == 1 else (16, 32))
    chunks = (256, 512, 1024) if wide else (512,)
    warps = (4, 8) if wide else (4,)
    # the first mode gets the full sweep; from 16 rows on GEMV math is the slow one (0.4 ms at batch 32), so it goes last
    modes: list[dict[str, Any]] = [{}] if batch == 1 else ([{"matmul": "fma"}, DOT16] if batch < 16 else [DOT16, {"matmul": "fma"}])

    def fused(c: int, kc: int, nw: int, mode: dict[str, Any]) -> None:
        if _divides(out, c) and _divides(hidden, kc):
            tag = "" if not mode else f" {mode['matmul']}"
            vs.append(Variant(f"fused c{c} k{kc} w{nw}{tag}", hw.fused_rmsnorm_linear(batch, hidden, out, out // c, hidden // kc, dtype=dtype),
                              {"num_warps": nw, **mode}, "one kernel, GEMV/dot over whole K"))

    for i, mode in enumerate(modes):
        for c, kc, nw in itertools.product(cols, chunks, warps):
            if i == 0 or not wide or (kc == 512 and nw == 4):
                fused(c, kc, nw, mode)
    if batch > 1 or wide:
        for mode in modes:
            for c, s in itertools.product((32, 64) if wide else (64,), (2, 4, 8) if wide else (4,)):
                kc = 256 if hidden // s >= 256 else hidden // s
                if _divides(out, c) and _divides(hidden, s * kc):
                    nb = out // c
                    tag = "" if not mode else f" {mode['matmul']}"
                    vs.append(Variant(f"splitk c{c} s{s} k{kc}{tag}",
                                      split_k_rmsnorm_linear(batch, hidden, out, nb, s, hidden // (s * kc), _combine_blocks(out, nb), dtype=dtype),
                                      {"num_warps": 4, **mode}, "split-K partials + combine kernel"))
    if batch > 1 and wide:  # pipelining depth, warps and wider column tiles for the tl.dot split-K schedule
        for c, s, nw, ns in ((64, 4, 4, 3), (64, 4, 4, 4), (64, 4, 8, 3), (64, 8, 4, 3), (128, 4, 4, 3), (128, 4, 8, 3), (128, 8, 8, 3)):
            kc = 256
            if _divides(out, c) and _divides(hidden, s * kc):
                nb = out // c
                vs.append(Variant(f"splitk c{c} s{s} k{kc} dot w{nw} st{ns}",
                                  split_k_rmsnorm_linear(batch, hidden, out, nb, s, hidden // (s * kc), _combine_blocks(out, nb), dtype=dtype),
                                  {"num_warps": nw, "num_stages": ns, **DOT16}, "split-K partials + combine kernel"))
    return vs


def _combine_blocks(out: int, n_blocks: int) -> int:
    """Grid of the combine kernel: a divisor of the first kernel's column blocks with >= 64 columns a block."""
    for cb in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        if n_blocks % cb == 0 and out // cb >= 64:
            return cb
    return 1


def attention_variants(batch: int, q_heads: int, kv_heads: int, head_dim: int, kv_len: int, dtype: str, wide: bool = False) -> list[Variant]:
    """Flash-decoding split-KV schedules: enough splits for 128-2048 programs, 64 or 128 keys an iteration."""
    bk = batch * kv_heads
    vs: list[Variant] = []
    for splits in (2, 4, 8, 16, 32, 64, 128, 256):  # the combine kernel expects a partial dim
        per = kv_len // splits
        if not (64 <= bk * splits <= 1024) or kv_len % splits or per < 64:
            continue
        for keys in ((64, 128) if wide else ((128,) if per >= 256 else (64,))):
            if per % keys == 0:
                vs.append(Variant(f"splitkv s{splits} t{keys}", hw.split_kv_attention(batch, q_heads, kv_heads, head_dim, kv_len, splits, per // keys, dtype=dtype),
                                  {"num_warps": 4}, "split-KV online softmax + combine"))
                if wide and keys == 64:
                    for nw, ns in ((8, 2), (4, 3)):
                        vs.append(Variant(f"splitkv s{splits} t{keys} w{nw} st{ns}",
                                          hw.split_kv_attention(batch, q_heads, kv_heads, head_dim, kv_len, splits, per // keys, dtype=dtype),
                                          {"num_warps": nw, "num_stages": ns}, "split-KV online softmax + combine"))
    return vs


def lora_variants(batch: int, k: int, n: int, rank: int, dtype: str, wide: bool = False) -> list[Variant]:
    vs: list[Variant] = []
    for mode in [{}] if batch == 1 else [{}, DOT16]:
        tag = "" if not mode else " dot"
        for c in (8, 16, 32) if wide else (16, 32):
            if _divides(n, c):
                vs.append(Variant(f"fused c{c} k512{tag}", hw.fused_lora(batch, k, n, rank, n // c, k // 512, dtype=dtype),
                                  {"num_warps": 4, **mode}, "one kernel, A re-read per block"))
                vs.append(Variant(f"2kernel c{c} k512{tag}", two_kernel_lora(batch, k, n, rank, n // c, k // 512, 16, k // (16 * 256), dtype=dtype),
                                  {"num_warps": 4, **mode}, "split-K X@A^T, then GEMV with low-rank epilogue"))
    return vs


def gated_mlp_variants(batch: int, hidden: int, inter: int, dtype: str, wide: bool = False) -> list[Variant]:
    vs: list[Variant] = []
    for mode in [{}] if batch == 1 else [{}, DOT16]:
        tag = "" if not mode else " dot"
        for c, kc in itertools.product((8, 16, 32) if wide else (8, 16), (512, 1024) if wide else (512,)):
            if _divides(inter, c) and _divides(hidden, kc):
                vs.append(Variant(f"fused c{c} k{kc}{tag}", hw.fused_gated_mlp(batch, hidden, inter, inter // c, hidden // kc, dtype=dtype),
                                  {"num_warps": 4, **mode}, "one kernel, both matmuls share the X tile"))
    return vs


# The default (narrow) lists: the fastest schedules of the wide sweep on an H200 on 2026-12-02
# (results/2026-12-02-h200-sweep.json, sweep2.json), by spec and batch class; plus neighbours for gate/up,
# which the sweep did not reach.
TUNED: dict[tuple[str, str], tuple[str, ...]] = {
    ("rmsnorm_linear", "b1"): ("fused c8 k1024 w4", "fused c8 k512 w4", "fused c16 k512 w8", "fused c4 k1024 w4", "fused c16 k1024 w4"),
    ("rmsnorm_linear", "b>1"): ("splitk c128 s4 k256 dot w4 st3", "splitk c64 s4 k256 dot w4 st3", "splitk c64 s8 k256 dot", "splitk c64 s4 k256 dot", "splitk c32 s8 k256 dot", "fused c32 k512 w4 dot",
                                "fused c16 k512 w4 dot"),
    ("attention_decode", "b1"): ("splitkv s16 t64", "splitkv s32 t64", "splitkv s64 t64"),
    ("attention_decode", "b>1"): ("splitkv s16 t64", "splitkv s8 t64"),
    ("lora_linear", "b1"): ("2kernel c8 k512", "fused c16 k512", "2kernel c16 k512"),
    ("lora_linear", "b>1"): ("2kernel c32 k512 dot", "fused c32 k512 dot", "2kernel c16 k512 dot"),
    ("gated_mlp", "b1"): ("fused c8 k1024", "fused c16 k1024", "fused c8 k512"),
    ("gated_mlp", "b>1"): ("fused c32 k512 dot", "fused c16 k512 dot"),
}


def variants_for(spec: str, dims: dict[str, int], dtype: str, wide: bool = False) -> list[Variant]:
    """The variants the benchmark times for one case: the whole sweep with ``wide``, else the tuned few."""
    vs = _all_variants(spec, dims, dtype)
    if wide:
        return vs
    picked = TUNED[(spec, "b1" if dims["batch"] == 1 else "b>1")]
    return [v for v in vs if v.name in picked]


def _all_variants(spec: str, dims: dict[str, int], dtype: str, wide: bool = True) -> list[Variant]:
    if spec == "rmsnorm_linear":
        return rmsnorm_linear_variants(dims["batch"], dims["hidden"], dims["out"], dtype, wide)
    if spec == "attention_decode":
        return attention_variants(dims["batch"], dims["q_heads"], dims["kv_heads"], dims["head_dim"], dims["kv_len"], dtype, wide)
    if spec == "lora_linear":
        return lora_variants(dims["batch"], dims["in"], dims["out"], dims["rank"], dtype, wide)
    if spec == "gated_mlp":
        return gated_mlp_variants(dims["batch"], dims["hidden"], dims["intermediate"], dtype, wide)
    raise ValueError(f"no variants for spec {spec!r}")
