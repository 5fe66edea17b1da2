"""How well does the analytical cost model (``mirage_serve.tune.cost_model``) rank what a GPU measured?

Reads kernel tables written by ``benchmarks/kernels.py`` (``results/*-kernels-*.json``: every tuned
variant with its measured median), rebuilds each variant's μGraph from ``variants.py`` and estimates
it again with today's model for the GPU the table names (H100 or H200). No GPU needed.

For each case it reports:

* ``rho``: Spearman rank correlation of estimate and measurement over every measured variant;
* ``pick``: the measured time of the schedule the model ranks first *with default parameters*, over
  the best measured time of any variant. This is what a CPU-only ``build-cache`` lives with: it picks
  the schedule by the model, and the kernel runs with default parameters (no tuning);
* ``pick_tuned``: the same for the schedule the model ranks first when each schedule keeps its
  best measured parameters (what a GPU-less ranking would give if tuning came later).

Usage: ``python benchmarks/cost_model_check.py [RESULTS.json ...]`` (default: the committed whole
tables); ``--json`` prints the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from mirage_serve.cmd_bench import load_bench
from mirage_serve.tune.cost_model import GPU_MODELS, estimate

K = load_bench("kernels")  # by path: Hugging Face's kernels package may own the name
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_TABLES = ("2026-12-06-h200-kernels-full.json", "2026-12-07-h100-kernels-full.json")


def gpu_model_for(name: str):
    for key, model in GPU_MODELS.items():
        if key in name:
            return model
    raise ValueError(f"no cost-model GPU for {name!r}: known {sorted(GPU_MODELS)}")


def check_case(case: dict, gpu) -> dict | None:
    graphs = {c.name: c.graph for c in K.V.candidates_for(case["spec"], case["dims"], K.DTYPE)}
    rows = [v for v in case.get("variants", []) if v.get("passed") and v.get("median_us") and v["name"] in graphs]
    if not rows:
        return None
    est = [estimate(graphs[v["name"]], v["params"], gpu).time_s * 1e6 for v in rows]
    meas = [v["median_us"] for v in rows]
    best = min(meas)
    best_of: dict[str, float] = {}
    for v in rows:
        best_of[v["name"]] = min(best_of.get(v["name"], math.inf), v["median_us"])
    default_est = {n: estimate(graphs[n], None, gpu).time_s * 1e6 for n in best_of}
    pick = min(best_of, key=lambda n: default_est[n])
    tuned_est = {}
    for v, e in zip(rows, est, strict=True):
        if v["median_us"] == best_of[v["name"]]:
            tuned_est[v["name"]] = e
    pick_tuned = min(tuned_est, key=tuned_est.get)
    return {
        "label": case["label"], "variants": len(rows), "schedules": len(best_of), "rho": K.rank_correlation(list(zip(est, meas, strict=True))),
        "best_us": best, "pick": pick, "pick_ratio": best_of[pick] / best, "pick_tuned": pick_tuned,
        "pick_tuned_ratio": best_of[pick_tuned] / best,
    }


def check_table(path: Path) -> dict:
    report = json.loads(path.read_text())
    gpu = gpu_model_for(report["environment"]["gpu"])
    cases = [r for c in report["cases"] if (r := check_case(c, gpu))]
    ratios = [c["pick_ratio"] for c in cases]
    rhos = [c["rho"] for c in cases if c["rho"] is not None]
    return {
        "table": path.name, "gpu": report["environment"]["gpu"], "model": gpu.name, "cases": cases,
        "geomean_pick_ratio": math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else None,
        "worst_pick_ratio": max(ratios, default=None),
        "median_rho": statistics.median(rhos) if rhos else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="*", type=Path, help="kernels.py JSON tables (default: the committed whole tables)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    tables = args.tables or [RESULTS / t for t in DEFAULT_TABLES]
    out = [check_table(p) for p in tables]
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for t in out:
        print(f"{t['table']} ({t['gpu']}, model {t['model']}): geomean pick/best {t['geomean_pick_ratio']:.3f}, "
              f"worst {t['worst_pick_ratio']:.3f}, median rho {t['median_rho']:.2f}")
        for c in t["cases"]:
            rho = "  n/a" if c["rho"] is None else f"{c['rho']:5.2f}"
            print(f"  {c['label']:<20} rho {rho}  pick {c['pick']:<22} {c['pick_ratio']:5.2f}x   "
                  f"tuned pick {c['pick_tuned']:<22} {c['pick_tuned_ratio']:5.2f}x   ({c['schedules']} schedules, best {c['best_us']:.1f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
