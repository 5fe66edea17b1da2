"""On a CUDA device with TRITON_INTERPRET=0: compiled kernels match the float64 reference
(run: TRITON_INTERPRET=0 python -m pytest tests/test_codegen_gpu.py). Skipped elsewhere."""

from __future__ import annotations

import os

import pytest
import torch
from codegen_graphs import split_k_rmsnorm_linear, two_kernel_add_rmsnorm_linear
from handwritten import fused_gated_mlp, fused_lora, fused_rmsnorm_linear, split_kv_attention

from mirage_serve import cmd_bench
from mirage_serve.codegen import CodegenParams, compile_graph
from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a CUDA GPU and TRITON_INTERPRET=0"
)

GRAPHS = {
    "gemv_b1": lambda dt: fused_rmsnorm_linear(1, 1024, 512, n_blocks=64, loop=4, dtype=dt),
    "gemv_b4": lambda dt: fused_rmsnorm_linear(4, 1024, 384, n_blocks=16, loop=8, dtype=dt),
    "dot_b32": lambda dt: fused_rmsnorm_linear(32, 1024, 512, n_blocks=16, loop=8, dtype=dt),
    "split_kv": lambda dt: split_kv_attention(4, 32, 8, 128, 1024, splits=8, loop=4, dtype=dt),
    "lora": lambda dt: fused_lora(16, 512, 512, 16, n_blocks=16, loop=4, dtype=dt),
    "gated_mlp": lambda dt: fused_gated_mlp(4, 512, 512, n_blocks=16, loop=4, dtype=dt),
    "split_k": lambda dt: split_k_rmsnorm_linear(4, 1024, 512, n_blocks=16, splits=4, loop=2, dtype=dt),
    "two_kernel": lambda dt: two_kernel_add_rmsnorm_linear(8, 1024, 512, n_blocks=16, loop=4, dtype=dt),
    "norm_then_linear": lambda dt: cmd_bench.load_bench("kernels").V.norm_then_linear(32, 1024, 480, n_blocks=10, loop=8, norm_blocks=8, dtype=dt),
}


PARAMS = {
    "auto": CodegenParams(),
    "dot-native": CodegenParams(matmul="dot", dot_precision="input", num_warps=8, num_stages=3),
    "dot-swap-pdl": CodegenParams(matmul="dot", dot_precision="input", dot_swap=1, pdl=1),
    "chunks": CodegenParams(k_chunks=2, num_stages=3),
    "dot-acc": CodegenParams(matmul="dot", dot_precision="input", dot_acc=1, num_stages=4, pdl=1),
    "dot-swap-acc": CodegenParams(matmul="dot", dot_precision="input", dot_swap=1, dot_acc=1, num_stages=4, pdl=1),
}


@pytest.mark.parametrize("params", list(PARAMS.values()), ids=list(PARAMS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(GRAPHS))
def test_gpu_matches_reference(name, dtype, params):
    g = GRAPHS[name](dtype)
    cg = compile_graph(g, params)
    ins = random_inputs(g, torch.Generator().manual_seed(0), scale=0.5)
    refs = execute(g, ins)
    outs = cg(*[x.cuda() for x in ins])
    tol = 3e-2 if dtype == "bfloat16" or params.dot_precision == "input" else 1e-4
    if dtype == "float32" and params.dot_precision == "input":
        tol = 1e-4  # 'input' precision only changes 16-bit graphs
    for o, r in zip(outs, refs, strict=True):
        err = float((o.cpu().double() - r).abs().max() / r.abs().max())
        assert err < tol, (name, dtype, err)
    if cg.variable_batch:
        n = max(1, cg.bucket // 2)
        small = [x[:n].contiguous() if i in cg.row_inputs else x for i, x in enumerate(ins)]
        outs = cg(*[x.cuda() for x in small])
        for o, r in zip(outs, refs, strict=True):
            rr = r[:n] if r.shape[0] == cg.bucket else r
            assert float((o.cpu().double() - rr).abs().max() / rr.abs().max()) < tol


@pytest.mark.parametrize("params", [CodegenParams(), CodegenParams(matmul="dot", dot_precision="input", pdl=1)], ids=["fma", "dot-pdl"])
def test_attention_serves_every_kv_length_up_to_its_bucket(params):
    """One kernel per KV bucket: shorter K/V (their own size), or the bucket with a valid length on the device."""
    g = split_kv_attention(2, 32, 8, 128, 1024, splits=8, loop=2, dtype="bfloat16")
    cg = compile_graph(g, params, variable_dims=((1, 1), (2, 1)))
    ins = [x.cuda() for x in random_inputs(g, torch.Generator().manual_seed(3), scale=0.5)]
    for kv in (1024, 777, 64, 1):
        spec = build_spec("attention_decode", {"batch": 2, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "kv_len": kv}, "bfloat16")
        k, v = ins[1][:, :kv].contiguous(), ins[2][:, :kv].contiguous()
        ref = execute(spec, [ins[0].cpu(), k.cpu(), v.cpu()])[0]
        for out in (cg(ins[0], k, v)[0], cg(*ins, lengths=torch.tensor([kv], dtype=torch.int32, device="cuda"))[0]):
            assert torch.isfinite(out).all()
            assert float((out.cpu().double() - ref).norm() / ref.norm()) < 2e-2, kv


def test_kernel_stats_report_registers_and_spills():
    cg = compile_graph(fused_rmsnorm_linear(1, 1024, 512, n_blocks=64, loop=4, dtype="bfloat16"))
    cg(*[x.cuda() for x in random_inputs(cg.graph, torch.Generator().manual_seed(0))])
    (st,) = cg.kernel_stats()
    assert st["registers"] and st["spills"] == 0
