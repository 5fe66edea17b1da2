"""The shipped kernel cache at default codegen parameters: GEMV math against ``tl.dot`` where the GEMV
product would spill.

Entries built without a GPU (``kernel_cache/entries``) carry no tuned parameters and compile with
``CodegenParams()`` defaults, whose ``matmul="auto"`` takes tile matmuls of 2-15 rows with
``tl.dot`` wherever the GEMV form's broadcast product would not fit the registers (and the dot's
tiles fit shared memory; ``codegen.params.gemv_fits``). This times, for every shipped entry where
that rule changes the code, the entry as it is now (``auto``) beside the GEMV form it had before
(``matmul="fma"``), both float-checked against the float64 reference, under CUDA graphs.

Usage (GPU): ``python benchmarks/auto_matmul_probe.py --out DIR [--limit N] [--entries PREFIX ...]`` (writes
auto-matmul.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mirage_serve.cache.entry import CacheEntry  # noqa: E402
from mirage_serve.tune.space import tile_matmuls  # noqa: E402


def affected_entries(entries_dir: Path = ROOT / "kernel_cache" / "entries") -> list[tuple[str, CacheEntry]]:
    """Shipped entries whose default-parameter code the ``auto`` rule moved off GEMV math: a tile
    matmul of 2 to ``dot_min_rows - 1`` rows whose GEMV product would not fit the registers
    (``gemv_fits``), and no tile matmul of ``dot_min_rows`` rows or more, so that ``matmul="fma"``
    is exactly the code such an entry compiled to before."""
    from mirage_serve.codegen.params import CodegenParams, gemv_fits

    out = []
    for f in sorted(entries_dir.glob("*.json")):
        e = CacheEntry.from_obj(json.loads(f.read_text()), allow_stale=True)  # built for the CPU's Triton; regenerated here
        if e.params.get("matmul", "auto") != "auto":
            continue
        p = CodegenParams(**e.params)
        mms = tile_matmuls(e.graph)
        if any(m >= p.dot_min_rows for m, _, _ in mms):
            continue
        if any(m >= 2 and not gemv_fits(m, n, k, p.num_warps) for m, n, k in mms):
            out.append((f.stem, e))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--limit", type=int, default=40, help="at most this many entries, spread over the kinds")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--entries", nargs="+", metavar="PREFIX", help="only the affected entries whose names start with one of these")
    args = ap.parse_args(argv)
    import torch

    from mirage_serve.tune.profile import profile_candidate

    found = affected_entries()
    if args.entries:
        found = [(n, e) for n, e in found if n.startswith(tuple(args.entries))]
    by_kind: dict[str, list] = {}
    for name, e in found:
        by_kind.setdefault(name.split("-")[0], []).append((name, e))
    picked = []
    while len(picked) < min(args.limit, len(found)):  # round-robin over the kinds
        for lst in by_kind.values():
            if lst and len(picked) < args.limit:
                picked.append(lst.pop(0))
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "affected": len(found), "entries": []}
    print(f"{len(found)} shipped entries change code under matmul='auto'; timing {len(picked)}", flush=True)
    for name, e in picked:
        row = {"entry": name}
        for label, params in (("auto", dict(e.params)), ("fma", {**e.params, "matmul": "fma"})):
            r = profile_candidate(e.graph, params, device="cuda", reps=args.reps)
            row[label] = {"passed": r.passed, "rel_error": r.rel_error, "median_us": r.median_us if r.passed else None, "error": r.error}
        a, f = row["auto"]["median_us"], row["fma"]["median_us"]
        row["fma_over_auto"] = f / a if a and f else None
        report["entries"].append(row)
        print(f"  {name:<48} auto {a if a else float('nan'):8.1f} us  fma {f if f else float('nan'):8.1f} us  "
              f"err {row['auto']['rel_error']:.1e}/{row['fma']['rel_error']:.1e}", flush=True)
        (Path(args.out) / "auto-matmul.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
