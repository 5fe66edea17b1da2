"""Reference-executor and shape-rule fixes found by the fuzzer and the issue: block-level
operators on tiles of different ranks whose grid dims differ (matmul with a rank-2 b
under a batched a, rms_norm with a lower-rank weight, concat), each against torch on
whole tensors; rms_norm weights that would enlarge x are refused."""

from __future__ import annotations

import pytest
import torch

from mirage_serve.mugraph import BlockBuilder, GraphBuilder, MuGraphError
from mirage_serve.reference import execute
from mirage_serve.verify import field_check


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_block_matmul_of_a_batched_tile_with_a_shared_rank2_tile():
    # a: [B, M, K] split over B by grid dim 0; b: [N, K] (trans_b) split over N by grid dim 1, so the
    # two tiles vary over different grid dims and b's tile must broadcast over a's batch dim only
    g = GraphBuilder()
    a, b = g.input("A", (4, 3, 8)), g.input("B", (6, 8))
    blk = BlockBuilder((2, 2), 2)
    ta, tb = blk.input(0, (0, -1), 2), blk.input(1, (-1, 0), 1)
    blk.output(blk.accum("sum", blk.matmul(ta, tb, trans_b=True)), (0, 2))
    (y,) = g.customized([a, b], blk.build())
    graph = g.build([y])
    A, B = _x(4, 3, 8), _x(6, 8, seed=1)
    (out,) = execute(graph, [A, B])
    assert out.shape == (4, 3, 6)
    assert torch.allclose(out, A @ B.T, atol=1e-12)
    spec = GraphBuilder()
    sa, sb = spec.input("A", (4, 3, 8)), spec.input("B", (6, 8))
    assert field_check(graph, spec.build([spec.matmul(sa, sb, trans_b=True)])).verdict == "equivalent"  # the field algebra too


def test_block_rms_norm_with_a_lower_rank_weight_split_over_the_grid():
    # x: [4, 8] split over its last dim by the grid, weight [8] split the same way: per-block RMS of 4 columns
    g = GraphBuilder()
    x, w = g.input("X", (4, 8)), g.input("W", (8,))
    blk = BlockBuilder((2,), 1)
    blk.output(blk.op("rms_norm", blk.input(0, (1,)), blk.input(1, (0,)), eps=1e-6), (1,))
    (y,) = g.customized([x, w], blk.build())
    X, W = _x(4, 8), _x(8, seed=1)
    (out,) = execute(g.build([y]), [X, W])
    halves = [torch.nn.functional.rms_norm(X[:, s], (4,), W[s], 1e-6) for s in (slice(0, 4), slice(4, 8))]
    assert torch.allclose(out, torch.cat(halves, 1), atol=1e-12)


def test_block_concat_of_tiles_varying_over_different_grid_dims():
    g = GraphBuilder()
    x, z = g.input("X", (4, 8)), g.input("Z", (1, 8))
    blk = BlockBuilder((2,), 1)
    blk.output(blk.op("concat", blk.input(0, (0,)), blk.input(1, (-1,)), dim=0), (-1,))  # Z is the same for both blocks
    (y,) = g.customized([x, z], blk.build())
    X, Z = _x(4, 8), _x(1, 8, seed=1)
    (out,) = execute(g.build([y]), [X, Z])
    assert out.shape == (2, 3, 8)
    assert torch.equal(out[0], torch.cat([X[:2], Z])) and torch.equal(out[1], torch.cat([X[2:], Z]))


def test_rms_norm_weight_must_broadcast_to_x():
    g = GraphBuilder()
    x, w = g.input("X", (1, 8)), g.input("W", (4, 8))
    with pytest.raises(MuGraphError, match=r"weight\[4, 8\] would broadcast x\[1, 8\] to \[4, 8\]"):
        g.build([g.rms_norm(x, w)])
    g = GraphBuilder()
    x, w = g.input("X", (4, 8)), g.input("W", (1, 8))  # a weight that broadcasts to x is fine
    (out,) = execute(g.build([g.rms_norm(x, w, 1e-6)]), [_x(4, 8), _x(1, 8, seed=1)])
    assert out.shape == (4, 8)


def test_rescaled_accumulator_refuses_a_max_that_would_enlarge_its_tile():
    # found by the fuzzer: rescaled_sum(y [1, 1], m [2, 1]) validates with y's shape, and the reference
    # crashes storing the [2, 1] value it computes
    g = GraphBuilder()
    x, y = g.input("X", (2, 8)), g.input("Y", (1, 1))
    blk = BlockBuilder((1,), 2)
    tx, ty = blk.input(0, (-1,), 1), blk.input(1, (-1,), -1)
    m = blk.accum("max_last", tx)
    blk.output(blk.accum("rescaled_sum", ty, m), (-1,))
    g.customized([x, y], blk.build())
    with pytest.raises(MuGraphError, match="running max"):
        g.build([2])


def test_rescaled_accumulator_with_a_max_of_higher_rank_runs():
    # the max may carry leading 1s: rescaled_sum_last(B [4] chunks, m [1, 1]) is a rank-1 accumulation
    g = GraphBuilder()
    a, bv = g.input("A", (1, 8)), g.input("B", (8,))
    blk = BlockBuilder((1,), 2)
    ta, tb = blk.input(0, (-1,), 1), blk.input(1, (-1,), 0)
    m = blk.accum("max_last", ta)
    blk.output(blk.accum("rescaled_sum_last", tb, m), (-1,))
    (y,) = g.customized([a, bv], blk.build())
    A, B = _x(1, 8), _x(8, seed=1)
    (out,) = execute(g.build([y]), [A, B])
    m1, m2 = A[0, :4].max(), A[0].max()
    want = B[:4].sum() * torch.exp(m1 - m2) + B[4:].sum()
    assert out.shape == (1,) and torch.allclose(out[0], want, atol=1e-12)


def test_rescaled_accumulator_with_a_max_of_lower_rank_over_a_grid():
    # found by the fuzzer: the rescale factor exp(m_prev - m) of a rank-1 max broadcast against the rank-2
    # accumulator across the grid dims (crash, or a wrong shape)
    g = GraphBuilder()
    x = g.input("X", (8, 3))
    blk = BlockBuilder((4,), 2)
    tx = blk.input(0, (0,), 0)  # [1, 3] per iteration
    m = blk.accum("max_last", blk.reduce("max", tx, 1, keepdim=False))  # [1]
    blk.output(blk.accum("rescaled_sum_last", tx, m), (0,))
    (y,) = g.customized([x], blk.build())
    X = _x(8, 3)
    (out,) = execute(g.build([y]), [X])
    want = []
    for b in range(4):
        rows = X[2 * b : 2 * b + 2]
        m1, m2 = rows[0].max(), rows.max()
        want.append(rows[0].sum() * torch.exp(m1 - m2) + rows[1].sum())
    assert out.shape == (4, 1) and torch.allclose(out[:, 0], torch.stack(want), atol=1e-12)
