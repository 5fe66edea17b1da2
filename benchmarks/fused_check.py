"""Repeated check of one-launch (``fused_combine``) kernels on the GPU: a race shows as a moving result.

For every case of a ``kernels.py`` report, the fastest passing tuning point with ``fused_combine=1``
is compiled and run many times on several input sets: back-to-back eager launches with no
synchronisation between them, and CUDA-graph replays of a rotation over the sets (the way the table
times it, programmatic dependent launch included). The combine reads the partials in a fixed order,
so every run of one input set must give bit-identical output; each is also compared with the float64
reference. Usage: ``python benchmarks/fused_check.py REPORT.json --out DIR`` (writes ``fused-check.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import variants as V  # noqa: E402

from mirage_serve.specs import build_spec  # noqa: E402


def check_case(case: dict, eager_runs: int, replays: int, n_sets: int = 4) -> dict | None:
    import torch

    from mirage_serve.codegen import compile_graph
    from mirage_serve.reference import execute
    from mirage_serve.tune.profile import make_params, random_device_inputs
    from mirage_serve.tune.timing import relative_error

    fused = [v for v in case["variants"] if v.get("passed") and v.get("median_us") and v["params"].get("fused_combine")]
    if not fused:
        return None
    best = min(fused, key=lambda v: v["median_us"])
    cand = next(c for c in V.candidates_for(case["spec"], case["dims"], "bfloat16") if c.name == best["name"])
    cg = compile_graph(cand.graph, make_params(best["params"]), cand.variable_dims)
    spec = build_spec(case["spec"], case["dims"], dtype="bfloat16")
    gen = torch.Generator(device="cuda").manual_seed(7)
    sets = [random_device_inputs(spec, "cuda", gen) for _ in range(n_sets)]
    refs = [execute(spec, s, dtype=torch.float64)[0] for s in sets]
    first = [cg(*s, poison=True)[0].clone() for s in sets]
    torch.cuda.synchronize()
    errs = [relative_error(o, r) for o, r in zip(first, refs, strict=True)]
    differ = 0
    outs = []
    for i in range(eager_runs):  # no synchronisation between launches
        outs.append((i % n_sets, cg(*sets[i % n_sets])[0].clone()))
    torch.cuda.synchronize()
    differ += sum(not torch.equal(o, first[k]) for k, o in outs)
    bufs = [torch.empty_like(f) for f in first]
    for s, b in zip(sets, bufs, strict=True):  # warm-up outside the capture
        b.copy_(cg(*s)[0])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for s, b in zip(sets, bufs, strict=True):
            b.copy_(cg(*s)[0])
    graph_differ = 0
    for _ in range(replays):
        for b in bufs:
            b.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        graph_differ += sum(not torch.equal(b, f) for b, f in zip(bufs, first, strict=True))
    counters = int(cg._counters["cuda:0"].abs().sum()) if "cuda:0" in cg._counters else None
    return {"label": case["label"], "variant": best["name"], "params": best["params"], "rel_errors": errs,
            "eager_runs": eager_runs, "eager_differ": differ, "graph_replays": replays, "graph_outputs": replays * n_sets,
            "graph_differ": graph_differ, "counters_after": counters}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report")
    p.add_argument("--out", default=".")
    p.add_argument("--eager-runs", type=int, default=400)
    p.add_argument("--replays", type=int, default=200)
    args = p.parse_args()
    report = json.loads(Path(args.report).read_text())
    rows = []
    for case in report["cases"]:
        r = check_case(case, args.eager_runs, args.replays)
        if r is not None:
            rows.append(r)
            print(json.dumps(r), flush=True)
    Path(args.out, "fused-check.json").write_text(json.dumps({"environment": report["environment"], "checks": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
