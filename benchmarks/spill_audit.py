"""Registers, spills and shared memory of the shipped cache's kernels for Hopper, without a GPU.

Each chosen shipped entry's kernels are generated as they run (its own codegen parameters, the KV
length as a variable extent for decode attention), compiled by Triton for ``sm_90a`` and assembled
by Triton's own ``ptxas -v``, whose report gives registers, spill stores / loads and shared memory
a kernel. ``--forms split,nosplit`` sets the code of ``matmul="auto"`` as it is beside the same code
without its loop split (``triton_gen.MAX_AUTO_SPLIT = 1``: a GEMV whose broadcast product spills
stays as it is), so the two forms show what the split changes. A GPU times them
(``auto_matmul_probe.py``); this only reads what the assembler allocates.

Usage (CPU): ``python benchmarks/spill_audit.py --out DIR [--entries PREFIX ...] [--limit N]
[--forms split,nosplit] [--all]``: by default the entries whose code the split changes; ``--all``
every shipped entry. Writes spill-audit.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from auto_matmul_probe import shipped_entries  # noqa: E402

FORMS = ("split", "nosplit")
_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def ptxas_path(arch: int = 90) -> str:
    """The ptxas Triton's CUDA backend assembles ``sm_<arch>`` code with."""
    from triton.backends.nvidia.compiler import get_ptxas

    p = get_ptxas(arch).path
    if not p or not Path(p).is_file():
        raise SystemExit(f"no ptxas at {p!r}: this Triton has no CUDA assembler")
    return p


def parse_ptxas(report: str) -> dict[str, int]:
    """Registers, spill bytes and stack frame of the one function in a ``ptxas -v`` report."""
    out = {}
    for k, rx in _RE.items():
        m = rx.search(report)
        out[k] = int(m.group(1)) if m else 0
    return out


def assemble(ptx: str, arch: str = "sm_90a") -> dict[str, int]:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas_path(), f"-arch={arch}", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                              capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {proc.stderr[-2000:]}")
    return parse_ptxas(proc.stderr + proc.stdout)


def _variable_dims(e) -> tuple:
    from mirage_serve.integrations.kernels import VARIABLE_EXTENTS

    ext = VARIABLE_EXTENTS.get(e.key.spec)
    return ext.dims if ext else ()


def _kernels(e, form: str):
    """(KernelSource, params) of ``e``'s kernels in ``form``."""
    from mirage_serve.codegen import triton_gen
    from mirage_serve.codegen.params import CodegenParams
    from mirage_serve.codegen.runtime import _plan

    p = CodegenParams(**e.params)
    saved = triton_gen.MAX_AUTO_SPLIT
    try:
        if form == "nosplit":
            triton_gen.MAX_AUTO_SPLIT = 1
        plan = _plan(e.graph, p, _variable_dims(e))
    finally:
        triton_gen.MAX_AUTO_SPLIT = saved
    return [k for k in plan.kernels if k is not None], p


def split_entries(entries=None) -> list[tuple[str, object]]:
    """Shipped entries whose code ``matmul="auto"``'s loop split changes."""
    out = []
    for name, e in entries if entries is not None else shipped_entries():
        a, _ = _kernels(e, "split")
        b, _ = _kernels(e, "nosplit")
        if [k.text for k in a] != [k.text for k in b]:
            out.append((name, e))
    return out


def audit(name: str, e, forms: list[str]) -> dict:
    from mirage_serve.codegen.runtime import compile_for_target
    from mirage_serve.tune.space import tile_matmuls

    row = {"entry": name, "spec": e.key.spec, "dims": dict(e.key.dims), "dtype": e.key.dtype, "params": e.params,
           "tile_matmuls": [list(m) for m in tile_matmuls(e.graph)], "forms": {}}
    for form in forms:
        ks, p = _kernels(e, form)
        kern = []
        for k in ks:
            t0 = time.perf_counter()
            st = assemble(compile_for_target(k, params=p))
            st["compile_s"] = round(time.perf_counter() - t0, 2)
            st["tl_dot"] = k.text.count("tl.dot(")
            st["loop"] = int(m.group(1)) if (m := re.search(r"for i in range\((\d+)\)", k.text)) else 1
            kern.append(st)
        row["forms"][form] = {"kernels": kern, "spill_bytes": sum(k["spill_stores"] + k["spill_loads"] for k in kern)}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--entries", nargs="+", metavar="PREFIX", help="only entries whose names start with one of these")
    ap.add_argument("--all", action="store_true", help="every shipped entry, not only those the loop split changes")
    ap.add_argument("--limit", type=int, default=0, help="at most this many entries (0: all chosen)")
    ap.add_argument("--forms", default="split,nosplit", help=f"comma-separated, of {', '.join(FORMS)}")
    args = ap.parse_args(argv)
    forms = args.forms.split(",")
    if not forms or any(f not in FORMS for f in forms):
        ap.error(f"--forms {args.forms!r}: use a comma-separated list of {', '.join(FORMS)}")
    os.environ.pop("TRITON_INTERPRET", None)
    entries = shipped_entries()
    if args.entries:
        entries = [(n, e) for n, e in entries if n.startswith(tuple(args.entries))]
    chosen = entries if args.all else split_entries(entries)
    if args.limit:
        chosen = chosen[: args.limit]
    print(f"{len(chosen)} entries, forms {forms}", flush=True)
    import triton

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = {"target": "sm_90a", "triton": triton.__version__,
            "ptxas": subprocess.run([ptxas_path(), "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1],
            "date": time.strftime("%Y-%m-%d"), "forms": forms}
    rows = []
    for i, (name, e) in enumerate(chosen):
        row = audit(name, e, forms)
        rows.append(row)
        (out / "spill-audit.json").write_text(json.dumps({**head, "done": len(rows), "of": len(chosen), "entries": rows}, indent=1))
        print(f"[{i + 1}/{len(chosen)}] {name} {row['tile_matmuls']}: "
              + ", ".join(f"{f} {row['forms'][f]['spill_bytes']} B spilled, regs "
                          f"{[k['registers'] for k in row['forms'][f]['kernels']]}, loop {[k['loop'] for k in row['forms'][f]['kernels']]}"
                          for f in forms), flush=True)
    summary = {f: Counter("spills" if r["forms"][f]["spill_bytes"] else "no spill" for r in rows) for f in forms}
    (out / "spill-audit.json").write_text(json.dumps({**head, "done": len(rows), "of": len(chosen),
                                                      "summary": {f: dict(c) for f, c in summary.items()}, "entries": rows}, indent=1))
    for f in forms:
        print(f"{f}: {dict(summary[f])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
