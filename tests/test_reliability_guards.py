"""Run-time guards of cached kernels: NaN/Inf in inputs propagate exactly as in the
reference (never as silent zeros) through the reference backend and the generated
kernel (Triton interpreter on CPU); the spot check disables a wrong kernel (and only
the spot check stands between that kernel and the caller); thousands of calls leak no
memory; repeated CUDA-graph captures leak no device memory (GPU only)."""

from __future__ import annotations

import gc
import logging
import os
import resource

import pytest
import torch
from handwritten import fused_rmsnorm_linear, split_kv_attention

from mirage_serve.codegen import compile_graph
from mirage_serve.integrations.kernels import CachedKernel
from mirage_serve.mugraph import BlockBuilder, GraphBuilder
from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec

DIMS = {"batch": 4, "hidden": 32, "out": 16}


def _rmsnorm_kernel(backend: str, graph=None, eps: float = 1e-6) -> CachedKernel:
    spec = build_spec("rmsnorm_linear", DIMS, "float32", eps=eps)
    graph = graph if graph is not None else fused_rmsnorm_linear(4, 32, 16, n_blocks=2, loop=2, eps=eps)
    return CachedKernel("rmsnorm_linear", graph, spec, 4, f"test-{backend}-{id(graph)}", backend)


def _inputs(seed: int = 0) -> list[torch.Tensor]:
    spec = build_spec("rmsnorm_linear", DIMS, "float32")
    return random_inputs(spec, torch.Generator().manual_seed(seed))


def _poisoned(seed: int = 0) -> list[torch.Tensor]:
    x, gn, w = _inputs(seed)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    w[7, 0] = float("-inf")
    return [x, gn, w]


def _same_nonfinite(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (torch.isnan(out).int(), torch.isnan(ref).int())
    inf = torch.isinf(ref)
    assert torch.equal(out[inf].double(), ref[inf])
    fin = torch.isfinite(ref)
    assert torch.isfinite(out[fin]).all()
    assert torch.allclose(out[fin].double(), ref[fin], rtol=rtol, atol=1e-5)


@pytest.fixture
def no_check(monkeypatch):
    monkeypatch.setenv("MIRAGE_SERVE_CHECK", "0")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_nan_and_inf_inputs_propagate_as_in_the_reference(backend, no_check):
    kernel = _rmsnorm_kernel(backend)
    ins = _poisoned()
    ref = execute(kernel.spec, [x.double() for x in ins])[0]
    # the reference itself: a NaN or an Inf in a row of X poisons that row, a -inf in W its column
    assert torch.isnan(ref[1]).all() and torch.isnan(ref[2]).all() and not torch.isfinite(ref[:, 7]).any()
    assert torch.isfinite(ref[[0, 3]][:, [c for c in range(16) if c != 7]]).all()
    (out,) = kernel(ins)
    assert kernel.disabled is None
    _same_nonfinite(out, ref)
    assert not (out[torch.isnan(ref)] == 0).any()  # never silent zeros


def test_nan_in_fewer_rows_than_the_bucket_is_not_padded_away(no_check):
    kernel = _rmsnorm_kernel("reference")
    x, gn, w = _inputs(3)
    x = x[:3].clone()
    x[2, 0] = float("nan")
    (out,) = kernel([x, gn, w])
    assert out.shape == (3, 16) and torch.isnan(out[2]).all() and torch.isfinite(out[:2]).all()


def test_nan_and_inf_through_the_generated_attention_kernel():
    g = split_kv_attention(2, 4, 2, 8, 16, splits=2, loop=2)
    ins = random_inputs(g, torch.Generator().manual_seed(0))
    ins[1][0, 3, 2] = float("nan")
    ins[1][2, 5, 0] = float("inf")
    ins[2][1, 7, 1] = float("-inf")
    ref = execute(g, [x.double() for x in ins])[0]
    assert torch.isnan(ref).any() and torch.isinf(ref).any()
    _same_nonfinite(compile_graph(g)(*ins)[0], ref, rtol=1e-4)


def _max_graph(kind: str) -> tuple:
    g = GraphBuilder()
    if kind == "running max":  # max_last over a loop of two chunks: tl.maximum of the chunks' maxima
        x = g.input("X", (4, 16))
        b = BlockBuilder((2,), 2)
        b.output(b.accum("max_last", b.input(0, (0,), 1)), (0,))
    else:  # one max reduction over the tile's last dim (12 of 16 columns: the padding lanes are masked)
        x = g.input("X", (4, 12))
        b = BlockBuilder((2,), 1)
        b.output(b.reduce("max", b.input(0, (0,), -1), 1), (0,))
    (m,) = g.customized([x], b.build())
    return g.build([m])


@pytest.mark.parametrize("kind", ["running max", "max reduction"])
def test_nan_reaching_a_max_propagates_through_the_generated_kernel(kind):
    graph = _max_graph(kind)
    x = torch.randn(*graph.info[0].shape, generator=torch.Generator().manual_seed(1))
    x[1, 9] = float("nan")
    ref = execute(graph, [x.double()])[0]
    assert torch.isnan(ref[1]).all() and torch.isfinite(ref[[0, 2, 3]]).all()
    out = compile_graph(graph)(x)[0]
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), out


