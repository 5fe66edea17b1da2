"""On a GPU: compiled decode-attention kernels of a kv_len bucket, in transformers' generate and in the captured decode step."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a GPU and compiled kernels (TRITON_INTERPRET=0)")


def test_captured_decode_step_runs_the_attention_kernel(tmp_path):
    pytest.importorskip("mirage_serve.verify")
    from cached_kernels import fill_cache

    from mirage_serve.cache import KernelCache
    from mirage_serve.integrations.decode import generate
    from mirage_serve.integrations.hf import patch_model

    model, _ = tiny_model("llama", tmp_path)
    model = model.cuda()
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    unpatched = generate(model, ids, 32, cuda_graph=True)
    cache = KernelCache(tmp_path / "cache")
    assert fill_cache(cache, model, norms=False) == [128]
    report = patch_model(model, cache)
    assert torch.equal(model.generate(ids, **kw), want)
    (kernel,) = report.provider.kernels()
    assert kernel.backend == "triton" and kernel.disabled is None
    assert sorted(kernel.calls_by_length) == list(range(7, 38))
    calls = kernel.calls
    got, stats = generate(model, ids, 32, cuda_graph=True, return_stats=True)
    assert stats.cuda_graph and kernel.disabled is None
    assert kernel.calls > calls  # warm-up and capture went through the kernel; replays serve every position
    assert torch.equal(got, unpatched) and torch.equal(got, want)
