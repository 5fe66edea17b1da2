"""The hand-written bound kernels of benchmarks/attn_ceiling.py compute what they claim (interpreter, fp32)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from bench_scripts import BENCH, load_bench


@pytest.fixture(scope="module")
def C():
    sys.path.insert(0, str(BENCH))
    try:
        yield load_bench("attn_ceiling")
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("splits,keys,mask", [(4, 32, 0), (2, 64, 1), (8, 32, 1)])
def test_partials_kernel_combines_to_attention(C, splits, keys, mask):
    kv, h, g, d = 256, 2, 4, 128
    gen = torch.Generator().manual_seed(splits + keys)
    q, k, v = torch.randn(h * g, d, generator=gen), torch.randn(h, kv, d, generator=gen), torch.randn(h, kv, d, generator=gen)
    n = kv - 5 if mask else kv
    m, ls, o = torch.full((splits, h, g, 1), float("nan")), torch.full((splits, h, g, 1), float("nan")), torch.full((splits, h, g, d), float("nan"))
    C._attn[(h, splits)](q, k, v, m, ls, o, n, 1 / math.sqrt(d), KV=kv, PER=kv // splits, T=keys, D=d, G=g, GP=16, STAGES=2, MASK=mask)
    sc = q.double().view(h, g, d) @ k.double()[:, :n].transpose(1, 2) / math.sqrt(d)
    ref = sc.softmax(-1) @ v.double()[:, :n]
    out = C.G.combine64(m, ls, o).reshape(ref.shape)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("splits,keys,mask,exp2", [(4, 64, 0, 0), (2, 64, 1, 1), (2, 128, 0, 1)])
def test_swapped_partials_kernel_combines_to_attention(C, splits, keys, mask, exp2):
    kv, h, g, d = 256, 2, 4, 128
    gen = torch.Generator().manual_seed(splits + keys + exp2)
    q, k, v = torch.randn(h * g, d, generator=gen), torch.randn(h, kv, d, generator=gen), torch.randn(h, kv, d, generator=gen)
    n = kv - 5 if mask else kv
    m, ls, o = torch.full((splits, h, g, 1), float("nan")), torch.full((splits, h, g, 1), float("nan")), torch.full((splits, h, g, d), float("nan"))
    C._attn_t[(h, splits)](q, k, v, m, ls, o, n, 1 / math.sqrt(d), KV=kv, PER=kv // splits, T=keys, D=d, G=g, GP=16, STAGES=2, MASK=mask, EXP2=exp2)
    sc = q.double().view(h, g, d) @ k.double()[:, :n].transpose(1, 2) / math.sqrt(d)
    ref = sc.softmax(-1) @ v.double()[:, :n]
    out = C.G.combine64(m, ls, o).reshape(ref.shape)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_read_kernel_sums_every_element(C):
    kv, h, d, s = 256, 2, 128, 4
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(h, kv, d, generator=gen), torch.randn(h, kv, d, generator=gen)
    out = torch.empty(h * s)
    C._read[(h, s)](k, v, out, KV=kv, PER=kv // s, T=32, D=d, STAGES=2)
    ref = k.double().view(h, s, -1).sum(-1) + v.double().view(h, s, -1).sum(-1)
    assert torch.allclose(out.double(), ref.flatten(), rtol=1e-4, atol=1e-3)
