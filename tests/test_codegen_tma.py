"""``tma``: streamed loop tiles loaded through tensor descriptors where the tile is a plain box of its
tensor (every mask a tensor bound, enforced by the descriptor's shape), ordinary loads elsewhere;
under Triton's interpreter against the float64 reference (where it runs descriptor loads; else
the generator falls back to ordinary loads there), and for sm_90 (bulk tensor copies in the PTX)."""

from __future__ import annotations

import re

import pytest
import torch
from handwritten import fused_rmsnorm_linear, split_kv_attention

from mirage_serve.codegen import CodegenParams, compile_graph, generate_source
from mirage_serve.codegen.aot import compile_to_ptx
from mirage_serve.codegen.params import CodegenError
from mirage_serve.codegen.runtime import interpreter_has_descriptors
from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec

VAR = ((1, 1), (2, 1))
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
DOT = {"matmul": "dot", "dot_precision": "input"}


def _err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _descriptors(src: str) -> dict[str, str]:
    """Input pointer -> the shape its descriptor is made with."""
    return {m.group(1): m.group(2) for m in re.finditer(r"tl\.make_tensor_descriptor\((in\d)_ptr, shape=\[([^\]]*)\]", src)}


def test_descriptors_only_for_boxes_of_their_tensor():
    lin = fused_rmsnorm_linear(32, 512, 256, 4, 2, dtype="bfloat16")  # 64 columns a program: W's tile is a box
    src = generate_source(lin, CodegenParams(**DOT, dot_swap=1, tma=1))[0]
    assert _descriptors(src) == {"in0": "n_rows, 512", "in2": "256, 512"}  # X bounded by the row count; G is 1-D
    assert "desc2.load([pid0 * 64, i * 256])" in src and "tl.load(in1_ptr" in src and "tl.load(in2_ptr" not in src
    ragged = fused_rmsnorm_linear(32, 512, 192, 4, 2, dtype="bfloat16")  # 48 columns padded to 64: ordinary load of W
    assert set(_descriptors(generate_source(ragged, CodegenParams(**DOT, dot_swap=1, tma=1))[0])) == {"in0"}
    att = split_kv_attention(1, 8, 2, 32, 128, splits=4, loop=2, dtype="bfloat16", d_split=2)
    k0, k1 = generate_source(att, CodegenParams(**DOT, tma=1), VAR)
    assert _descriptors(k0) == {"in1": "n_rows, tl.maximum(v_ext0, 1), 32", "in2": "n_rows, tl.maximum(v_ext0, 1), 32"}  # Q is loop-invariant
    assert "tl.permute(tl.reshape(desc1.load([pid0, pid1 * 32 + i * 16, 0]), (16, 32,)), (1, 0))" in k0  # K as [d, keys] for Q @ K^T
    assert not _descriptors(k1)  # the combine has no loop
    late = generate_source(att, CodegenParams(**DOT, tma=1, late_ext_mask=2), VAR)[0]
    assert _descriptors(late)["in1"] == "n_rows, n_ext0, 32"  # bounded by the size; the valid length masks after the load
    assert "make_tensor_descriptor" not in "".join(generate_source(att, CodegenParams(**DOT), VAR))
    assert CodegenParams(tma=1).key() != CodegenParams().key() and CodegenParams(tma=0).key() == CodegenParams().key()
    with pytest.raises(CodegenError):
        CodegenParams(tma=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [CodegenParams(tma=1), CodegenParams(**DOT, pdl=1, num_stages=3, tma=1),
                                    CodegenParams(**DOT, pdl=1, num_stages=3, tma=1, late_ext_mask=2),
                                    CodegenParams(**DOT, pdl=1, fused_combine=1, tma=1)], ids=["fma", "dot", "dot-late", "dot-fused"])
def test_attention_through_descriptors_with_nan_past_the_valid_length(dtype, params):
    g = split_kv_attention(2, 8, 2, 16, 64, splits=2, loop=2, dtype=dtype, d_split=2)
    cg = compile_graph(g, params, variable_dims=VAR)
    assert ("make_tensor_descriptor" in cg.kernel_sources[0].text) == interpreter_has_descriptors()
    ins = random_inputs(g, torch.Generator().manual_seed(7))
    for kv in (64, 37, 1):
        spec = build_spec("attention_decode", {"batch": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 16, "kv_len": kv}, dtype)
        ref = execute(spec, [ins[0], ins[1][:, :kv].contiguous(), ins[2][:, :kv].contiguous()], dtype=torch.float64)[0]
        k, v = ins[1].clone(), ins[2].clone()
        k[:, kv:], v[:, kv:] = float("nan"), float("nan")
        out = cg(ins[0], k, v, lengths=torch.tensor([kv], dtype=torch.int32), poison=True)[0]
        assert torch.isfinite(out).all() and _err(out, ref) < TOL[dtype], kv
        short = cg(ins[0], ins[1][:, :kv].contiguous(), ins[2][:, :kv].contiguous(), poison=True)[0]  # a tensor shorter than the bucket
        assert torch.isfinite(short).all() and _err(short, ref) < TOL[dtype], kv


@pytest.mark.parametrize("params", [CodegenParams(tma=1), CodegenParams(**DOT, dot_swap=1, num_stages=3, tma=1)], ids=["fma", "dot-swap"])
def test_rmsnorm_linear_through_descriptors_at_fewer_rows(params):
    g = fused_rmsnorm_linear(16, 64, 64, 2, 2, dtype="bfloat16")  # X [<=16, 64], W tiles [32, 32]
    assert set(_descriptors(generate_source(g, params)[0])) == {"in0", "in2"}
    cg = compile_graph(g, params)
    x, gn, w = random_inputs(g, torch.Generator().manual_seed(8))
    ref = execute(g, [x, gn, w], dtype=torch.float64)[0]
    for rows in (16, 5):
        buf = torch.full_like(x, float("nan"))
        buf[:rows] = x[:rows]
        out = cg(buf[:rows], gn, w, poison=True)[0]  # NaN past the rows in memory: the descriptor's bound is the row count
        assert out.shape == (rows, 64)
        assert torch.isfinite(out).all() and _err(out, ref[:rows]) < TOL["bfloat16"], rows


@pytest.mark.parametrize("which", ["attention", "attention-late", "qkv"])
def test_descriptors_compile_to_hopper_bulk_tensor_copies(which):
    if which.startswith("attention"):
        g, var = split_kv_attention(1, 32, 8, 128, 8192, splits=32, loop=4, dtype="bfloat16", d_split=2), VAR
        params = CodegenParams(**DOT, pdl=1, num_stages=3, tma=1, late_ext_mask=2 if which.endswith("late") else 0)
    else:
        g, var = fused_rmsnorm_linear(32, 4096, 6144, 96, 16, dtype="bfloat16"), ()
        params = CodegenParams(**DOT, dot_swap=1, num_stages=4, tma=1)
    cg = compile_graph(g, params, variable_dims=var)
    assert cg.kernel_sources[0].tma and not cg.kernel_sources[-1].tma or which == "qkv"
    src = generate_source(g, params, var)[0]
    assert src.count("tl.make_tensor_descriptor(") == 2
    ptx = compile_to_ptx(cg.kernel_sources[:1], arch=90, num_warps=params.num_warps, num_stages=params.num_stages, launch_pdl=bool(params.pdl))[0]
    assert ".target sm_90" in ptx and "cp.async.bulk.tensor" in ptx and "tensormap" in ptx
    if which == "qkv":
        assert "wgmma" in ptx
