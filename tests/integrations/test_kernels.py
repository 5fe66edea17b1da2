"""KernelProvider and CachedKernel: kv_len buckets, variable KV lengths, stored codegen parameters."""

from __future__ import annotations

import logging

import pytest
import torch
from handwritten import fused_rmsnorm_linear, split_kv_attention
from tiny_models import tiny_model

from mirage_serve.cache import KernelCache
from mirage_serve.integrations.kernels import KernelProvider
from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec

pytest.importorskip("mirage_serve.verify")
from cached_kernels import fill_cache, put_verified  # noqa: E402 (needs the verifier)

ATT = {"q_heads": 4, "kv_heads": 2, "head_dim": 16}
CPU = torch.device("cpu")


def _attention_cache(tmp_path, kv_lens=(8, 32), batch=2, params=None) -> KernelCache:
    cache = KernelCache(tmp_path / "cache")
    for kv in kv_lens:
        dims = {"batch": batch, **ATT, "kv_len": kv}
        put_verified(cache, "attention_decode", dims, split_kv_attention(**dims, splits=2, loop=2), params=params)
    return cache


def _qkv(rows: int, kv_len: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    group, d = ATT["q_heads"] // ATT["kv_heads"], ATT["head_dim"]
    return [torch.randn(rows, group, d, generator=g), torch.randn(rows, kv_len, d, generator=g), torch.randn(rows, kv_len, d, generator=g)]


def _spec_out(batch: int, kv_len: int, ins: list[torch.Tensor]) -> torch.Tensor:
    return execute(build_spec("attention_decode", {"batch": batch, **ATT, "kv_len": kv_len}, "float32"), ins)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_attention_lookup_by_the_smallest_kv_bucket(tmp_path):
    provider = KernelProvider(_attention_cache(tmp_path), buckets=(1, 2, 4), kv_buckets=(8, 32))
    k8 = provider.get("attention_decode", {**ATT, "kv_len": 5}, "float32", {}, 2, CPU)
    assert k8 is not None and k8.dims["kv_len"] == 8
    assert provider.get("attention_decode", {**ATT, "kv_len": 8}, "float32", {}, 2, CPU) is k8
    k32 = provider.get("attention_decode", {**ATT, "kv_len": 9}, "float32", {}, 1, CPU)
    assert k32 is not None and k32.dims["kv_len"] == 32 and k32.bucket == 2  # batch bucket 2 serves one row too
    assert provider.get("attention_decode", {**ATT, "kv_len": 33}, "float32", {}, 2, CPU) is None
    (why,) = provider.misses.values()
    assert "beyond the largest kv_len bucket 32" in why
    assert len(provider.kernels()) == 2


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_one_kernel_serves_every_kv_length_up_to_its_bucket(backend, tmp_path, monkeypatch):
    """Reference: the spec at the real length (exact); Triton (the interpreter here): the μGraph with masked KV."""
    monkeypatch.setenv("MIRAGE_SERVE_CPU_BACKEND", backend)
    provider = KernelProvider(_attention_cache(tmp_path, kv_lens=(32,)), buckets=(2,), kv_buckets=(32,))
    kernel = provider.get("attention_decode", {**ATT, "kv_len": 1}, "float32", {}, 2, CPU)  # rows: the batch
    assert kernel is not None and kernel.backend == backend
    for rows, n in ((4, 32), (4, 17), (2, 5), (4, 1)):  # rows = batch * kv_heads: batch 2 and 1
        ins = _qkv(rows, n, seed=n)
        (out,) = kernel(ins)
        assert out.shape == (rows, 2, 16)
        assert _rel(out, _spec_out(rows // 2, n, ins)) <= 1e-5, (rows, n)
    # a static cache: all 32 positions passed, the first 20 valid
    ins = _qkv(4, 32, seed=7)
    (out,) = kernel(ins, torch.tensor([20], dtype=torch.int32))
    assert _rel(out, _spec_out(2, 20, [ins[0], ins[1][:, :20], ins[2][:, :20]])) <= 1e-5
    assert kernel.calls == 5 and kernel.disabled is None
    assert kernel.calls_by_length == {32: 1, 17: 1, 5: 1, 1: 1}


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
    with caplog.at_level(logging.WARNING, logger="mirage_serve"):
        for out in (32, 48, 64):
            kernel = provider.get("rmsnorm_linear", {"hidden": 64, "out": out}, "float32", {"eps": 1e-6}, 3, CPU)
            ins = random_inputs(kernel.spec, torch.Generator().manual_seed(out))
            ins[0] = ins[0][:3].contiguous()
            (y,) = kernel(ins)
            want = execute(kernel.spec, [torch.cat([ins[0], ins[0].new_zeros(1, 64)]), *ins[1:]])[0][:3]
            assert _rel(y, want) <= 1e-5
    assert seen == [(CodegenParams(num_warps=2, matmul="fma"), ()), (None, ()), (None, ())]
    assert [k._compiled.params for k in provider.kernels()] == [CodegenParams(num_warps=2, matmul="fma"), CodegenParams(), CodegenParams()]
    assert sum("this build cannot use" in r.getMessage() for r in caplog.records) == 1

    # decode attention: the entry's parameters and the variable KV dims together
    seen.clear()
    provider = KernelProvider(_attention_cache(tmp_path / "att", kv_lens=(16,), params={"num_warps": 1}), buckets=(2,), kv_buckets=(16,))
    kernel = provider.get("attention_decode", {**ATT, "kv_len": 9}, "float32", {}, 2, CPU)
    ins = _qkv(4, 9)
    assert _rel(kernel(ins)[0], _spec_out(2, 9, ins)) <= 1e-5
    assert seen == [(CodegenParams(num_warps=1), ((1, 1), (2, 1)))]


def test_patched_model_runs_the_generated_attention_kernel(tmp_path, monkeypatch):
    """The Triton interpreter runs the cached μGraph itself at every decode length, batch 1 in a batch-2 bucket,
    under transformers' generate (real lengths) and the static decoder (whole cache, length as a tensor)."""
    from mirage_serve.integrations.decode import generate
    from mirage_serve.integrations.hf import patch_model

    monkeypatch.setenv("MIRAGE_SERVE_CPU_BACKEND", "triton")
    model, _ = tiny_model("llama", tmp_path)
    ids = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(6))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    cache = KernelCache(tmp_path / "cache")
    fill_cache(cache, model, norms=False, kv_lens=(16,))
    report = patch_model(model, cache, kv_buckets=(16,))
    got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    assert _rel(torch.stack(got.logits), torch.stack(ref.logits)) <= 1e-4
    assert torch.equal(generate(model, ids, 8), ref.sequences)
    (kernel,) = report.provider.kernels()
    assert kernel.backend == "triton" and kernel._compiled is not None and kernel.disabled is None
    assert kernel.calls_by_length == {n: 2 for n in range(5, 12)}
    assert kernel.calls == 2 * 7 * 2  # both layers, 7 decode steps, both decoders
