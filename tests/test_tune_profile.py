"""Timing and float-check helpers of mirage_serve.tune; the GPU parts run only where CUDA is."""

from __future__ import annotations

import math

import pytest
import torch
from handwritten import fused_rmsnorm_linear

from mirage_serve.tune import rank_candidates
from mirage_serve.tune.profile import check_outputs, random_device_inputs
from mirage_serve.tune.timing import relative_error, sets_for, time_calls, tolerance_for

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_relative_error_is_a_norm_ratio_and_rejects_nan_and_shape_mismatch():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert relative_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.5 / 5.0)
    assert relative_error(torch.tensor([3.0, float("nan")]), ref) == math.inf
    assert relative_error(torch.tensor([3.0, 4.0, 0.0]), ref) == math.inf
    err, tol = check_outputs([torch.tensor([3.0, 4.0], dtype=torch.bfloat16)], [ref], torch.bfloat16)
    assert err == 0.0 and tol == tolerance_for(torch.bfloat16) == 2e-2


def test_enough_input_sets_to_spill_the_l2():
    l2 = 60 * 2**20
    assert sets_for(50 * 2**20, l2) == 4  # QKV weights: 4 sets x 50 MB >= 3 x 60 MB
    assert sets_for(300 * 2**20, l2) == 2  # never fewer than 2
    assert sets_for(1000, l2) == 64  # never more than 64
    for b in (2**20, 7 * 2**20, 33 * 2**20):
        n = sets_for(b, l2)
        assert n * b >= 3 * l2 or n == 64


def test_random_inputs_follow_the_graph_and_differ_per_draw():
    g = fused_rmsnorm_linear(2, 64, 32, 4, 2, dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    a, b = random_device_inputs(g, "cpu", gen), random_device_inputs(g, "cpu", gen)
    assert [tuple(t.shape) for t in a] == [(2, 64), (64,), (32, 64)]
    assert all(t.dtype == torch.bfloat16 for t in a)
    assert not torch.equal(a[2], b[2]) and a[2].abs().sum() > 0


def test_rank_candidates_picks_the_model_on_a_cpu_only_machine():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: device=None would profile")
    ranked = rank_candidates([fused_rmsnorm_linear(1, 4096, 6144, nb, 8, dtype="bfloat16") for nb in (96, 768)])
    assert [r.profiled for r in ranked] == [False, False]
    assert ranked[0].graph.customized_ops[0].block.grid == (768,)


@cuda
def test_time_calls_measures_a_copy_near_its_bandwidth():
    src = [torch.randn(2**26, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    dst = [torch.empty_like(s) for s in src]
    t = time_calls(lambda d, s: d.copy_(s), list(zip(dst, src)), reps=20)
    gbps = 2 * src[0].numel() * 2 / (t.median_us * 1e-6) / 1e9
    assert t.sets == 2 and t.cuda_graph and t.p20_us <= t.median_us <= t.p80_us
    assert 500 < gbps < 10000
