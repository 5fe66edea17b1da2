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
