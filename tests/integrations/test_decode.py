import pytest
import torch
from tiny_models import tiny_model

from mirage_serve.integrations.decode import UnsupportedModel, generate
from mirage_serve.integrations.hf import patch_model


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_static_decode_matches_transformers_greedy(arch, tmp_path):
    model, _ = tiny_model(arch, tmp_path)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, pad_token_id=0)
    got, stats = generate(model, ids, 32, return_stats=True)
    assert torch.equal(got, want)
    assert stats.new_tokens == 32 and not stats.cuda_graph
    patch_model(model, tmp_path / "empty-cache")
    assert torch.equal(generate(model, ids, 32), want)


def test_static_decode_refuses_unknown_layouts(tmp_path):
    model, _ = tiny_model("phi3", tmp_path)
    with pytest.raises(UnsupportedModel, match="model.generate"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 0)


def test_static_decode_runs_the_attention_kernel_of_the_kv_bucket(tmp_path):
    """The whole static cache goes to the kernel of build-cache's kv_len bucket (the tiny context: 128), the valid
    length as a tensor: one kernel serves every step, and the tokens are those of the unpatched model."""
    pytest.importorskip("mirage_serve.verify")
    from cached_kernels import fill_cache

    from mirage_serve.cache import KernelCache

    model, _ = tiny_model("llama", tmp_path)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, pad_token_id=0)
    cache = KernelCache(tmp_path / "cache")
    assert fill_cache(cache, model, norms=False) == [128]
    report = patch_model(model, cache)
    assert torch.equal(generate(model, ids, 32), want)
    (calls,) = report.kernel_calls().values()
    assert calls == 2 * 31  # both layers, every decode step (the prompt runs SDPA)
    assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, pad_token_id=0), want)
    (by_len,) = report.kernel_lengths().values()
    assert sorted(by_len) == list(range(7, 38))  # transformers' cache: the real length, 7..37, through the same kernel


def test_teacher_forced_decode_scores_a_given_continuation(tmp_path):
    """forced_tokens: every position sees the given context, so the choices and logits are those of one
    full forward over prompt + continuation; forcing the model's own greedy tokens reproduces them."""
    model, _ = tiny_model("llama", tmp_path)
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    free, free_logits = generate(model, ids, 12, return_logits=True)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    want = model.generate(ids, **kw)
    assert torch.equal(free, want.sequences)
    assert torch.allclose(free_logits, torch.stack(want.logits, 1), rtol=1e-4, atol=1e-5)
    same, same_logits = generate(model, ids, 12, forced_tokens=free[:, 5:], return_logits=True)
    assert torch.equal(same, free) and torch.allclose(same_logits, free_logits, rtol=1e-5, atol=1e-6)
    other = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    got, got_logits = generate(model, ids, 12, forced_tokens=other, return_logits=True)
    with torch.no_grad():
        full = model(torch.cat([ids, other], 1)).logits[:, 4:-1]  # logits predicting new token i
    assert torch.allclose(got_logits, full, rtol=1e-4, atol=1e-5)
    assert torch.equal(got[:, 5:], full.argmax(-1))
    assert not torch.equal(got, free)
    with pytest.raises(ValueError, match="forced_tokens"):
        generate(model, ids, 12, forced_tokens=other[:, :3])
