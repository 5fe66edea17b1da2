"""benchmarks/spill_audit.py reads registers and spills from ptxas for Hopper, without a GPU."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench
from handwritten import fused_rmsnorm_linear

from mirage_serve.codegen import CodegenParams, triton_gen
from mirage_serve.codegen.runtime import _plan, compile_for_target


@pytest.fixture(scope="module")
def A():
    return load_bench("spill_audit")


def test_parse_ptxas_report(A):
    report = """ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    1496 bytes stack frame, 1492 bytes spill stores, 1580 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16 bytes smem"""
    assert A.parse_ptxas(report) == {"registers": 255, "spill_stores": 1492, "spill_loads": 1580, "stack": 1496}
    assert A.parse_ptxas("ptxas info    : Used 40 registers")["spill_stores"] == 0


def test_the_loop_split_removes_a_one_row_gemv_spill_on_hopper(A, monkeypatch):
    try:
        A.ptxas_path()
    except SystemExit as e:
        pytest.skip(str(e))
    g = fused_rmsnorm_linear(1, 1024, 256, n_blocks=2, loop=2, dtype="bfloat16")  # (1, 128, 512) tiles: 512 products a thread
    p = CodegenParams()
    (split,) = (k for k in _plan(g, p).kernels if k is not None)
    monkeypatch.setattr(triton_gen, "MAX_AUTO_SPLIT", 1)
    (whole,) = (k for k in _plan(g, p).kernels if k is not None)
    assert "range(8)" in split.text and "range(2)" in whole.text
    s, w = (A.assemble(compile_for_target(k, params=p)) for k in (split, whole))
    assert s["spill_stores"] == 0 and s["registers"] <= 255
    assert w["spill_stores"] > 0, w
