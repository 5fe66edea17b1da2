"""The parameter search of mirage_serve.tune (CPU parts): first round, neighbours, merge, and the search
driven with a stand-in for profiling."""

from __future__ import annotations

import math

import pytest
from codegen_graphs import two_kernel_add_rmsnorm_linear
from handwritten import fused_rmsnorm_linear, split_kv_attention

from mirage_serve.codegen import CodegenParams, supports
from mirage_serve.tune import search, space


def test_initial_params_follow_the_rows_of_the_tile_matmuls():
    dot = {"matmul": "dot", "dot_precision": "input", "num_stages": 3}
    swapped = {**dot, "dot_swap": 1}
    acc = {"dot_acc": 1}  # every loop here sums its tile matmul: the dot points also accumulate in the MMA
    assert space.initial_params(fused_rmsnorm_linear(1, 4096, 6144, 768, 4, dtype="bfloat16")) == [{"matmul": "fma"}, swapped, {**swapped, **acc}]
    assert space.initial_params(fused_rmsnorm_linear(1, 64, 32, 2, 2)) == [{"matmul": "fma"}]  # float32: no 16-bit MMA
    b8 = space.initial_params(fused_rmsnorm_linear(8, 4096, 6144, 384, 32, dtype="bfloat16"))  # 8 x 16 x 128 product fits
    assert b8 == [{"matmul": "fma"}, dot, swapped, {**dot, **acc}, {**swapped, **acc}]
    big = space.initial_params(split_kv_attention(1, 32, 8, 128, 8192, 32, 4, dtype="bfloat16"))  # 4 x 64 x 128 would spill
    # two kernels: launches overlap; no swapped MMA into softmax's max; partials and combine also as one launch
    plain = [{**dot, "pdl": 1}, {**dot, **acc, "pdl": 1}]
    assert big == plain + [{**p, "fused_combine": 1} for p in plain]
    assert space.initial_params(fused_rmsnorm_linear(8, 64, 32, 2, 2))[-1] == {"matmul": "dot", "num_stages": 3, "dot_swap": 1, **acc}
    one_iteration = space.initial_params(fused_rmsnorm_linear(8, 4096, 6144, 384, 1, dtype="bfloat16"))
    assert not any("dot_acc" in p for p in one_iteration)  # nothing to keep in flight without a loop


def test_neighbours_change_one_knob_each_and_only_where_it_matters():
    one = fused_rmsnorm_linear(8, 1024, 512, 16, 4, dtype="bfloat16")
    two = two_kernel_add_rmsnorm_linear(8, 1024, 512, 16, 4, dtype="bfloat16")
    base = {"matmul": "dot", "dot_precision": "input", "num_stages": 3}
    n1, n2 = space.neighbours(one, base), space.neighbours(two, base)
    assert all(sum(q.get(k) != base.get(k) for k in set(q) | set(base)) == 1 for q in n1)
    assert not any("pdl" in q for q in n1) and any(q.get("pdl") == 1 for q in n2)
    assert any(q.get("dot_swap") == 1 for q in n1) and any(q.get("num_warps") == 8 for q in n1)
    assert not any("dot_swap" in q for q in space.neighbours(one, {"matmul": "fma"}))
    assert {"dot_acc": 1} in [{k: v for k, v in q.items() if base.get(k) != v} for q in n1]
    assert not any("dot_acc" in q for q in space.neighbours(one, {"matmul": "fma"}))
    for q in n1 + n2:
        CodegenParams(**q)  # every neighbour is a valid parameter set
    assert space.merge(base, [{**base, "num_warps": 8}, {**base, "pdl": 1}]) == {**base, "num_warps": 8, "pdl": 1}


class _Compiled(search.Precompiler):
    """Every point compiles (no worker processes)."""

    def compile(self, trials):
        for t in trials:
            t.compile = {"ok": True, "spills": 0}


def test_search_refines_the_leaders_and_merges_what_helped(monkeypatch):
    """Profiling replaced by a stand-in time: 8 warps and 4 stages each help; the merge gets both."""
    from mirage_serve.tune import profile

    def fake(graph, params=None, *, spec=None, device="cuda", reps=50, variable_dims=()):
        p = dict(params or {})
        ok, why = supports(graph, profile.make_params(p))
        if not ok:
            return profile.ProfileResult(False, math.inf, 0.02, error=why)
        t = 10.0 + graph.customized_ops[0].block.grid[0] / 100
        t -= 1.0 if p.get("num_warps") == 8 else 0.0
        t -= 0.5 if p.get("num_stages") == 4 else 0.0
        t += 5.0 if p.get("matmul") == "fma" else 0.0
        return profile.ProfileResult(True, 1e-3, 0.02, median_us=t)

    monkeypatch.setattr(profile, "profile_candidate", fake)
    cands = [search.Candidate(f"c{nb}", fused_rmsnorm_linear(8, 1024, 512, nb, 4, dtype="bfloat16")) for nb in (16, 32, 64)]
    res = search.tune(cands, spec=None, device="cpu", top=2, precompiler=_Compiled(1))
    best = res.best
    assert best.candidate.name == "c16" and best.round == 3
    assert best.params["num_warps"] == 8 and best.params["num_stages"] == 4 and best.time_us == pytest.approx(10.16 - 1.5)
    assert {t.candidate.name for t in res.trials if t.round == 2} == {"c16", "c32"}
    assert [t.time_us for t in res.ranked()][:1] == [best.time_us]


