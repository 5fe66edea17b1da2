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
