"""``python -m mirage_serve.fuzz --minutes N --seed S``: run the differential fuzzer."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mirage_serve.fuzz", description=__doc__)
    p.add_argument("--minutes", type=float, default=None, help="stop after this many minutes")
    p.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default="program,kernel,block", help="comma-separated: program, kernel, block")
    p.add_argument("--no-codegen", action="store_true", help="skip the generated kernels")
    p.add_argument("--no-verifier", action="store_true", help="skip the finite-field verifier")
    p.add_argument("--out", type=Path, default=None, help="write minimised findings here (one JSON file each)")
    p.add_argument("--report", type=Path, default=None, help="write the counts and findings as JSON here")
    p.add_argument("--minimise-s", type=float, default=60.0, help="seconds spent minimising one finding")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--summarise", type=Path, nargs="+", metavar="REPORT", help="print the tables of --report files (added up) and exit")
    args = p.parse_args(argv)
    if args.summarise:
        return summarise(args.summarise)
    if args.minutes is None and args.cases is None:
        p.error("give --minutes or --cases")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("mirage_serve.verify").setLevel(logging.ERROR)  # one line per verification otherwise
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # NaN/Inf arithmetic is what faults do
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from mirage_serve.fuzz.runner import FuzzConfig, format_report, run_fuzz

    cfg = FuzzConfig(seed=args.seed, minutes=args.minutes, max_cases=args.cases, codegen=not args.no_codegen,
                     verifier=not args.no_verifier, out_dir=args.out, minimise_s=args.minimise_s,
                     kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()))
    report = run_fuzz(cfg)
    print(format_report(report))
    if args.report:
        args.report.write_text(json.dumps(report.to_obj(), indent=1, sort_keys=True, default=str) + "\n")
    return 1 if report.findings else 0


def summarise(paths: list[Path]) -> int:
    """One row per run, then the added-up tables of :func:`~mirage_serve.fuzz.runner.format_report`."""
    from mirage_serve.fuzz.runner import FuzzReport, format_report, merge_reports

    reports = [FuzzReport.from_obj(json.loads(p.read_text())) for p in paths]
    print("| report | seed | cases | graphs | faults injected | findings | wall (min) | graphs/min |")
    print("|---|---|---|---|---|---|---|---|")
    for p, r in zip(paths, reports, strict=True):
        n = sum(r.graphs.values())
        print(f"| {p.name} | {r.config.get('seed')} | {sum(r.cases.values())} | {n} | {r.faults} | {len(r.findings)} | "
              f"{r.elapsed_s / 60:.1f} | {n / max(r.elapsed_s / 60, 1e-9):.0f} |")
    print()
    print(format_report(merge_reports(reports)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
