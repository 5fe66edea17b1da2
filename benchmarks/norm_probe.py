"""RMSNorm->Linear at Llama-3-8B shapes on one GPU: the one-kernel fused schedule (the 2026-12-06 bests)
against the two-kernel ``norm2`` schedule (rows normalised first, then a plain tiled matmul), each
with and without ``dot_acc`` (the MMA accumulating in place), against cuBLAS+graph, torch.compile+graph
and eager+graph.

Every point is float-checked against float64 on two input sets (outputs NaN-poisoned first) and
timed as in ``kernels.py``: CUDA-graph replays of a rotation over enough input sets to defeat the L2,
median per call. Per case the best new point, the old best and the contenders are then re-timed
interleaved, twice.

Usage: ``python benchmarks/norm_probe.py --out DIR`` (writes norm-probe.json); ``--cases qkv_b32,gate_up_b8``
picks cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import variants as V  # noqa: E402
from goal_probe import measure, rmsnorm_inputs, stock_contender  # noqa: E402

DOT = {"matmul": "dot", "dot_precision": "input", "dot_swap": 1}
ACC = {"dot_acc": 1}
N2 = {**DOT, "pdl": 1}
# case -> (batch, out, [(candidate, params)]); the first point of each is the 2026-12-06 best
CASES = {
    "qkv_b32": (32, 6144, [
        ("fused c48 k256", {**DOT, "num_stages": 4}), ("fused c48 k256", {**DOT, "num_stages": 4, **ACC}),
        ("norm2 c48 k256", {**N2, "num_stages": 4}), ("norm2 c48 k256", {**N2, "num_stages": 4, **ACC}),
        ("norm2 c48 k256", {**N2, "num_stages": 3, **ACC}), ("norm2 c48 k256", {**N2, "num_stages": 2, **ACC}),
        ("norm2 c48 k256", {**N2, "num_stages": 4, **ACC, "pdl": 0}), ("norm2 c48 k128", {**N2, "num_stages": 6, **ACC}),
        ("norm2 c48 k128", {**N2, "num_stages": 8, **ACC}), ("norm2 c64 k256", {**N2, "num_stages": 4, **ACC}),
        ("norm2 c64 k128", {**N2, "num_stages": 6, **ACC}), ("norm2 c32 k256", {**N2, "num_stages": 4, **ACC}),
        ("norm2 c48 k256", {**N2, "num_stages": 4, **ACC, "num_warps": 8})]),
    "qkv_b8": (8, 6144, [
        ("fused c48 k256", {**DOT, "num_stages": 4}), ("fused c48 k256", {**DOT, "num_stages": 4, **ACC}),
        ("norm2 c48 k256", {**N2, "num_stages": 4, **ACC}), ("norm2 c48 k128", {**N2, "num_stages": 6, **ACC}),
        ("norm2 c64 k256", {**N2, "num_stages": 4, **ACC}), ("norm2 c32 k256", {**N2, "num_stages": 4, **ACC})]),
    "gate_up_b8": (8, 28672, [
        ("fused c128 k128", {**DOT, "num_stages": 3, "num_warps": 8}), ("fused c128 k128", {**DOT, "num_stages": 3, "num_warps": 8, **ACC}),
        ("fused c128 k256", {**DOT, "num_stages": 3, **ACC}),
        ("norm2 c128 k128", {**N2, "num_stages": 3, **ACC}), ("norm2 c128 k128", {**N2, "num_stages": 4, **ACC}),
        ("norm2 c128 k128", {**N2, "num_stages": 3, **ACC, "num_warps": 8}), ("norm2 c128 k256", {**N2, "num_stages": 3, **ACC}),
        ("norm2 c64 k256", {**N2, "num_stages": 4, **ACC}), ("norm2 c64 k128", {**N2, "num_stages": 6, **ACC})]),
    "gate_up_b32": (32, 28672, [
        ("fused c128 k128", {**DOT, "num_stages": 3, "num_warps": 8}), ("fused c128 k128", {**DOT, "num_stages": 3, "num_warps": 8, **ACC}),
        ("norm2 c128 k128", {**N2, "num_stages": 3, **ACC}), ("norm2 c128 k128", {**N2, "num_stages": 4, **ACC}),
        ("norm2 c128 k128", {**N2, "num_stages": 3, **ACC, "num_warps": 8}), ("norm2 c128 k256", {**N2, "num_stages": 2, **ACC}),
        ("norm2 c64 k256", {**N2, "num_stages": 4, **ACC})]),
}
CONTENDERS = ("cublas_graph", "compile_graph", "eager_graph")


def _cands(batch: int, out: int) -> dict:
    return {c.name: c for c in V.candidates_for("rmsnorm_linear", {"batch": batch, "hidden": 4096, "out": out}, "bfloat16")}


def run_case(label: str, reps: int) -> dict:
    import kernels as K
    import torch

    from mirage_serve.tune.cost_model import floor_bytes
    from mirage_serve.tune.timing import relative_error

    batch, out, points = CASES[label]
    dims = {"batch": batch, "hidden": 4096, "out": out}
    spec, sets, checks, refs = rmsnorm_inputs(dims, batch + out)
    cands = _cands(batch, out)
    res: dict = {"dims": dims, "floor_us": floor_bytes(spec) / 4.25e12 * 1e6, "points": []}
    chk = lambda outs, i: relative_error(outs[0], refs[i])
    for name, p in points:
        res["points"].append(measure(name, cands[name].graph, p, checks, chk, sets, reps))
    case = K.Case("rmsnorm_linear", dims, label)
    stock = K._stock_contenders(case, sets)
    contender = lambda cname, r: stock_contender(case, spec, stock, sets, cname, r)

    ok = [r for r in res["points"][1:] if r.get("median_us")]
    best = min(ok, key=lambda r: r["median_us"]) if ok else None
    res["final"] = {"best": [], "baseline": [], **{c: [] for c in CONTENDERS}}
    for _ in range(2):
        for c in CONTENDERS:
            res["final"][c].append(contender(c, reps * 2))
        if best is not None:
            res["final"]["best"].append(measure(f"final {best['label']}", cands[best["label"]].graph, best["params"], checks, chk, sets, reps * 2))
        res["final"]["baseline"].append(measure(f"final {points[0][0]} (2026-12-06 best)", cands[points[0][0]].graph, points[0][1], checks, chk,
                                                sets, reps * 2))
    sets.clear()
    torch.cuda.empty_cache()
    return res


def precompile(labels: list[str], workers: int) -> None:
    from mirage_serve.tune.search import Precompiler, Trial

    trials = []
    for label in labels:
        batch, out, points = CASES[label]
        cands = _cands(batch, out)
        trials += [Trial(cands[n], p, 0) for n, p in points]
    pc = Precompiler(workers)
    try:
        pc.compile(trials)
    finally:
        pc.close()
    bad = [(t.candidate.name, t.params, t.compile.get("error")) for t in trials if not t.compile.get("ok")]
    print(f"precompiled {len(trials)} points, {len(bad)} failed: {bad[:4]}", flush=True)


def _best(xs: list[dict]) -> float | None:
    ts = [x["median_us"] for x in xs if x.get("median_us")]
    return min(ts) if ts else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    labels = [c for c in args.cases.split(",") if c]
    unknown = [c for c in labels if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    import torch
    import triton

    from mirage_serve.codegen import CODEGEN_VERSION
    from mirage_serve.tune.timing import copy_bandwidth

    t0 = time.time()
    out = Path(args.out) / "norm-probe.json"
    report: dict = {"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                                    "codegen_version": CODEGEN_VERSION, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}, "cases": {}}
    save = lambda: out.write_text(json.dumps(report, indent=1, default=str))
    precompile(labels, args.workers)
    report["copy_bw_Bps"] = copy_bandwidth()
    print(f"copy bandwidth {report['copy_bw_Bps'] / 1e12:.2f} TB/s at +{time.time() - t0:.0f}s", flush=True)
    for label in labels:
        print(f"-- {label}", flush=True)
        report["cases"][label] = run_case(label, args.reps)
        report["wall_s"] = time.time() - t0
        save()
    print("| case | new best | variant | old best | cuBLAS+graph | compile+graph | eager+graph | new/cuBLAS | compile/new | eager/new |")
    for label, r in report["cases"].items():
        f = r["final"]
        b, o, cb, cp, eg = (_best(f[k]) for k in ("best", "baseline", *CONTENDERS))
        name = f"{f['best'][0]['label']} {json.dumps(f['best'][0]['params'])}" if f["best"] else "-"
        if b and cb and cp and eg:
            print(f"| {label} | {b:.2f} | {name} | {o:.2f} | {cb:.2f} | {cp:.2f} | {eg:.2f} | {b / cb:.3f} | {cp / b:.3f} | {eg / b:.3f} |")
    print(f"wall {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
