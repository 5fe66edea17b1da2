"""Every generated kernel compiles to PTX for Hopper (sm_90) without a GPU."""

from __future__ import annotations

import pytest
from codegen_graphs import split_k_rmsnorm_linear, two_kernel_add_rmsnorm_linear
from handwritten import fused_gated_mlp, fused_lora, fused_rmsnorm_linear, split_kv_attention

from mirage_serve.codegen import CodegenParams, compile_graph
from mirage_serve.codegen.aot import compile_to_ptx

GRAPHS = {
    "rmsnorm_gemv": fused_rmsnorm_linear(1, 256, 96, n_blocks=4, loop=2, dtype="bfloat16"),
    "rmsnorm_dot": fused_rmsnorm_linear(16, 256, 128, n_blocks=4, loop=4, dtype="bfloat16"),
    "split_kv": split_kv_attention(2, 8, 2, 32, 256, splits=4, loop=2, dtype="bfloat16"),
    "lora": fused_lora(16, 128, 64, 16, n_blocks=2, loop=2, dtype="bfloat16"),
    "gated_mlp": fused_gated_mlp(4, 128, 64, n_blocks=2, loop=2),
    "split_k": split_k_rmsnorm_linear(4, 128, 64, n_blocks=2, splits=2, loop=2, dtype="float16"),
    "two_kernel": two_kernel_add_rmsnorm_linear(4, 96, 48, n_blocks=2, loop=2, dtype="bfloat16"),
}


@pytest.mark.parametrize("params", [CodegenParams(), CodegenParams(matmul="dot", dot_precision="input", num_warps=8)])
def test_kernels_compile_to_hopper_ptx(params):
    sources = [ks for graph in GRAPHS.values() for ks in compile_graph(graph, params).kernel_sources]
    assert len(sources) == 9
    ptxs = compile_to_ptx(sources, arch=90, num_warps=params.num_warps, num_stages=params.num_stages)
    for ks, ptx in zip(sources, ptxs, strict=True):
        assert f".entry {ks.name}" in ptx and ".target sm_90" in ptx
