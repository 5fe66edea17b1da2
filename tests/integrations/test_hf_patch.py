"""Patched vs unpatched tiny models of every architecture: same logits, same greedy tokens."""

import logging

import pytest
import torch
from tiny_models import ARCHS, tiny_model

from mirage_serve.cache import KernelCache
from mirage_serve.integrations.hf import FusedNormLinear, patch_model
from mirage_serve.models import AdapterError, get_adapter

verify = pytest.importorskip("mirage_serve.verify")
if not hasattr(verify, "verify_equivalent"):
    pytest.skip("the verifier is not built", allow_module_level=True)

from cached_kernels import fill_cache  # noqa: E402 (needs the verifier)

KV_LENS = (8, 16, 32)  # prompt 6 + 32 new tokens: decode lengths 7..37, the last five beyond the largest bucket


def _generate(model, ids):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_patched_model_matches_unpatched(arch, tmp_path, caplog, monkeypatch):
    from mirage_serve.integrations import kernels

    monkeypatch.setattr(kernels, "_logged", set())  # "logged once per process": count this model's messages
    model, _ = tiny_model(arch, tmp_path)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref_logits = model(ids).logits
    ref_tokens, ref_step_logits = _generate(model, ids)
    cache = KernelCache(tmp_path / "cache")
    assert fill_cache(cache, model, kv_lens=KV_LENS) == list(KV_LENS)
    n_params = sum(p.numel() for p in model.parameters())
    with caplog.at_level(logging.INFO, logger="mirage_serve"):
        report = patch_model(model, cache, kv_buckets=KV_LENS)
        roles = {r.role for r in report.patched}
        assert {"attn_norm_qkv", "mlp_norm_gate_up", "attention_decode"} <= roles, str(report)
        assert sum(p.numel() for p in model.parameters()) == n_params  # concatenated once, not kept twice
        with torch.no_grad():
            logits = model(ids).logits
        assert float((logits - ref_logits).norm() / ref_logits.norm()) <= 1e-4
        tokens, step_logits = _generate(model, ids)
    assert torch.equal(tokens, ref_tokens)
    assert float((step_logits - ref_step_logits).norm() / ref_step_logits.norm()) <= 1e-4  # every decode step, attention included
    calls = report.kernel_calls()
    assert sum(n for e, n in calls.items() if e.startswith("rmsnorm_linear")) >= 2 * 2 * 32  # every layer, both norms, each step
    # one kernel per kv_len bucket serves every decode length up to it (both layers, each step)
    served = sorted((max(by_len), sorted(by_len.items())) for by_len in report.kernel_lengths().values())
    assert served == [(8, [(7, 2), (8, 2)]), (16, [(n, 2) for n in range(9, 17)]), (32, [(n, 2) for n in range(17, 33)])]
    beyond = [r.getMessage() for r in caplog.records if "beyond the largest kv_len bucket 32" in r.getMessage()]
    assert len(beyond) == 1  # lengths 33..37 fall back to the model's code, logged once
    assert any(k.startswith("attention_decode") and "beyond the largest kv_len bucket 32" in v for k, v in report.misses.items())
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
    disabled = [k.disabled for k in report.provider.kernels() if k.disabled]
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
    disabled = [k.disabled for k in report.provider.kernels() if k.disabled]
    assert disabled and all("spot check" in d for d in disabled)  # warned once per entry and process (log_once)


def test_unknown_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(AdapterError, match="supported architectures"):
        patch_model(model, tmp_path / "cache")


def test_patched_lora_model_matches_unpatched(tmp_path, monkeypatch):
    """A peft LoRA adapter (random A and B, saved and reloaded offline) on a tiny Llama: the adapted q/v
    projections run lora_linear, the MLP norm and gate/up their fused kernel, decode attention its kernel;
    logits and 32 greedy tokens equal the unpatched adapted model's."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, path = tiny_model("llama", tmp_path)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(7)
    peft.get_peft_model(model, config).save_pretrained(tmp_path / "adapter")  # init_lora_weights=False: B is random, not 0
    base = AutoModelForCausalLM.from_pretrained(path)
    lora = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref_logits = lora(ids).logits
        with lora.disable_adapter():
            plain = lora(ids).logits
    assert float((plain - ref_logits).norm() / ref_logits.norm()) > 1e-2  # the adapter changes the model
    ref_tokens, ref_step_logits = _generate(lora, ids)
    cache = KernelCache(tmp_path / "cache")
    fill_cache(cache, base, kv_lens=(64,), lora=tmp_path / "adapter")
    report = patch_model(lora, cache, kv_buckets=(64,))
    by_role = {}
    for r in report.records:
        by_role.setdefault((r.role, r.patched), []).append(r)
    assert len(by_role[("lora_linear", True)]) == 4  # q and v of both layers
    assert len(by_role[("mlp_norm_gate_up", True)]) == 2 and len(by_role[("attention_decode", True)]) == 1
    skipped = by_role[("attn_norm_qkv", False)]  # q/v are LoRA wrappers: that fusion is refused, with the reason
    assert len(skipped) == 2 and all("LoRA wrapper" in r.reason for r in skipped)
    with torch.no_grad():
        logits = lora(ids).logits
    assert float((logits - ref_logits).norm() / ref_logits.norm()) <= 1e-4
    tokens, step_logits = _generate(lora, ids)
    assert torch.equal(tokens, ref_tokens)
    assert float((step_logits - ref_step_logits).norm() / ref_step_logits.norm()) <= 1e-4
    calls = report.kernel_calls()
    for spec, least in (("lora_linear", 4 * 32), ("rmsnorm_linear", 2 * 32), ("attention_decode", 2 * 31)):
        assert sum(n for e, n in calls.items() if e.startswith(spec)) >= least, (spec, calls)
