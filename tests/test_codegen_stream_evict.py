"""``stream_evict``: L2 eviction hints on loads (``evict_first`` where no other program reads the
tile, with 2 ``evict_last`` where several do); under Triton's interpreter against the float64
reference, and for sm_90 (the hints reach the PTX as cache policies)."""

from __future__ import annotations

import re

import pytest
import torch
from handwritten import fused_rmsnorm_linear, split_kv_attention

from mirage_serve.codegen import CodegenParams, compile_graph, generate_source
from mirage_serve.codegen.aot import compile_to_ptx
from mirage_serve.codegen.params import CodegenError
from mirage_serve.reference import execute, random_inputs

VAR = ((1, 1), (2, 1))
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
DOT = {"matmul": "dot", "dot_precision": "input"}


def _err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _hints(src: str) -> dict[str, str | None]:
    out = {}
    for line in src.splitlines():
        m = re.search(r"tl\.load\((in\d)_ptr", line)
        if m:
            h = re.search(r'eviction_policy="(\w+)"', line)
            out[m.group(1)] = h.group(1) if h else None
    return out


def test_hints_follow_which_programs_read_a_tile():
    lin = fused_rmsnorm_linear(8, 256, 128, 4, 2, dtype="bfloat16")  # X, G replicated over the column blocks; W split
    assert _hints(generate_source(lin, CodegenParams(stream_evict=1))[0]) == {"in0": None, "in1": None, "in2": "evict_first"}
    assert _hints(generate_source(lin, CodegenParams(stream_evict=2))[0]) == {"in0": "evict_last", "in1": "evict_last", "in2": "evict_first"}
    att = split_kv_attention(1, 8, 2, 32, 128, splits=4, loop=2, dtype="bfloat16", d_split=2)
    k0, k1 = generate_source(att, CodegenParams(stream_evict=2), VAR)
    assert _hints(k0) == {"in0": "evict_last", "in1": "evict_first", "in2": "evict_first"}  # Q re-read by every split
    assert _hints(k1)["in2"] == "evict_first"  # the partial outputs, each read by one combine program
    assert "eviction_policy" not in "".join(generate_source(att, CodegenParams(), VAR))
    assert CodegenParams(stream_evict=1).key() != CodegenParams().key() and CodegenParams(stream_evict=0).key() == CodegenParams().key()
    with pytest.raises(CodegenError):
        CodegenParams(stream_evict=3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [CodegenParams(stream_evict=2), CodegenParams(**DOT, pdl=1, num_stages=3, stream_evict=1, late_ext_mask=2),
                                    CodegenParams(**DOT, pdl=1, fused_combine=1, stream_evict=2)], ids=["fma", "dot-late", "dot-fused"])
def test_attention_with_hints_matches_the_reference(dtype, params):
    g = split_kv_attention(2, 8, 2, 16, 64, splits=2, loop=2, dtype=dtype, d_split=2)
    cg = compile_graph(g, params, variable_dims=VAR)
    ins = random_inputs(g, torch.Generator().manual_seed(3))
    out = cg(*ins, poison=True)[0]
    ref = execute(g, ins, dtype=torch.float64)[0]
    assert torch.isfinite(out).all() and _err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("params", [CodegenParams(stream_evict=2), CodegenParams(**DOT, dot_swap=1, num_stages=3, stream_evict=2)], ids=["fma", "dot-swap"])
def test_rmsnorm_linear_with_hints_matches_the_reference(params):
    g = fused_rmsnorm_linear(4, 64, 32, 2, 2, dtype="bfloat16")
    ins = random_inputs(g, torch.Generator().manual_seed(4))
    out = compile_graph(g, params)(*ins, poison=True)[0]
    assert _err(out, execute(g, ins, dtype=torch.float64)[0]) < TOL["bfloat16"]


@pytest.mark.parametrize("which", ["attention", "qkv"])
def test_hints_compile_to_hopper_cache_policies(which):
    if which == "attention":
        g, var = split_kv_attention(1, 32, 8, 128, 1024, splits=16, loop=2, dtype="bfloat16", d_split=4), VAR
        params = CodegenParams(**DOT, pdl=1, num_stages=3, stream_evict=2, late_ext_mask=2)
    else:
        g, var = fused_rmsnorm_linear(32, 4096, 6144, 96, 16, dtype="bfloat16"), ()
        params = CodegenParams(**DOT, dot_swap=1, num_stages=4, stream_evict=2)
    sources = compile_graph(g, params, variable_dims=var).kernel_sources
    ptx = compile_to_ptx(sources, arch=90, num_warps=params.num_warps, num_stages=params.num_stages, launch_pdl=bool(params.pdl))[0]
    assert ".target sm_90" in ptx and "L2::evict_first" in ptx and "L2::evict_last" in ptx and "L2::cache_hint" in ptx
