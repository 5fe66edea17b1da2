"""Scripts under benchmarks/ loaded as modules for their tests (benchmarks/ is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def load_bench(script: str, module_name: str | None = None) -> ModuleType:
    """``benchmarks/<script>.py`` as a fresh module named ``module_name`` (default: the script's name)."""
    spec = importlib.util.spec_from_file_location(module_name or script, BENCH / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
