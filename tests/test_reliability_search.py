"""Search limits through the public interfaces only (``superoptimize`` and ``mirage-serve
search``): a tiny time budget on a large spec is honoured, memory stays bounded, and bad
specs, dims and budgets get a clear error (exit code 2, a message naming the problem,
no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
from handwritten import fused_rmsnorm_linear

from mirage_serve.cli import main
from mirage_serve.mugraph import KernelGraph, MuGraphError, Op
from mirage_serve.search.config import SearchConfig
from mirage_serve.search.driver import superoptimize
from mirage_serve.specs import build_spec

LARGE = {
    "rmsnorm_linear": {"batch": 16, "hidden": 4096, "out": 4096},
    "attention_decode": {"batch": 8, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "kv_len": 4096},
}
BUDGET_S = 2.0
SLACK_S = 20.0  # process start-up, the wave in flight when the deadline passes, shared cores


@pytest.mark.parametrize("name", sorted(LARGE))
def test_tiny_time_budget_on_a_large_spec_is_honoured(name):
    spec = build_spec(name, LARGE[name], "bfloat16")
    t0 = time.monotonic()
    res = superoptimize(spec, SearchConfig(time_budget_s=BUDGET_S, jobs=1, progress=False))
    wall = time.monotonic() - t0
    assert wall < BUDGET_S + SLACK_S, f"a {BUDGET_S}s search took {wall:.1f}s"
    assert res.stats.elapsed_s < BUDGET_S + SLACK_S
    assert all(c.certificate.verdict == "equivalent" for c in res.candidates)


MEMORY_PROBE = textwrap.dedent(
    """
    import json, resource, sys, time
    from mirage_serve.search.config import SearchConfig
    from mirage_serve.search.driver import superoptimize
    from mirage_serve.specs import build_spec
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    spec = build_spec("rmsnorm_linear", {"batch": 16, "hidden": 4096, "out": 4096}, "bfloat16")
    t0 = time.monotonic()
    res = superoptimize(spec, SearchConfig(time_budget_s=4.0, jobs=1, progress=False, max_states=200))
    print(json.dumps({"before_kb": before, "after_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "wall_s": time.monotonic() - t0, "complete": res.stats.complete}))
    """
)


def test_search_memory_stays_bounded_on_a_large_spec():
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grown_mb = (m["after_kb"] - m["before_kb"]) / 1024
    assert grown_mb < 1500, f"peak RSS grew by {grown_mb:.0f} MB during a 4 s search"
    assert m["wall_s"] < 4.0 + SLACK_S


def _search(capsys, *args: str) -> tuple[int, str]:
    rc = main(["search", *args, "--jobs", "1", "--no-progress", "--time-budget", "5"])
    cap = capsys.readouterr()
    return rc, cap.err + cap.out


@pytest.mark.parametrize(
    "spec, dims, message",
    [
        ("rmsnorm_linear", "batch=0,hidden=64,out=16", "dim batch=0 must be a positive integer"),
        ("rmsnorm_linear", "batch=-4,hidden=64,out=16", "dim batch=-4 must be a positive integer"),
        ("rmsnorm_linear", "batch=2,hidden=64", "needs dim(s) ['out']"),
        ("rmsnorm_linear", "batch=2,hidden=64,out=16,experts=8", "has no dim(s) ['experts']"),
        ("rmsnorm_linear", "batch=two,hidden=64,out=16", "the value must be an integer"),
        ("rmsnorm_linear", "batch,hidden=64,out=16", "is not NAME=VALUE"),
        ("rmsnorm_linear", "batch=2.5,hidden=64,out=16", "the value must be an integer"),
        ("attention_decode", "batch=1,q_heads=6,kv_heads=4,head_dim=8,kv_len=16", "not a multiple of kv_heads"),
        ("no_such_spec", "batch=1", "unknown spec 'no_such_spec'"),
    ],
)
def test_bad_spec_or_dims_get_a_clear_error(capsys, spec, dims, message):
    rc, text = _search(capsys, spec, "--dims", dims)
    assert rc == 2, text
    assert message in text and "Traceback" not in text


@pytest.mark.parametrize("budget", ["0", "-5"])
def test_bad_time_budget_gets_a_clear_error(capsys, budget):
    rc = main(["search", "rmsnorm_linear", "--dims", "batch=2,hidden=32,out=16", "--jobs", "1", "--no-progress", "--time-budget", budget])
    text = capsys.readouterr().err
    assert rc == 2 and "time_budget_s" in text and "Traceback" not in text


HUGE = f"batch=1,hidden={1 << 40},out=16"


def _search_subprocess(dims: str, budget_s: float) -> tuple[int | None, str, float]:
    """The CLI in a child process (a runaway search cannot hang the test run)."""
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "mirage_serve.cli", "search", "rmsnorm_linear", "--dims", dims, "--jobs", "1",
                              "--no-progress", "--time-budget", str(budget_s)], capture_output=True, text=True, timeout=budget_s + 4 * SLACK_S)
    except subprocess.TimeoutExpired:
        return None, "", time.monotonic() - t0
    return out.returncode, out.stderr + out.stdout, time.monotonic() - t0


def test_huge_dims_do_not_run_away():
    rc, text, wall = _search_subprocess(HUGE, 3.0)
    assert rc is not None, f"a 3 s search with hidden=2^40 was still running after {wall:.0f} s"
    assert wall < 3.0 + 2 * SLACK_S and "Traceback" not in text, text[-2000:]


def test_dims_beyond_any_device_are_refused():
    rc, text, _ = _search_subprocess(HUGE, 3.0)
    assert rc == 2 and "hidden" in text


def test_superoptimize_refuses_bad_specs():
    with pytest.raises(MuGraphError, match="customized operators"):
        superoptimize(fused_rmsnorm_linear(2, 32, 16, n_blocks=2, loop=2), SearchConfig(time_budget_s=5, jobs=1, progress=False))
    bad = KernelGraph((Op.make("input", name="X", shape=(4, 8)), Op.make("matmul", (0, 7))), (1,))  # reads a tensor that does not exist
    with pytest.raises(MuGraphError, match="not produced before it"):
        superoptimize(bad, SearchConfig(time_budget_s=5, jobs=1, progress=False))
    with pytest.raises(MuGraphError, match="KernelGraph"):
        superoptimize({"spec": "rmsnorm_linear"}, SearchConfig(time_budget_s=5, jobs=1, progress=False))