# -- the spot check ---------------------------------------------------------------------------------


def _wrong_graph():
    """RMSNorm→linear that forgets the RMSNorm gain: right shapes, wrong function."""
    g = GraphBuilder()
    x, _, w = g.input("X", (4, 32)), g.input("G", (32,)), g.input("W", (16, 32))
    b = BlockBuilder((2,), 2)
    tx, tw = b.input(0, (-1,), 1), b.input(1, (0,), 1)
    acc = b.accum("sum", b.matmul(tx, tw, trans_b=True))
    ms = b.accum("mean_sq_last", tx)
    b.output(b.binary("mul", acc, b.unary("rsqrt", b.unary("add_scalar", ms, scalar=1e-6))), (1,))
    (y,) = g.customized([x, w], b.build())
    return g.build([y])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_spot_check_disables_a_wrong_kernel(backend, monkeypatch, caplog):
    ins = _inputs(5)
    monkeypatch.setenv("MIRAGE_SERVE_CHECK", "0")
    unguarded = _rmsnorm_kernel(backend, _wrong_graph())
    (out,) = unguarded(ins)  # without the guard the wrong result reaches the caller
    want = execute(unguarded.spec, [x.double() for x in ins])[0]
    assert float((out.double() - want).norm() / want.norm()) > 0.05
    monkeypatch.setenv("MIRAGE_SERVE_CHECK", "1")
    kernel = _rmsnorm_kernel(backend, _wrong_graph())
    runs = []
    real_run = kernel._run
    monkeypatch.setattr(kernel, "_run", lambda inputs: runs.append(1) or real_run(inputs))
    with caplog.at_level(logging.WARNING, logger="mirage_serve"):
        assert kernel(ins) is None
        assert kernel(ins) is None and kernel(_inputs(6)) is None
    assert kernel.disabled and "spot check" in kernel.disabled and kernel.calls == 0
    assert len(runs) == 1  # disabled kernels are not run again
    assert any("disabled" in r.getMessage() for r in caplog.records)
    # the same entry with the right graph passes its check and keeps serving
    good = _rmsnorm_kernel(backend)
    assert good(ins) is not None and good(_inputs(6)) is not None and good.disabled is None and good.calls == 2


def test_spot_check_on_nan_inputs_keeps_a_correct_kernel(monkeypatch):
    monkeypatch.setenv("MIRAGE_SERVE_CHECK", "1")
    kernel = _rmsnorm_kernel("reference")
    assert kernel(_poisoned()) is not None
    assert kernel.disabled is None


