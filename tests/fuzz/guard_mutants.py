"""Remove one verifier guard at a time and list the adversary tests that then fail.

``python tests/fuzz/guard_mutants.py [--json out.json]``: for each guard, a scratch copy
of ``mirage_serve/`` and ``tests/`` (in a temporary folder) gets the one-line change that
removes it, and the adversary tests (``tests/test_reliability_verify.py``,
``tests/test_verify_adversarial.py``) run against that copy. A guard that no test misses
is a gap. Not collected by pytest (about a minute on two cores)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/test_reliability_verify.py", "tests/test_verify_adversarial.py"]

# guard -> (file, the line that implements it, the line that removes it)
MUTANTS = {
    "uniformly random inputs (drawn from {0..3} instead)": (
        "mirage_serve/verify/finite_field.py",
        "p = torch.randint(0, ctx.p, shape, generator=gp, dtype=torch.float64)",
        "p = torch.randint(0, 4, shape, generator=gp, dtype=torch.float64)"),
    "element-wise comparison (output sums instead)": (
        "mirage_serve/verify/finite_field.py",
        "        ne = x != y\n",
        "        ne = (x.sum() != y.sum()).reshape(1)\n"),
    "max returns fresh random values (zeros instead)": (
        "mirage_serve/verify/field.py",
        "        return FieldValue(p, q, \"not tracked\")\n",
        "        return FieldValue(torch.zeros_like(p), None if q is None else torch.zeros_like(q), \"not tracked\")\n"),
    "float check in working precision (skipped)": (
        "mirage_serve/verify/certificate.py",
        'if res.verdict in ("equivalent", "unknown") and float_check:',
        "if False:"),
}


def run_mutant(path: str, old: str, new: str) -> tuple[list[str], str]:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for sub in ("mirage_serve", "tests"):
            shutil.copytree(ROOT / sub, d / sub, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", d / "pyproject.toml")
        f = d / path
        text = f.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{path}: the guard's line is not there once (the verifier changed?): {old!r}")
        f.write_text(text.replace(old, new))
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfX", *TESTS], cwd=d,
                           env={**os.environ, "PYTHONPATH": str(d)}, capture_output=True, text=True, check=False)
    failed = sorted({line.split("::", 1)[1].split(" ")[0] for line in r.stdout.splitlines() if line.startswith(("FAILED", "XPASS"))})
    return failed, (r.stdout.strip().splitlines() or [""])[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    out = {}
    for guard, (path, old, new) in MUTANTS.items():
        failed, summary = run_mutant(path, old, new)
        out[guard] = {"file": path, "failing_tests": failed, "pytest": summary}
        print(f"{guard}: {len(failed)} adversary test(s) fail: {', '.join(failed) or 'NONE (a gap)'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(v["failing_tests"] for v in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
