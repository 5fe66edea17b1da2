"""``matmul="auto"`` splits loop iterations where a tile matmul would stay GEMV math that spills registers."""

from __future__ import annotations

import re

import pytest
from handwritten import fused_gated_mlp, fused_rmsnorm_linear, split_kv_attention
from test_codegen_numerics import TOL, check

from mirage_serve.codegen import CodegenParams, generate_source, triton_gen
from mirage_serve.codegen.params import gemv_fits
from mirage_serve.codegen.runtime import _plan
from mirage_serve.tune.cost_model import estimate


def loops(src: str) -> list[int]:
    return [int(n) for n in re.findall(r"for i in range\((\d+)\)", src)]


def splits(graph, params: CodegenParams | None = None) -> list[int]:
    """loop_split of each customized operator of ``graph``, as codegen and the cost model see it."""
    info = graph.info
    out, t = [], 0
    for op in graph.ops:
        if op.kind == "customized":
            out.append(triton_gen.loop_split(op, [info[i] for i in op.inputs], list(info[t : t + op.num_outputs]), params or CodegenParams()))
        t += op.num_outputs
    return out


def test_tiles_too_large_for_registers_and_for_tl_dot_split_until_tl_dot_fits():
    # 4 rows x 128 columns x 256: GEMV would hold 1024 products a thread at 4 warps, and tl.dot's fp32
    # tiles (16 + 128) x 256 x 4 B = 147 KB a stage are over the bound; split in two, 74 KB: tl.dot
    g = fused_gated_mlp(4, 512, 256, n_blocks=2, loop=2)
    assert gemv_fits(4, 128, 256, 4) and not gemv_fits(4, 128, 128, 4)
    (src,) = generate_source(g)
    assert loops(src) == [4] and src.count("tl.dot(") == 2
    assert splits(g) == [2]
    (fma,) = generate_source(g, CodegenParams(matmul="fma"))  # asked for GEMV math: as written
    assert loops(fma) == [2] and "tl.dot(" not in fma
    (dot,) = generate_source(g, CodegenParams(matmul="dot"))
    assert loops(dot) == [2]
    _, errs = check(g, "float32")
    assert max(errs) <= TOL["float32"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_row_gemv_splits_until_its_product_fits_the_registers(dtype):
    # one row x 128 columns x 512: 512 products a thread; GEMV math either way (tl.dot would pad the row
    # to 16); four steps of 128 hold 128 a thread
    g = fused_rmsnorm_linear(1, 512, 256, n_blocks=2, loop=1, dtype=dtype)
    (src,) = generate_source(g)
    assert loops(src) == [4] and "tl.dot(" not in src
    assert splits(g) == [4]
    assert splits(g, CodegenParams(num_warps=16)) == [1]  # at 16 warps the 65536 products are 128 a thread
    _, errs = check(g, dtype)
    assert max(errs) <= TOL[dtype]


def test_decode_attention_with_long_key_tiles_splits_onto_tl_dot():
    # 4 query rows a KV head, 256 keys an iteration, head dim 128: Q.K^T reads scaled K (tf32: 139 KB of
    # tiles) and P.V softmax weights; 128 keys a step fit, and both take tl.dot
    g = split_kv_attention(1, 8, 2, 128, 512, splits=2, loop=1, dtype="bfloat16")
    k1, k2 = (k for k in _plan(g, CodegenParams()).kernels if k is not None)
    assert loops(k1.text) == [2] and k1.text.count("tl.dot(") == 2
    assert splits(g) == [2, 1]  # the combine has no loop
    _, errs = check(g, "bfloat16")
    assert max(errs) <= TOL["bfloat16"]


def test_code_without_a_spilling_gemv_is_unchanged(monkeypatch):
    small = [fused_rmsnorm_linear(1, 64, 48, n_blocks=6, loop=4), fused_rmsnorm_linear(16, 64, 32, n_blocks=2, loop=4),
             split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4)]
    now = [generate_source(g) for g in small]
    monkeypatch.setattr(triton_gen, "MAX_AUTO_SPLIT", 1)
    assert now == [generate_source(g) for g in small]
    assert all(s == [1] * len(s) for s in map(splits, small))


def test_the_split_stops_at_its_limit_and_adds_to_k_chunks(monkeypatch):
    g = fused_rmsnorm_linear(1, 512, 256, n_blocks=2, loop=1)
    assert loops(generate_source(g, CodegenParams(k_chunks=2))[0]) == [4]  # k_chunks 2, then 2 more for the registers
    assert loops(generate_source(g, CodegenParams(k_chunks=8))[0]) == [8]  # already fits
    monkeypatch.setattr(triton_gen, "MAX_AUTO_SPLIT", 2)
    assert loops(generate_source(g)[0]) == [2]


def test_the_cost_model_follows_the_split():
    g = fused_gated_mlp(4, 512, 256, n_blocks=2, loop=2)
    auto, chunked = estimate(g), estimate(g, {"k_chunks": 2})
    assert auto.kernels[0].matmul_mode == "dot" and auto.time_s == chunked.time_s
    assert estimate(g, {"matmul": "fma"}).kernels[0].matmul_mode == "gemv"
    one = fused_rmsnorm_linear(1, 512, 256, n_blocks=2, loop=1)
    assert estimate(one).time_s == estimate(one, {"k_chunks": 4}).time_s