@pytest.mark.parametrize("fault", ["NaN turned into zeros", "NaN where the spec is finite", "Inf turned into a number"])
def test_spot_check_disables_a_kernel_with_the_wrong_nan_or_inf(monkeypatch, fault):
    monkeypatch.setenv("MIRAGE_SERVE_CHECK", "1")
    kernel = _rmsnorm_kernel("reference")
    real_run = kernel._run

    def faulty(inputs, lengths=None):
        (out,) = real_run(inputs, lengths)
        out = out.clone()
        if fault == "NaN turned into zeros":
            out = torch.nan_to_num(out, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        elif fault == "NaN where the spec is finite":
            out[0, 0] = float("nan")
        else:
            out[torch.isinf(out)] = 1.0
        return [out]

    monkeypatch.setattr(kernel, "_run", faulty)
    ins = _inputs(0) if fault == "NaN where the spec is finite" else _poisoned()
    want = execute(kernel.spec, [x.double() for x in ins])[0]
    assert torch.isfinite(want).all() if fault == "NaN where the spec is finite" else (torch.isnan(want).any() and torch.isinf(want).any())
    assert kernel(ins) is None
    assert kernel.disabled and "NaN/Inf" in kernel.disabled


# -- memory -----------------------------------------------------------------------------------------


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _rss_kb() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


@pytest.fixture
def one_thread():
    """Tiny kernels: one intra-op thread is several times faster on shared cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
@pytest.mark.parametrize("backend, calls", [("reference", 5000), ("triton", 200)])  # the interpreter takes ~50 ms a call
def test_many_calls_leak_no_memory(backend, calls, monkeypatch, one_thread):
    monkeypatch.setenv("MIRAGE_SERVE_CHECK", "1")
    kernel = _rmsnorm_kernel(backend)
    ins = _inputs(7)
    short = [x[:3].clone() if j == 0 else x for j, x in enumerate(ins)]
    for _ in range(20):  # warm up: compile, first-call check, allocator pools
        kernel(ins), kernel(short)
    tensors, rss = _live_tensors(), _rss_kb()
    for i in range(calls):
        outs = kernel(ins if i % 2 else short)
        assert outs is not None
    del outs
    grown_mb = (_rss_kb() - rss) / 1024
    assert _live_tensors() <= tensors + 2
    assert grown_mb < 16, f"RSS grew by {grown_mb:.1f} MB over {calls} calls"
    assert kernel.calls == calls + 40 and kernel.disabled is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="CUDA-graph capture needs a GPU and compiled kernels (TRITON_INTERPRET=0)")
def test_repeated_cuda_graph_captures_leak_no_device_memory():
    graph = fused_rmsnorm_linear(4, 256, 128, n_blocks=4, loop=4)
    cg = compile_graph(graph)
    ins = [x.cuda() for x in random_inputs(graph, torch.Generator().manual_seed(0))]
    ref = execute(graph, [x.double().cpu() for x in ins])[0]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            cg(*ins)  # compile and warm up outside capture
    torch.cuda.synchronize()

    def capture_and_replay():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = cg(*ins)[0]
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out.double().cpu(), ref, rtol=1e-3, atol=1e-3)
        del g, out

    for _ in range(3):
        capture_and_replay()
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(50):
        capture_and_replay()
    gc.collect()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert grown <= 1 << 20, f"device memory grew by {grown} bytes over 50 captures"


def test_no_swapped_dot_where_a_max_reads_a_matmul():
    # with dot_swap=1 in a cache entry's parameters, attention (whose running max reads Q Kᵀ) is still
    # generated in the plain orientation, which the H200 runs right; other kernels keep the swap
    from mirage_serve.codegen import CodegenParams, generate_source

    p = CodegenParams(matmul="dot", dot_swap=1, dot_min_rows=1)
    attention = generate_source(split_kv_attention(2, 4, 2, 16, 64, splits=2, loop=2), p)
    linear = generate_source(fused_rmsnorm_linear(16, 64, 32, 2, 2), p)
    assert sum(t.count("tl.dot(") for t in attention) == 2 and not any("tl.trans(tl.dot(" in t for t in attention)
    assert any("tl.trans(tl.dot(" in t for t in linear)
