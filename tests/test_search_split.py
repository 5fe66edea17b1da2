"""Splitting a spec at an output the other outputs are computed from."""

from __future__ import annotations

import pytest

from mirage_serve.mugraph import GraphBuilder
from mirage_serve.search.config import SearchConfig
from mirage_serve.search.driver import superoptimize
from mirage_serve.search.split import output_split, stitch
from mirage_serve.specs import build_spec
from mirage_serve.verify import verify_equivalent


def test_add_rmsnorm_linear_splits_at_the_residual_sum():
    spec = build_spec("add_rmsnorm_linear", {"batch": 2, "hidden": 64, "out": 32}, dtype="float32")
    split = output_split(spec)
    assert split is not None and split.output_index == 0
    assert [op.kind for op in split.head.ops] == ["input", "input", "binary"]
    assert [op.attr("name") for op in split.head.input_ops] == ["X", "R"]
    # the tail reads the sum first, then G and W: the rmsnorm_linear spec with the sum as its X
    assert [op.attr("name") for op in split.tail.input_ops] == ["out0", "G", "W"]
    assert [op.kind for op in split.tail.ops if op.kind != "input"] == ["rms_norm", "matmul"]
    assert split.tail.info[split.tail.outputs[0]].shape == (2, 32)
    # the plain head and tail stitch back into the spec itself
    joined = stitch(spec, split, split.head, split.tail)
    assert joined.ops == spec.ops and joined.outputs == spec.outputs


@pytest.mark.parametrize("name,dims", [
    ("rmsnorm_linear", {"batch": 2, "hidden": 64, "out": 32}),
    ("gated_mlp", {"batch": 2, "hidden": 64, "intermediate": 32}),
    ("attention_decode", {"batch": 1, "q_heads": 4, "kv_heads": 2, "head_dim": 16, "kv_len": 64}),
])
def test_specs_without_such_an_output_do_not_split(name, dims):
    assert output_split(build_spec(name, dims, dtype="float32")) is None


def test_independent_outputs_do_not_split():
    g = GraphBuilder()
    x, y = g.input("X", (4, 8)), g.input("Y", (4, 8))
    assert output_split(g.build([g.binary("add", x, y), g.binary("mul", x, y)])) is None


def test_a_tail_reading_the_heads_intermediates_does_not_split():
    g = GraphBuilder()
    x, y = g.input("X", (4, 8)), g.input("Y", (4, 8))
    s = g.binary("add", x, y)
    h = g.unary("exp", s)
    # the second output reads s, which only the head computes
    assert output_split(g.build([h, g.binary("mul", h, s)])) is None


def test_search_finds_the_residual_add_then_the_fused_norm_matmul():
    # the tail alone (the rmsnorm_linear spec over the sum) first verifies after ~37 s on 2 cores; it gets
    # half of what the budget leaves, 75 s
    spec = build_spec("add_rmsnorm_linear", {"batch": 2, "hidden": 64, "out": 32}, dtype="float32")
    cfg = SearchConfig(max_kernel_ops=2, max_grid_dims=1, max_block_inputs=3, time_budget_s=150, jobs=2, progress=False)
    res = superoptimize(spec, cfg)
    assert res.candidates, res.stats
    for c in res.candidates:  # every candidate, stitched or not, was verified against the whole spec
        assert c.certificate.verdict == "equivalent"
        assert verify_equivalent(c.graph, spec, trials=2, seed=7).verdict == "equivalent"
    fused = [c for c in res.candidates
             if [op.kind for op in c.graph.ops if op.kind != "input"] == ["binary", "customized"]]
    assert fused, [[op.kind for op in c.graph.ops] for c in res.candidates]
    block = fused[0].graph.ops[-1].block
    assert any(bi.forloop_dim >= 0 for bi in block.inputs)  # streams H, G and W along K
    assert {op.attr("fn") for op in block.ops if op.kind == "accum"} >= {"sum"}
    assert any(op.kind == "matmul" for op in block.ops)


def test_the_split_respects_the_kernel_operator_limit():
    # the residual add is a kernel operator of its own: with one allowed, no stitched graph fits
    spec = build_spec("add_rmsnorm_linear", {"batch": 2, "hidden": 64, "out": 32}, dtype="float32")
    cfg = SearchConfig(max_kernel_ops=1, max_grid_dims=1, max_block_inputs=3, time_budget_s=5, jobs=1, progress=False)
    for c in superoptimize(spec, cfg).candidates:
        assert sum(op.kind != "input" for op in c.graph.ops) <= 1
