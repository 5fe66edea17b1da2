"""benchmarks/auto_matmul_probe.py picks exactly the shipped entries whose code the ``matmul="auto"``
rules moved off plain GEMV math (to ``tl.dot``, or to a split loop), so that its ``fma`` form is the
code they had before."""

from __future__ import annotations

import pytest
from bench_scripts import BENCH, load_bench
from test_codegen_loop_split import loops

from mirage_serve.codegen.params import CodegenParams
from mirage_serve.codegen.runtime import generate_source


@pytest.fixture(scope="module")
def P():
    return load_bench("auto_matmul_probe")


def test_affected_entries_are_those_the_rule_moved_to_dot(P):
    found = P.affected_entries()
    assert found, "the shipped cache has entries with 2-15-row tile matmuls too large for GEMV registers"
    for name, e in found:
        p = CodegenParams(**e.params)
        mms = P.tile_matmuls(e.graph)
        assert all(m < p.dot_min_rows for m, _, _ in mms), name
        auto = "\n".join(generate_source(e.graph, p))
        fma = "\n".join(generate_source(e.graph, CodegenParams(**{**e.params, "matmul": "fma"})))
        assert "tl.dot" not in fma and auto != fma, name
        # tl.dot, or GEMV math in a loop of more iterations
        assert "tl.dot" in auto or loops(auto) != loops(fma), name


def test_affected_entries_are_exactly_the_entries_whose_code_the_rule_changed(P, monkeypatch):
    """The code of every shipped entry with the rule, and with GEMV math for every tile matmul under 16 rows (the
    rule before it): exactly the picked entries differ."""
    import json

    from mirage_serve.cache.entry import CacheEntry
    from mirage_serve.codegen import triton_gen

    entries = {}
    for f in sorted((BENCH.parent / "kernel_cache" / "entries").glob("*.json")):
        e = CacheEntry.from_obj(json.loads(f.read_text()), allow_stale=True)
        entries[f.stem] = e
    now = {n: generate_source(e.graph, CodegenParams(**e.params)) for n, e in entries.items()}
    affected = {n for n, _ in P.affected_entries()}
    monkeypatch.setattr(triton_gen, "gemv_fits", lambda *a: True)
    monkeypatch.setattr(triton_gen, "MAX_AUTO_SPLIT", 1)
    before = {n: generate_source(e.graph, CodegenParams(**e.params)) for n, e in entries.items()}
    changed = {n for n in entries if now[n] != before[n]}
    assert changed and changed == affected


def test_tile_matmuls_reads_rows_columns_inner(P):
    from tests.handwritten import fused_rmsnorm_linear

    # 4 rows; 128 outputs over 4 blocks = 32 columns; 256 hidden over 2 iterations = 128 inner
    assert P.tile_matmuls(fused_rmsnorm_linear(4, 256, 128, n_blocks=4, loop=2)) == [(4, 32, 128)]


def test_main_times_each_entry_in_the_forms_asked_for(P, monkeypatch, tmp_path):
    import json
    from types import SimpleNamespace

    import torch

    from mirage_serve.tune import profile

    seen = []

    def fake_profile(graph, params, device, reps):
        seen.append(dict(params))
        us = {"fma": 40.0, "tf32": 12.0}.get(params.get("matmul") if params.get("matmul") == "fma" else params.get("dot_precision"), 10.0)
        return SimpleNamespace(passed=True, rel_error=1e-3, median_us=us, error=None)

    monkeypatch.setattr(profile, "profile_candidate", fake_profile)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in GPU")
    assert P.main(["--out", str(tmp_path), "--any-entry", "--entries", "gated_mlp-1fff28dd", "--forms", "auto,tf32,fma"]) == 0
    rep = json.loads((tmp_path / "auto-matmul.json").read_text())
    (row,) = rep["entries"]
    assert row["entry"].startswith("gated_mlp-1fff28dd") and rep["forms"] == {"auto": {}, "tf32": {"dot_precision": "tf32"}, "fma": {"matmul": "fma"}}
    assert row["tf32_over_auto"] == 1.2 and row["fma_over_auto"] == 4.0
    assert [p.get("dot_precision", p.get("matmul", "own")) for p in seen] == ["own", "tf32", "fma"]
    with pytest.raises(SystemExit):
        P.main(["--out", str(tmp_path), "--forms", "auto,int8"])