def test_a_deadline_passed_while_compiling_still_measures_the_first_round(monkeypatch):
    """Compiling round 1 may take longer than the whole budget: its points are still timed (the case
    then has an answer), and no later round is proposed or compiled."""
    from mirage_serve.tune import profile

    calls = []

    def fake(graph, params=None, **kw):
        calls.append(dict(params or {}))
        return profile.ProfileResult(True, 1e-3, 0.02, median_us=10.0 + len(calls))

    monkeypatch.setattr(profile, "profile_candidate", fake)
    cands = [search.Candidate(f"c{nb}", fused_rmsnorm_linear(8, 1024, 512, nb, 4, dtype="bfloat16")) for nb in (16, 32)]
    compiled = _Compiled(1)
    res = search.tune(cands, spec=None, device="cpu", top=2, precompiler=compiled, deadline=0.0)
    first = [t for t in res.trials if t.round == 1]
    assert first and len(calls) == len(first) and all(math.isfinite(t.time_us) for t in first)
    assert res.best is not None and res.best.round == 1
    assert not [t for t in res.trials if t.round > 1]


def test_spilling_points_are_timed_only_without_a_spill_free_one(monkeypatch):
    from mirage_serve.tune import profile

    calls = []

    def fake(graph, params=None, **kw):
        calls.append(dict(params or {}))
        return profile.ProfileResult(True, 1e-3, 0.02, median_us=5.0)

    monkeypatch.setattr(profile, "profile_candidate", fake)
    c = search.Candidate("c", fused_rmsnorm_linear(8, 1024, 512, 16, 4, dtype="bfloat16"))
    t_spill, t_ok = search.Trial(c, {"matmul": "fma"}, 1), search.Trial(c, {"matmul": "dot", "dot_precision": "input"}, 1)
    t_spill.compile, t_ok.compile = {"ok": True, "spills": 512}, {"ok": True, "spills": 0}
    res = search.tune([c], spec=None, device="cpu", top=0, precompiled=[t_spill, t_ok])
    assert calls == [{"matmul": "dot", "dot_precision": "input"}]
    assert "spills 512 bytes" in next(t for t in res.trials if t is t_spill).result["skipped"]


