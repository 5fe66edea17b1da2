"""The search finds fused μGraphs on its own: no template of the answer is
given, only the spec. Small configurations run in CI; the issue's shapes run
with ``MIRAGE_SERVE_SLOW=1`` (minutes each on 2 cores)."""

from __future__ import annotations

import logging
import os

import pytest

from mirage_serve.search.config import SearchConfig
from mirage_serve.search.driver import superoptimize
from mirage_serve.specs import build_spec

log = logging.getLogger(__name__)

slow = pytest.mark.skipif(not os.environ.get("MIRAGE_SERVE_SLOW"), reason="minutes per spec on 2 cores; set MIRAGE_SERVE_SLOW=1")


def _fused_loop_kernel(graph, n_loop_matmuls: int):
    """The block graph of ``graph``'s single customized operator if it streams its
    inputs along a for-loop dim and accumulates ``n_loop_matmuls`` matmuls, else
    None (at tiny dims the cheapest instantiation may run the loop once)."""
    kernels = [op for op in graph.ops if op.kind != "input"]
    if len(kernels) != 1 or kernels[0].kind != "customized":
        return None
    block = kernels[0].block
    if not any(bi.forloop_dim >= 0 for bi in block.inputs):
        return None
    loop_matmuls = [op for op in block.ops if op.kind == "matmul"]
    accums = [op for op in block.ops if op.kind == "accum"]
    return block if len(loop_matmuls) >= n_loop_matmuls and accums else None


def test_pruning_cuts_the_candidates_by_a_large_factor():
    spec = build_spec("rmsnorm_linear", {"batch": 2, "hidden": 64, "out": 32}, dtype="float32")
    base = SearchConfig(max_kernel_ops=1, max_block_ops=3, max_grid_dims=1, time_budget_s=None, jobs=1, progress=False)
    on = superoptimize(spec, base)
    off = superoptimize(spec, base.replace(prune=False))
    assert on.stats.complete and off.stats.complete
    ratio = off.stats.enumerated / on.stats.enumerated
    log.info("rmsnorm_linear, 1 kernel, <=3 block ops: %d candidates with pruning, %d without (%.1fx); block nodes %d vs %d",
             on.stats.enumerated, off.stats.enumerated, ratio, on.stats.block_nodes, off.stats.block_nodes)
    assert ratio > 5
    # pruning is safe here: the same verified graphs either way
    assert {c.hash for c in on.candidates} == {c.hash for c in off.candidates}
    assert on.candidates and all(c.certificate.verdict == "equivalent" for c in on.candidates)


def test_gated_mlp_fuses_both_matmuls_into_one_loop():
    spec = build_spec("gated_mlp", {"batch": 2, "hidden": 64, "intermediate": 32}, dtype="float32")
    cfg = SearchConfig(max_kernel_ops=1, max_block_ops=6, max_grid_dims=1, max_block_inputs=3, time_budget_s=600, jobs=2,
                       progress=False)
    res = superoptimize(spec, cfg)
    log.info("gated_mlp: %s", res.stats)
    fused = [c for c in res.candidates if _fused_loop_kernel(c.graph, 2) is not None]
    assert fused, f"no fused candidate among {len(res.candidates)} ({res.stats})"
    block = _fused_loop_kernel(fused[0].graph, 2)
    # silu and the product run after the loop, on the two accumulated matmuls
    fns = [op.attr("fn") for op in block.ops]
    assert "silu" in fns and sum(op.kind == "accum" for op in block.ops) >= 2
    assert all(c.certificate.verdict == "equivalent" for c in res.candidates)


@slow
@pytest.mark.parametrize("name,dims,matmuls", [
    ("rmsnorm_linear", {"batch": 16, "hidden": 4096, "out": 6144}, 1),
    ("gated_mlp", {"batch": 16, "hidden": 4096, "intermediate": 14336}, 2),
    ("lora_linear", {"batch": 16, "in": 4096, "out": 4096, "rank": 16}, 2),
])
def test_discovers_the_single_kernel_fusions_at_serving_shapes(name, dims, matmuls):
    spec = build_spec(name, dims, dtype="bfloat16")
    res = superoptimize(spec, SearchConfig(max_kernel_ops=1, time_budget_s=600, progress=False))
    log.info("%s: %s", name, res.stats)
    assert any(_fused_loop_kernel(c.graph, matmuls) is not None for c in res.candidates), res.stats


def _split_kv(graph):
    """(partials block, combine block) if ``graph`` is a max-rescaled split-KV
    attention: a first kernel whose grid also splits the KV length (partial
    outputs), with a running max and rescaled sums in its loop, and a second that
    rescales the partials by their maxima and sums them; else None."""
    kernels = [op for op in graph.ops if op.kind != "input"]
    if len(kernels) != 2 or any(op.kind != "customized" for op in kernels):
        return None
    first, second = kernels[0].block, kernels[1].block
    fns1 = {(op.kind, op.attr("fn")) for op in first.ops}
    fns2 = [(op.kind, op.attr("fn")) for op in second.ops]
    partial = any(-1 in bo.output_map and first.grid[bo.output_map.index(-1)] > 1 for bo in first.outputs)
    loop = any(bi.forloop_dim >= 0 for bi in first.inputs)
    safe1 = {("accum", "max_last"), ("accum", "rescaled_sum"), ("accum", "rescaled_sum_last")} <= fns1
    safe2 = ("reduce", "max") in fns2 and ("unary", "exp") in fns2 and fns2.count(("reduce", "sum")) == 2
    return (first, second) if partial and loop and safe1 and safe2 else None


def _attention_search(dims, cfg):
    spec = build_spec("attention_decode", dims, dtype="bfloat16")
    res = superoptimize(spec, cfg)
    log.info("attention_decode %s: %s", dims, res.stats)
    found = [c for c in res.candidates if _split_kv(c.graph) is not None]
    assert found, (res.stats, [[op.kind for op in c.graph.ops if op.kind != "input"] for c in res.candidates])
    assert all(c.certificate.verdict == "equivalent" for c in res.candidates)
    return res, found


def test_attention_search_finds_split_kv_with_max_rescaling():
    """No template: the search finds the single-loop softmax·V kernel (exp, its
    sum, the V product, the division after the loop); the exp-shifting and
    loop-splitting rewrites of it are verified like every candidate. Grid rank 1
    keeps this to about a minute on 2 cores; the issue's shape at the default
    limits runs with MIRAGE_SERVE_SLOW=1."""
    dims = {"batch": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 128, "kv_len": 1024}
    cfg = SearchConfig(max_kernel_ops=2, max_grid_dims=1, time_budget_s=240, jobs=2, progress=False)
    _attention_search(dims, cfg)


@slow
def test_discovers_split_kv_attention_at_the_serving_shape():
    dims = {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "kv_len": 4096}
    res, found = _attention_search(dims, SearchConfig(max_kernel_ops=2, time_budget_s=600, progress=False))
    assert res.stats.time_to_first_s is not None and res.stats.time_to_first_s < 600
