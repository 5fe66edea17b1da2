"""Patched vs unpatched tiny models of every architecture: same logits, same greedy tokens."""

import logging

import pytest
import torch
from handwritten import fused_rmsnorm_linear, split_kv_attention
from tiny_models import ARCHS, tiny_model

from mirage_serve.cache import CacheEntry, CacheKey, KernelCache
from mirage_serve.integrations.hf import FusedNormLinear, patch_model
from mirage_serve.models import AdapterError, get_adapter
from mirage_serve.specs import build_spec

verify = pytest.importorskip("mirage_serve.verify")
if not hasattr(verify, "verify_equivalent"):
    pytest.skip("the verifier is not built", allow_module_level=True)

BUCKETS = (1, 2, 4, 8, 16)


def _put(cache: KernelCache, spec_name: str, dims: dict, graph, options: dict) -> None:
    spec = build_spec(spec_name, dims, graph.info[graph.input_ids[0]].dtype, **options)
    cert = verify.verify_equivalent(graph, spec, trials=2, seed=0)
    assert cert.verdict == "equivalent", cert.reason
    cache.put(CacheEntry.create(CacheKey(spec_name, dims, spec.info[spec.input_ids[0]].dtype, options=options), graph, certificate=cert))


def fill_cache(cache: KernelCache, model, dtype: str = "float32") -> None:
    """Verified fused μGraphs for every norm→linear and decode-attention shape the tiny model meets."""
    adapter = get_adapter(model.config.model_type)
    plan = adapter.plan(model.config, BUCKETS, dtype=dtype, kv_lens=())
    done = set()
    for sg in plan.subgraphs:
        if sg.spec_name != "rmsnorm_linear" or sg.signature() in done:
            continue
        done.add(sg.signature())
        d = sg.dims
        g = fused_rmsnorm_linear(d["batch"], d["hidden"], d["out"], n_blocks=2, loop=4, eps=sg.options["eps"], dtype=dtype)
        _put(cache, "rmsnorm_linear", d, g, sg.options)
    arch = plan.arch
    for b in (2,):
        for kv_len in (8, 12):
            dims = {"batch": b, "q_heads": arch.q_heads, "kv_heads": arch.kv_heads, "head_dim": arch.head_dim, "kv_len": kv_len}
            _put(cache, "attention_decode", dims, split_kv_attention(**dims, splits=2, loop=2, dtype=dtype), {})


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_patched_model_matches_unpatched(arch, tmp_path, caplog):
    model, _ = tiny_model(arch, tmp_path)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref_logits = model(ids).logits
    ref_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    cache = KernelCache(tmp_path / "cache")
    fill_cache(cache, model)
    n_params = sum(p.numel() for p in model.parameters())
    with caplog.at_level(logging.INFO, logger="mirage_serve"):
        report = patch_model(model, cache)
    roles = {r.role for r in report.patched}
    assert {"attn_norm_qkv", "mlp_norm_gate_up"} <= roles, str(report)
    assert sum(p.numel() for p in model.parameters()) == n_params  # concatenated once, not kept twice
    with torch.no_grad():
        logits = model(ids).logits
    assert float((logits - ref_logits).norm() / ref_logits.norm()) <= 1e-4
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref_tokens)
    calls = report.kernel_calls()
    assert sum(n for e, n in calls.items() if e.startswith("rmsnorm_linear")) >= 2 * 2 * 32  # every layer, both norms, each step
    assert sum(n for e, n in calls.items() if e.startswith("attention_decode")) > 0  # the kv_len 8 and 12 steps
    assert any(k.startswith("attention_decode") for k in report.misses)  # other kv_len values fall back (logged once per process)
    assert isinstance(model.get_submodule(get_adapter(arch).layer(0) + "." + get_adapter(arch).input_norm), FusedNormLinear)


def test_patch_model_bf16_within_tolerance(tmp_path):
    model, _ = tiny_model("llama", tmp_path, dtype=torch.bfloat16)
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits.float()
    cache = KernelCache(tmp_path / "cache")
    fill_cache(cache, model, dtype="bfloat16")
    report = patch_model(model, cache)
    with torch.no_grad():
        got = model(ids).logits.float()
    assert float((got - ref).norm() / ref.norm()) < 3e-2
    assert sum(report.kernel_calls().values()) > 0


def test_failing_kernel_is_disabled_not_fatal(tmp_path, caplog, monkeypatch):
    model, _ = tiny_model("llama", tmp_path)
    ids = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(ids).logits
    cache = KernelCache(tmp_path / "cache")
    fill_cache(cache, model)
    report = patch_model(model, cache)
    from mirage_serve.integrations import kernels

    def boom(self, inputs):
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(kernels.CachedKernel, "_run", boom)
    with caplog.at_level(logging.WARNING, logger="mirage_serve"):
        with torch.no_grad():
            got = model(ids).logits
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    disabled = [k.disabled for k in report.provider._memo.values() if k is not None and k.disabled]
    assert disabled and all("simulated launch failure" in d for d in disabled)
    assert sum(report.kernel_calls().values()) == 0


def test_spot_check_disables_a_wrong_kernel(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("MIRAGE_SERVE_CHECK", "1")
    model, _ = tiny_model("llama", tmp_path)
    ids = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids).logits
    cache = KernelCache(tmp_path / "cache")
    fill_cache(cache, model)
    report = patch_model(model, cache)
    from mirage_serve.integrations import kernels

    real = kernels.CachedKernel._run
    monkeypatch.setattr(kernels.CachedKernel, "_run", lambda self, inputs: [o * 1.01 for o in real(self, inputs)])
    with caplog.at_level(logging.WARNING, logger="mirage_serve"):
        with torch.no_grad():
            got = model(ids).logits
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    disabled = [k.disabled for k in report.provider._memo.values() if k is not None and k.disabled]
    assert disabled and all("spot check" in d for d in disabled)  # warned once per entry and process (log_once)


def test_unknown_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(AdapterError, match="supported architectures"):
        patch_model(model, tmp_path / "cache")
