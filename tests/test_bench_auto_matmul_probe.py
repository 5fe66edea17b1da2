"""benchmarks/auto_matmul_probe.py picks exactly the shipped entries whose code the ``matmul="auto"``
rule moved from GEMV math to ``tl.dot``, so that its ``fma`` form is the code they had before."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mirage_serve.codegen.params import CodegenParams
from mirage_serve.codegen.runtime import generate_source

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def P():
    spec = importlib.util.spec_from_file_location("auto_matmul_probe", BENCH / "auto_matmul_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_affected_entries_are_those_the_rule_moved_to_dot(P):
    found = P.affected_entries()
    assert found, "the shipped cache has entries with 2-15-row tile matmuls too large for GEMV registers"
    names = {n for n, _ in found}
    for name, e in found:
        p = CodegenParams(**e.params)
        mms = P.tile_matmuls(e.graph)
        assert all(m < p.dot_min_rows for m, _, _ in mms), name
        auto = "\n".join(generate_source(e.graph, p))
        fma = "\n".join(generate_source(e.graph, CodegenParams(**{**e.params, "matmul": "fma"})))
        assert "tl.dot" in auto and "tl.dot" not in fma, name
    # an entry with only small products (or one-row matmuls) keeps GEMV math and is not picked
    all_entries = sorted((BENCH.parent / "kernel_cache" / "entries").glob("*.json"))
    assert len(names) < len(all_entries)


def test_tile_matmuls_reads_rows_columns_inner(P):
    from handwritten import fused_rmsnorm_linear

    # 4 rows; 128 outputs over 4 blocks = 32 columns; 256 hidden over 2 iterations = 128 inner
    assert P.tile_matmuls(fused_rmsnorm_linear(4, 256, 128, n_blocks=4, loop=2)) == [(4, 32, 128)]
