"""``mirage-serve bench``: run the benchmark scripts of ``benchmarks/``.

Each benchmark is a script in the repository's ``benchmarks/`` folder exposing
``add_arguments(parser)`` and ``run(args) -> int``; add one by adding a line to
:data:`BENCHES`. The scripts are loaded by path, since ``benchmarks/`` is not
part of the installed package: run from a source checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"

# subcommand -> (script in benchmarks/, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "kernels": ("kernels.py", "fused kernels vs eager, CUDA graphs, torch.compile, cuBLAS and the bandwidth floor"),
    "e2e": ("e2e.py", "end-to-end decode latency of patched and unpatched models"),
}


def load_bench(name: str) -> ModuleType:
    """Import ``benchmarks/<script>`` for subcommand ``name``; FileNotFoundError says where it was looked for."""
    script = BENCH_DIR / BENCHES[name][0]
    if not script.is_file():
        raise FileNotFoundError(f"benchmark script {script} not found: run `mirage-serve bench` from a source checkout")
    mod_name = f"mirage_bench_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for name, (script, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            load_bench(name).add_arguments(p)
        except FileNotFoundError:
            p.set_defaults(_bench_missing=str(BENCH_DIR / script))


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "bench", None):
        print(f"mirage-serve bench: name a benchmark: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    missing = getattr(args, "_bench_missing", None)
    if missing:
        print(f"mirage-serve bench {args.bench}: {missing} is not there (not written yet, or not a source checkout)", file=sys.stderr)
        return 2
    return int(load_bench(args.bench).run(args) or 0)