def test_precompiler_compiles_again_what_a_broken_pool_took_down(monkeypatch):
    """A worker that exits (a point before it broke its CUDA context) fails every point in flight;
    those are compiled again in a new pool, and a point that breaks every pool fails at last."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    c = search.Candidate("c", fused_rmsnorm_linear(8, 1024, 512, 16, 4, dtype="bfloat16"))
    trials = [search.Trial(c, {"num_warps": w}, 1) for w in (2, 4, 8)]
    pools = []

    class FakePool:
        def __init__(self):
            self.n = len(pools)

        def submit(self, fn, graph_json, params, variable_dims, device):
            f = Future()
            if params["num_warps"] == 8 or (self.n == 0 and params["num_warps"] == 4):
                f.set_exception(BrokenProcessPool("a worker died"))
            else:
                f.set_result({"ok": True, "spills": 0, "pool": self.n})
            return f

        def shutdown(self, **kw):
            pass

    pre = search.Precompiler(4, device="cpu")
    monkeypatch.setattr(pre, "_get", lambda: pre._pool or pools.append(FakePool()) or setattr(pre, "_pool", pools[-1]) or pre._pool)
    pre.compile(trials)
    assert trials[0].compile == {"ok": True, "spills": 0, "pool": 0}
    assert trials[1].compile == {"ok": True, "spills": 0, "pool": 1}  # taken down once, compiled again
    assert not trials[2].compile["ok"] and f"failed {search.Precompiler.RETRIES + 1} times" in trials[2].compile["error"]
    assert len(pools) == search.Precompiler.RETRIES + 1


def test_no_swapped_mma_where_a_max_reads_the_dot():
    att = split_kv_attention(1, 8, 2, 64, 512, splits=4, loop=2, dtype="bfloat16")
    assert space.graph_features(att)["dot_into_max"]
    first = space.initial_params(att)
    assert first and not any(p.get("dot_swap") for p in first)
    assert not any(q.get("dot_swap") for p in first for q in space.neighbours(att, p))
    lin = fused_rmsnorm_linear(8, 64, 32, 2, 2, dtype="bfloat16")
    assert not space.graph_features(lin)["dot_into_max"] and any(p.get("dot_swap") for p in space.initial_params(lin))


def test_late_ext_mask_is_offered_where_a_kernel_loads_a_variable_extent():
    """One loop iteration over the KV length: every first-round point also with late_ext_mask=2;
    several: only the neighbours try it; no variable extent: never."""
    from mirage_serve.codegen import generate_source

    var = ((1, 1), (2, 1))
    one = split_kv_attention(1, 32, 8, 128, 1024, 32, 1, dtype="bfloat16", d_split=4)  # 32 keys a program, one iteration
    assert space.graph_features(one, var)["variable_loop"] == 1 and space.graph_features(one)["variable_loop"] == 0
    first = space.initial_params(one, var)
    plain = [p for p in first if "late_ext_mask" not in p]
    assert plain == space.initial_params(one) and [p for p in first if p not in plain] == [{**p, "late_ext_mask": 2} for p in plain]
    for p in first:  # the knob changes the generated code where it is offered
        if p.get("late_ext_mask"):
            q = {k: v for k, v in p.items() if k != "late_ext_mask"}
            assert generate_source(one, CodegenParams(**p), var) != generate_source(one, CodegenParams(**q), var)
    assert {q.get("late_ext_mask", 0) for q in space.neighbours(one, first[0], var)} >= {1, 2}
    assert {q.get("late_ext_mask") for q in space.neighbours(one, {**first[0], "late_ext_mask": 2}, var)} >= {None, 1}
    four = split_kv_attention(1, 32, 8, 128, 8192, 32, 4, dtype="bfloat16", d_split=2)  # 256 keys a program, four iterations
    assert space.graph_features(four, var)["variable_loop"] == 4
    assert not any("late_ext_mask" in p for p in space.initial_params(four, var))
    n = space.neighbours(four, space.initial_params(four, var)[0], var)
    assert {q.get("late_ext_mask") for q in n} >= {1, 2}
    for q in n:
        CodegenParams(**q)
    assert space.merge({"pdl": 1}, [{"pdl": 1, "late_ext_mask": 2}, {"pdl": 1, "num_warps": 2}]) == {"pdl": 1, "late_ext_mask": 2, "num_warps": 2}
    lin = fused_rmsnorm_linear(8, 1024, 512, 16, 4, dtype="bfloat16")
    assert not any("late_ext_mask" in p for p in space.initial_params(lin) + space.neighbours(lin, {"matmul": "fma"}))
    # the search passes each candidate's variable dims
    cands = [search.Candidate("one", one, variable_dims=var), search.Candidate("fixed", one)]
    r1 = search.first_round(cands)
    assert any(t.params.get("late_ext_mask") == 2 for t in r1 if t.candidate.name == "one")
    assert not any("late_ext_mask" in t.params for t in r1 if t.candidate.name == "fixed")


def test_a_point_that_does_not_return_in_time_is_killed_and_excluded():
    m = search.Measurer("cpu", timeout_s=0.05)  # starting the measuring process alone takes longer
    c = search.Candidate("c", fused_rmsnorm_linear(2, 64, 32, 2, 2))
    r = m.measure(search.Trial(c, {}, 1), None, 1)
    assert r["passed"] is False and "killed" in r["error"] and m._pool is None


def test_why_not_timed_names_each_kind_of_untimed_point():
    from mirage_serve.tune.search import Candidate, Trial, why_not_timed

    c = Candidate("g", None)

    def trial(result, compile=None):
        return Trial(c, {}, 1, result=result, compile=compile or {})

    assert why_not_timed(trial({"passed": True, "median_us": 3.0})) is None
    assert why_not_timed(trial({"skipped": "spills 96 bytes of registers; a spill-free point passed"})) == "skipped: spills registers"
    assert why_not_timed(trial({"skipped": "time budget"})) == "skipped: time budget"
    assert why_not_timed(trial({"error": "CompilationError: at 3:4 ..."}, {"ok": False, "error": "CompilationError: at 3:4 ..."})) \
        == "did not compile: CompilationError"
    assert why_not_timed(trial({"passed": False, "error": "crashed the measuring process (BrokenProcessPool); the point is excluded"})) \
        == "measuring: crashed the measuring process"
    assert why_not_timed(trial({"passed": False, "error": "still running after 300 s; the measuring process was killed"})) \
        == "measuring: still running after 300 s"
    assert why_not_timed(trial({"passed": False, "rel_error": 0.5})) == "failed its float check"
