"""superoptimize end to end on small specs: only verified candidates, the plain
form for a spec with nothing to fuse, determinism, budgets and errors.

The enumeration is driven by the numeric stand-in engine (no pruning) so that
these tests exercise the driver independently of the abstract expressions; the
verifier is the project's ``verify_equivalent``.
"""

import pytest
from test_search_standins import numeric_engine

from mirage_serve.mugraph import GraphBuilder, MuGraphError, content_hash
from mirage_serve.search import SearchConfig, superoptimize
from mirage_serve.verify import verify_equivalent

SMALL = SearchConfig(max_kernel_ops=1, max_block_ops=2, max_grid_dims=1, tile_widths=(8,), loop_chunks=(16,), splits=(2,),
                     jobs=2, progress=False, time_budget_s=120)


def _matmul_spec():
    g = GraphBuilder()
    x, w = g.input("X", (4, 32)), g.input("W", (16, 32))
    return g.build([g.matmul(x, w, trans_b=True)])


@pytest.fixture(scope="module")
def matmul_result():
    return superoptimize(_matmul_spec(), SMALL, engine_factory=numeric_engine)


def test_plain_matmul_returns_the_plain_form_first(matmul_result):
    spec = _matmul_spec()
    res = matmul_result
    assert res.candidates, res.stats
    assert content_hash(res.best.graph) == content_hash(spec)
    assert res.stats.complete and res.stats.time_to_first_s is not None and res.stats.time_to_best_s is not None
    assert res.stats.structures >= 2  # the plain matmul and customized matmuls were all found
    assert [c.cost for c in res.candidates] == sorted(c.cost for c in res.candidates)


def test_every_candidate_is_verified_and_reverification_agrees(matmul_result):
    spec = _matmul_spec()
    hashes = set()
    for c in matmul_result.candidates:
        assert c.certificate.verdict == "equivalent"
        assert verify_equivalent(c.graph, spec, trials=2, seed=11).verdict == "equivalent"
        hashes.add(c.hash)
    assert len(hashes) == len(matmul_result.candidates)  # de-duplicated by content hash
    assert matmul_result.stats.verified == len(matmul_result.candidates)


def test_deterministic_for_a_seed(matmul_result):
    again = superoptimize(_matmul_spec(), SMALL.replace(jobs=1), engine_factory=numeric_engine)
    assert [c.hash for c in again.candidates] == [c.hash for c in matmul_result.candidates]
    assert again.stats.enumerated == matmul_result.stats.enumerated


class _Unknown:
    verdict = "unknown"

    def to_dict(self):
        return {"verdict": "unknown"}


def _reject_all(candidate, spec, **kw):
    return _Unknown()


def test_a_verifier_that_rejects_everything_leaves_nothing():
    res = superoptimize(_matmul_spec(), SMALL, engine_factory=numeric_engine, verifier=_reject_all)
    assert res.candidates == [] and res.stats.rejected > 0 and res.stats.verified == 0


def test_time_budget_cuts_the_search_and_says_so():
    cfg = SMALL.replace(max_block_ops=6, max_kernel_ops=3, time_budget_s=1.0, jobs=1)
    res = superoptimize(_matmul_spec(), cfg, engine_factory=numeric_engine)
    assert not res.stats.complete
    assert res.stats.elapsed_s < 30
    assert all(c.certificate.verdict == "equivalent" for c in res.candidates)


def test_patience_stops_a_search_that_no_longer_improves():
    cfg = SMALL.replace(max_block_ops=6, max_kernel_ops=3, time_budget_s=300, jobs=1, patience_s=0.5)
    res = superoptimize(_matmul_spec(), cfg, engine_factory=numeric_engine)
    s = res.stats
    assert s.stopped_early and not s.complete
    assert res.candidates and all(c.certificate.verdict == "equivalent" for c in res.candidates)
    assert s.time_to_best_s + max(0.5, s.time_to_best_s) <= s.elapsed_s < 60


def test_patience_waits_for_a_numerically_safe_candidate(monkeypatch):
    import mirage_serve.search.driver as driver

    monkeypatch.setattr(driver, "numerically_safe", lambda graph, spec: False)
    cfg = SMALL.replace(max_block_ops=6, max_kernel_ops=3, time_budget_s=3.0, jobs=1, patience_s=0.2)
    res = superoptimize(_matmul_spec(), cfg, engine_factory=numeric_engine)
    assert res.candidates and not res.stats.stopped_early  # ran on to its budget looking for a safe one
    assert res.stats.elapsed_s >= 3.0


def test_state_cap_bounds_memory():
    cfg = SMALL.replace(max_kernel_ops=2, max_states=5, max_block_ops=1, time_budget_s=60)
    res = superoptimize(_matmul_spec(), cfg, engine_factory=numeric_engine)
    assert not res.stats.complete  # the cap was hit and reported


def test_bad_spec_and_bad_config_raise_clear_errors():
    with pytest.raises(MuGraphError, match="KernelGraph"):
        superoptimize("rmsnorm_linear", SMALL)
    with pytest.raises(MuGraphError, match="max_block_ops"):
        SearchConfig(max_block_ops=0)
    with pytest.raises(MuGraphError, match="no field"):
        SMALL.replace(max_blocks=3)
    with pytest.raises(MuGraphError, match="time_budget_s"):
        SearchConfig(time_budget_s=-1)
    with pytest.raises(MuGraphError, match="patience_s"):
        SearchConfig(patience_s=0)
