"""``late_ext_mask``: loads of a variable-extent dim masked by the tensor's size in memory (a launch
argument), positions past the valid length excluded after the load; under Triton's interpreter
(against the float64 reference, with NaN past the valid length) and for sm_90."""

from __future__ import annotations

import re

import pytest
import torch
from handwritten import split_kv_attention

from mirage_serve.codegen import CodegenParams, compile_graph, generate_source
from mirage_serve.codegen.aot import compile_to_ptx
from mirage_serve.codegen.params import CodegenError
from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec

VAR = ((1, 1), (2, 1))  # K and V: the KV length may be any size up to the bucket
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
PARAMS = {
    "fma-all": CodegenParams(late_ext_mask=2),
    "fma-k": CodegenParams(late_ext_mask=1),
    "dot-pdl-all": CodegenParams(matmul="dot", dot_precision="input", num_stages=3, pdl=1, late_ext_mask=2),
    "dot-pdl-k": CodegenParams(matmul="dot", dot_precision="input", num_stages=3, pdl=1, late_ext_mask=1),
    "dot-fused-all": CodegenParams(matmul="dot", dot_precision="input", pdl=1, fused_combine=1, late_ext_mask=2),
}


def _err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _kv_loads(src: str) -> list[str]:
    return [line for line in src.splitlines() if re.search(r"tl\.load\(in[12]_ptr", line)]


def test_loads_wait_for_no_length_read():
    g = split_kv_attention(1, 8, 2, 32, 128, splits=4, loop=2, dtype="bfloat16", d_split=4)
    k0, _ = generate_source(g, PARAMS["dot-pdl-all"], VAR)
    kv_loads = _kv_loads(k0)
    assert len(kv_loads) == 2 and all("bm" in line and "dm" not in line for line in kv_loads)
    assert "bm2 = (pid1 * 32 + i * 16 + r2) < n_ext0" in k0
    # V feeds the matmul over the KV positions: zeroed there past the valid length (NaN * 0 is NaN)
    assert re.search(r"tl\.dot\(.*tl\.where\(dm\d\[:, None\], t2, 0\.0\)\)", k0)
    # 1: only K (its KV positions are the scores' columns, masked after the matmul); V keeps the valid-length mask
    k0, _ = generate_source(g, PARAMS["dot-pdl-k"], VAR)
    k_load, v_load = _kv_loads(k0)
    assert "bm2[None, :]" in k_load and "dm2" not in k_load and "dm2[:, None]" in v_load and "bm2" not in v_load
    assert not re.search(r"tl\.where\(dm\d\[:, None\], t2, 0\.0\)", k0)
    base, _ = generate_source(g, CodegenParams(matmul="dot", dot_precision="input", num_stages=3, pdl=1), VAR)
    assert "bm2" not in base and "n_ext0" in base  # off by default
    assert CodegenParams(late_ext_mask=1).key() != CodegenParams().key()
    assert "late_ext_mask" not in CodegenParams().to_dict() or CodegenParams().key() == CodegenParams(late_ext_mask=0).key()
    with pytest.raises(CodegenError):
        CodegenParams(late_ext_mask=3)


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shorter_valid_length_with_nan_past_it(dtype, name):
    """The KV tensors are the bucket's size; past the valid length they hold NaN, which must not leak."""
    params = PARAMS[name]
    g = split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4, dtype=dtype, d_split=2)
    cg = compile_graph(g, params, variable_dims=VAR)
    ins = random_inputs(g, torch.Generator().manual_seed(5))
    for kv in (96, 50, 8, 1):  # 8 and 1 leave whole splits empty
        spec = build_spec("attention_decode", {"batch": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 16, "kv_len": kv}, dtype)
        ref = execute(spec, [ins[0], ins[1][:, :kv].contiguous(), ins[2][:, :kv].contiguous()], dtype=torch.float64)[0]
        k, v = ins[1].clone(), ins[2].clone()
        k[:, kv:], v[:, kv:] = float("nan"), float("nan")
        for _ in range(2):  # fused: the counters are back at zero after each launch
            out = cg(ins[0], k, v, lengths=torch.tensor([kv], dtype=torch.int32), poison=True)[0]
            assert torch.isfinite(out).all() and _err(out, ref) < TOL[dtype], (kv, name)
        # a tensor shorter than the bucket: loads stop at its size
        short = cg(ins[0], ins[1][:, :kv].contiguous(), ins[2][:, :kv].contiguous(), poison=True)[0]
        assert torch.isfinite(short).all() and _err(short, ref) < TOL[dtype], (kv, name)
    if params.fused_combine:
        assert int(cg._counters["cpu"].abs().sum()) == 0


def test_graphs_without_variable_extents_are_unchanged():
    g = split_kv_attention(1, 8, 2, 32, 128, splits=4, loop=2, dtype="bfloat16", d_split=4)
    assert generate_source(g, CodegenParams(late_ext_mask=2)) == generate_source(g, CodegenParams())


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_late_ext_mask_compiles_to_hopper_ptx(name):
    params = PARAMS[name]
    g = split_kv_attention(1, 32, 8, 128, 1024, splits=16, loop=2, dtype="bfloat16", d_split=1 if params.fused_combine else 4)
    sources = compile_graph(g, params, variable_dims=VAR).kernel_sources
    ptxs = compile_to_ptx(sources, arch=90, num_warps=params.num_warps, num_stages=params.num_stages, launch_pdl=bool(params.pdl))
    for ks, ptx in zip(sources, ptxs, strict=True):
        assert f".entry {ks.name}" in ptx and ".target sm_90" in ptx
    if params.matmul == "dot":
        assert "mma.sync" in ptxs[0] or "wgmma" in ptxs[0]
