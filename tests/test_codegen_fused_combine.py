"""``fused_combine``: a partials kernel and its combine as one launch (the last program of each group
to count itself in on an atomic counter runs the combine), under Triton's interpreter and for sm_90."""

from __future__ import annotations

import pytest
import torch
from codegen_graphs import split_k_rmsnorm_linear
from handwritten import split_kv_attention

from mirage_serve import cmd_bench
from mirage_serve.codegen import CodegenParams, compile_graph, generate_source
from mirage_serve.codegen.aot import compile_to_ptx
from mirage_serve.codegen.runtime import fusable_combine, supports
from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec
from mirage_serve.tune import space

V = cmd_bench.load_bench("kernels").V
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
FUSED = CodegenParams(fused_combine=1)
DOT = CodegenParams(matmul="dot", dot_precision="input", num_stages=3, pdl=1, fused_combine=1)


def _err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("d_split", [1, 4])
@pytest.mark.parametrize("params", [FUSED, DOT], ids=["fma", "dot-pdl"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_split_kv_attention_matches_reference(dtype, params, d_split):
    g = split_kv_attention(2, 8, 2, 32, 128, splits=4, loop=2, dtype=dtype, d_split=d_split)
    (src,) = generate_source(g, params)  # one kernel, the combine a callee
    assert "def mirage_kernel_0_combine(" in src and "tl.atomic_add(cnt_ptr + grp, 1)" in src
    assert src.count("tl.program_id(") == 2  # the partials kernel's; the combine gets its program ids as arguments
    cg = compile_graph(g, params)
    assert len(cg.kernel_sources) == 1 and cg.kernel_sources[0].counters == 4  # one per (sequence, KV head)
    ins = random_inputs(g, torch.Generator().manual_seed(3))
    ref = execute(g, ins, dtype=torch.float64)[0]
    for _ in range(2):  # the counters are back at zero after each launch
        out = cg(*ins, poison=True)[0]
        assert torch.isfinite(out).all() and _err(out, ref) < TOL[dtype]
        assert int(cg._counters["cpu"].abs().sum()) == 0


def test_fused_attention_serves_shorter_kv_and_fewer_rows():
    g = split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4, dtype="bfloat16", d_split=2)
    cg = compile_graph(g, FUSED, variable_dims=((1, 1), (2, 1)))
    ins = random_inputs(g, torch.Generator().manual_seed(4))
    for kv in (96, 50, 8, 1):  # 8 and 1 leave whole splits empty
        spec = build_spec("attention_decode", {"batch": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 16, "kv_len": kv}, "bfloat16")
        k, v = ins[1][:, :kv].contiguous(), ins[2][:, :kv].contiguous()
        ref = execute(spec, [ins[0], k, v])[0]
        for out in (cg(ins[0], k, v, poison=True)[0], cg(*ins, lengths=torch.tensor([kv], dtype=torch.int32))[0]):
            assert torch.isfinite(out).all() and _err(out, ref) < TOL["bfloat16"], kv
    # batch 1 of the bucket's 2 (rows are the KV-head dim here: 2 KV heads a sequence)
    few = [x[:2].contiguous() for x in ins]
    spec = build_spec("attention_decode", {"batch": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 16, "kv_len": 96}, "bfloat16")
    ref = execute(spec, few)[0]
    out = cg(*few, poison=True)[0]
    assert out.shape[0] == 2 and _err(out, ref) < TOL["bfloat16"]
    assert int(cg._counters["cpu"].abs().sum()) == 0


def test_graphs_that_do_not_fuse_are_refused_with_the_reason():
    split_k = V.split_k_rmsnorm_linear(4, 128, 64, n_blocks=2, splits=2, loop=2, combine_blocks=1)
    fusion, why = fusable_combine(split_k)
    assert fusion is None and "mapped by some outputs and not others" in why
    lora = V.two_kernel_lora(3, 64, 32, 8, n_blocks=4, loop=2, xa_splits=2, xa_loop=2)
    ok, why = supports(lora, FUSED)
    assert not ok and "other than the first kernel's outputs" in why
    ok, why = supports(split_k_rmsnorm_linear(4, 128, 64, n_blocks=2, splits=2, loop=2), FUSED)
    assert not ok and "exactly two customized kernels" in why


def test_tuner_offers_the_fused_combine_where_it_applies():
    attn = split_kv_attention(1, 8, 2, 32, 128, splits=4, loop=2, dtype="bfloat16", d_split=4)
    first = space.initial_params(attn)
    assert any(p.get("fused_combine") for p in first) and any(not p.get("fused_combine") for p in first)
    assert any(q.get("fused_combine") == 0 or "fused_combine" not in q for q in space.neighbours(attn, {"fused_combine": 1, "pdl": 1}))
    lora = V.two_kernel_lora(3, 64, 32, 8, n_blocks=4, loop=2, xa_splits=2, xa_loop=2)
    assert not any(p.get("fused_combine") for p in space.initial_params(lora))


@pytest.mark.parametrize("params", [FUSED, DOT, CodegenParams(matmul="dot", dot_precision="input", num_warps=2, pdl=1, fused_combine=1)],
                         ids=["fma", "dot-pdl", "dot-2warps"])
def test_fused_attention_compiles_to_hopper_ptx(params):
    g = split_kv_attention(1, 32, 8, 128, 1024, splits=16, loop=2, dtype="bfloat16", d_split=4)
    (ks,) = compile_graph(g, params, variable_dims=((1, 1), (2, 1))).kernel_sources
    (ptx,) = compile_to_ptx([ks], arch=90, num_warps=params.num_warps, num_stages=params.num_stages, launch_pdl=bool(params.pdl))
    assert f".entry {ks.name}" in ptx and ".target sm_90" in ptx
    assert "atom.global" in ptx and ".cg." in ptx  # the counter, and partials read through L2
