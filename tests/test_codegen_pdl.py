"""Programmatic dependent launch: a kernel after the graph's first streams graph inputs in its loop
before it waits for the kernel before it; everything earlier kernels wrote is read after the wait."""

from __future__ import annotations

import pytest
import torch
from codegen_graphs import two_kernel_add_rmsnorm_linear

from mirage_serve import cmd_bench
from mirage_serve.codegen import CodegenParams, compile_graph, generate_source
from mirage_serve.codegen.aot import compile_to_ptx
from mirage_serve.reference import execute, random_inputs

V = cmd_bench.load_bench("kernels").V
WAIT, TRIGGER = "tl.extra.cuda.gdc_wait()", "tl.extra.cuda.gdc_launch_dependents()"


def _body(src: str) -> list[str]:
    return [line.strip() for line in src.split('"""')[2].strip().splitlines()]


def _lora(dtype: str = "float32"):
    # kernel 1: split-K X @ A^T partials; kernel 2: GEMV over W (loop) + partials and B after the loop
    return V.two_kernel_lora(3, 64, 32, 8, n_blocks=4, loop=2, xa_splits=2, xa_loop=2, dtype=dtype)


def test_second_kernel_loops_over_graph_inputs_before_its_wait():
    k0, k1 = generate_source(_lora(), CodegenParams(pdl=1))
    b0, b1 = _body(k0), _body(k1)
    assert b0[:2] == [WAIT, TRIGGER]  # the graph's first kernel may follow any kernel: it waits first
    assert b1[0] == TRIGGER and b1.count(WAIT) == 1
    loop, wait = b1.index("for i in range(2):"), b1.index(WAIT)
    assert loop < wait
    loads = {n: i for i, line in enumerate(b1) for n in range(4) if line.startswith("t") and f"tl.load(in{n}_ptr" in line}
    assert loads[0] < wait and loads[1] < wait  # X and W: graph inputs, streamed in the loop
    assert loads[2] > wait and loads[3] > wait  # B (only needed after the loop) and kernel 1's partials
    assert all(i > wait for i, line in enumerate(b1) if line.startswith("tl.store("))


def test_without_pdl_the_invariant_tiles_load_before_the_loop():
    _, k1 = generate_source(_lora())
    b1 = _body(k1)
    assert WAIT not in b1 and TRIGGER not in b1
    loop = b1.index("for i in range(2):")
    assert all(i < loop for i, line in enumerate(b1) if "tl.load(in3_ptr" in line)


def test_a_loop_over_an_earlier_kernels_output_waits_first():
    _, k1 = generate_source(two_kernel_add_rmsnorm_linear(4, 48, 24, n_blocks=3, loop=3), CodegenParams(pdl=1))
    assert _body(k1)[:2] == [WAIT, TRIGGER]  # its loop reads H, the first kernel's output


@pytest.mark.parametrize("params", [CodegenParams(pdl=1), CodegenParams(matmul="dot", dot_precision="input", pdl=1, num_stages=3)],
                         ids=["fma", "dot"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pdl_lora_matches_reference(dtype, params):
    g = _lora(dtype)
    cg = compile_graph(g, params)
    ins = random_inputs(g, torch.Generator().manual_seed(1))
    ref = execute(g, ins)[0]
    for n in (3, 1):
        small = [x[:n].contiguous() if i in cg.row_inputs else x for i, x in enumerate(ins)]
        out = cg(*small)[0]
        err = float((out.double() - ref[:n]).abs().max() / ref[:n].abs().max())
        assert err < (2e-2 if dtype == "bfloat16" else 2e-5), (n, err)


def test_pdl_lora_compiles_to_hopper_ptx():
    params = CodegenParams(matmul="dot", dot_precision="input", pdl=1, num_stages=3)
    sources = compile_graph(V.two_kernel_lora(16, 256, 128, 16, n_blocks=4, loop=2, xa_splits=2, xa_loop=1, dtype="bfloat16"),
                            params).kernel_sources
    ptxs = compile_to_ptx(sources, arch=90, num_stages=3, launch_pdl=True)
    for ks, ptx in zip(sources, ptxs, strict=True):
        assert f".entry {ks.name}" in ptx and "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
