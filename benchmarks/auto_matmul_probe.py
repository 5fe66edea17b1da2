"""The shipped kernel cache at default codegen parameters: GEMV math against ``tl.dot`` where the GEMV
product would spill.

Entries built without a GPU (``kernel_cache/entries``) carry no tuned parameters and compile with
``CodegenParams()`` defaults, whose ``matmul="auto"`` takes tile matmuls of 2-15 rows with
``tl.dot`` wherever the GEMV form's broadcast product would not fit the registers (and the dot's
tiles fit shared memory; ``codegen.params.gemv_fits``), and splits the loop's iterations where
GEMV math would still spill (``codegen.triton_gen.loop_split``). This times, for every shipped entry
where those rules change the code, the entry as it is now (``auto``) beside the GEMV form it had
before (``matmul="fma"``), both float-checked against the float64 reference, under CUDA graphs.

``--forms auto,tf32 --any-entry --entries PREFIX ...`` times chosen entries as they are beside their
code with tf32 operands on every ``tl.dot``, as 16-bit graphs compiled before ``dot_precision="auto"``
multiplied 16-bit inputs natively.

Usage (GPU): ``python benchmarks/auto_matmul_probe.py --out DIR [--limit N] [--entries PREFIX ...]
[--any-entry] [--forms auto,fma,tf32]`` (writes auto-matmul.json).
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

#: Forms an entry is timed in: its own parameters, then overrides. ``fma``: GEMV math for every tile
#: matmul (the code before the auto rule); ``tf32``: every ``tl.dot`` on tf32 operands (the code of
#: 16-bit graphs before ``dot_precision="auto"`` multiplied 16-bit inputs natively).
FORMS = {"auto": {}, "fma": {"matmul": "fma"}, "tf32": {"dot_precision": "tf32"}}


def shipped_entries(entries_dir: Path = ROOT / "kernel_cache" / "entries") -> list[tuple[str, CacheEntry]]:
    """Every shipped entry by name; built for the CPU's Triton, so read as stale and regenerated here."""
    return [(f.stem, CacheEntry.from_obj(json.loads(f.read_text()), allow_stale=True)) for f in sorted(entries_dir.glob("*.json"))]


def affected_entries(entries_dir: Path = ROOT / "kernel_cache" / "entries") -> list[tuple[str, CacheEntry]]:
    """Shipped entries whose default-parameter code the ``auto`` rules moved off plain GEMV math: every
    tile matmul has fewer than ``dot_min_rows`` rows, so that ``matmul="fma"`` is exactly the code such
    an entry compiled to before, and the ``auto`` code differs from it: it uses ``tl.dot`` (a GEMV
    product that would not fit the registers, with dot tiles that fit shared memory: ``gemv_fits``),
    or splits the loop's iterations so that GEMV math fits the registers (``triton_gen.loop_split``)."""
    from mirage_serve.codegen.params import CodegenParams
    from mirage_serve.codegen.runtime import generate_source

    out = []
    for name, e in shipped_entries(entries_dir):
        if e.params.get("matmul", "auto") != "auto":
            continue
        p = CodegenParams(**e.params)
        if any(m >= p.dot_min_rows for m, _, _ in tile_matmuls(e.graph)):
            continue
        if generate_source(e.graph, p) != generate_source(e.graph, CodegenParams(**{**e.params, "matmul": "fma"})):
            out.append((name, e))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--limit", type=int, default=40, help="at most this many entries, spread over the kinds")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--entries", nargs="+", metavar="PREFIX", help="only the affected entries whose names start with one of these")
    ap.add_argument("--any-entry", action="store_true",
                    help="--entries picks among all shipped entries, not only those the auto rule moved off GEMV math")
    ap.add_argument("--forms", default="auto,fma", help=f"comma-separated, of {', '.join(FORMS)}")
    args = ap.parse_args(argv)
    forms = args.forms.split(",")
    if not forms or any(f not in FORMS for f in forms):
        ap.error(f"--forms {args.forms!r}: use a comma-separated list of {', '.join(FORMS)}")
    if args.any_entry and not args.entries:
        ap.error("--any-entry needs --entries")
    import torch

    from mirage_serve.tune.profile import profile_candidate

    found = shipped_entries() if args.any_entry else affected_entries()
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
    report["forms"] = {f: FORMS[f] for f in forms}
    what = "selected" if args.any_entry else "change code under matmul='auto'"
    print(f"{len(found)} shipped entries {what}; timing {len(picked)} as {', '.join(forms)}", flush=True)
    for name, e in picked:
        row = {"entry": name}
        for label in forms:
            r = profile_candidate(e.graph, {**e.params, **FORMS[label]}, device="cuda", reps=args.reps)
            row[label] = {"passed": r.passed, "rel_error": r.rel_error, "median_us": r.median_us if r.passed else None, "error": r.error}
        a = row[forms[0]]["median_us"]
        for label in forms[1:]:
            f = row[label]["median_us"]
            row[f"{label}_over_{forms[0]}"] = f / a if a and f else None
        report["entries"].append(row)
        cols = "  ".join(f"{label} {row[label]['median_us'] or float('nan'):8.1f} us" for label in forms)
        errs = "/".join(f"{row[label]['rel_error']:.1e}" for label in forms)
        print(f"  {name:<48} {cols}  err {errs}", flush=True)
        (Path(args.out) / "auto-matmul.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
