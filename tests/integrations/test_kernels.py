"""KernelProvider and CachedKernel: stored codegen parameters."""

from __future__ import annotations

import logging

import pytest
import torch
from handwritten import fused_rmsnorm_linear

from mirage_serve.cache import KernelCache
from mirage_serve.integrations.kernels import KernelProvider
from mirage_serve.reference import execute, random_inputs

pytest.importorskip("mirage_serve.verify")
from cached_kernels import put_verified  # noqa: E402 (needs the verifier)

CPU = torch.device("cpu")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _spy_compile(monkeypatch) -> list[tuple]:
    import mirage_serve.codegen as codegen

    seen: list[tuple] = []
    real = codegen.compile_graph

    def spy(graph, params=None, variable_dims=()):
        seen.append((params, tuple(variable_dims)))
        return real(graph, params, variable_dims)

    monkeypatch.setattr(codegen, "compile_graph", spy)
    return seen


def test_stored_codegen_params_reach_compile_graph(tmp_path, monkeypatch, caplog):
    from mirage_serve.codegen import CodegenParams
    from mirage_serve.integrations import kernels

    monkeypatch.setenv("MIRAGE_SERVE_CPU_BACKEND", "triton")
    monkeypatch.setattr(kernels, "_logged", set())
    seen = _spy_compile(monkeypatch)
    cache = KernelCache(tmp_path / "cache")
    tuned = CodegenParams(num_warps=2, matmul="fma").cache_params()
    for out, params in ((32, tuned), (48, None), (64, {"num_warps": 3})):  # tuned, unprofiled, not usable by this codegen
        put_verified(cache, "rmsnorm_linear", {"batch": 4, "hidden": 64, "out": out},
                     fused_rmsnorm_linear(4, 64, out, n_blocks=2, loop=4), {"eps": 1e-6}, params=params)
    provider = KernelProvider(cache, buckets=(4,))
    compiled = []
    with caplog.at_level(logging.WARNING, logger="mirage_serve"):
        for out in (32, 48, 64):
            kernel = provider.get("rmsnorm_linear", {"hidden": 64, "out": out}, "float32", {"eps": 1e-6}, 3, CPU)
            ins = random_inputs(kernel.spec, torch.Generator().manual_seed(out))
            ins[0] = ins[0][:3].contiguous()
            (y,) = kernel(ins)
            want = execute(kernel.spec, [torch.cat([ins[0], ins[0].new_zeros(1, 64)]), *ins[1:]])[0][:3]
            assert _rel(y, want) <= 1e-5
            compiled.append(kernel._compiled.params)
    assert seen == [(CodegenParams(num_warps=2, matmul="fma"), ()), (None, ()), (None, ())]
    assert compiled == [CodegenParams(num_warps=2, matmul="fma"), CodegenParams(), CodegenParams()]
    assert sum("this build cannot use" in r.getMessage() for r in caplog.records) == 1
