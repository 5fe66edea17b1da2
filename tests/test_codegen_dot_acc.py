"""``dot_acc``: a tensor-core matmul summed by an accumulator accumulates in the MMA itself
(``acc = tl.dot(a, b, acc)``), in both MMA orientations, plain and rescaled (online softmax); and the
two-kernel RMSNorm -> linear schedule (rows normalised first, then a plain tiled matmul). Under
Triton's interpreter against float64, and for sm_90."""

from __future__ import annotations

import re

import pytest
import torch
from handwritten import fused_lora, fused_rmsnorm_linear, split_kv_attention

from mirage_serve import cmd_bench
from mirage_serve.codegen import CodegenParams, compile_graph, generate_source
from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec

V = cmd_bench.load_bench("kernels").V
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
DOT = dict(matmul="dot", dot_precision="input", num_stages=3)


def _check(graph, dtype: str, params: CodegenParams, n_rows: int | None = None, variable_dims=(), spec=None) -> list[str]:
    cg = compile_graph(graph, params, variable_dims)
    ins = random_inputs(graph, torch.Generator().manual_seed(3))
    refs = execute(spec if spec is not None else graph, ins, dtype=torch.float64)
    if n_rows is not None:
        ins = [x[:n_rows].clone() if i in cg.row_inputs else x for i, x in enumerate(ins)]
        refs = [r[:n_rows] for r in refs]
    for y, r in zip(cg(*ins), refs, strict=True):
        err = float((y.double() - r).abs().max() / r.abs().max().clamp_min(1e-30))
        assert err < TOL[dtype], err
    return cg.sources


def _graphs(dtype: str):
    return {
        "rmsnorm_linear": fused_rmsnorm_linear(16, 64, 32, n_blocks=2, loop=4, dtype=dtype),
        "lora": fused_lora(16, 64, 32, 8, n_blocks=2, loop=2, dtype=dtype),
        "norm_then_linear": V.norm_then_linear(16, 64, 48, n_blocks=3, loop=2, norm_blocks=4, dtype=dtype),
        "attention": split_kv_attention(2, 32, 2, 16, 96, splits=3, loop=2, dtype=dtype),
    }


@pytest.mark.parametrize("swap", [0, 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["rmsnorm_linear", "lora", "norm_then_linear", "attention"])
def test_dot_acc_matches_reference(name, dtype, swap):
    srcs = _check(_graphs(dtype)[name], dtype, CodegenParams(**DOT, dot_swap=swap, dot_acc=1))
    text = "\n".join(srcs)
    fused = re.findall(r"(acc\d+) = tl\.dot\(.*, \1(?: \* alpha\d+\[[^\]]*\])?(?:, input_precision=\"\w+\")?\)", text)
    assert fused, text  # the MMA accumulates into the accumulator
    swapped = swap and name != "attention"  # a dot into the running max is never swapped
    assert (f"{fused[0]} = tl.trans({fused[0]})" in text) == bool(swapped)


def test_dot_acc_rescaled_sum_in_attention():
    (src, _) = generate_source(split_kv_attention(2, 32, 2, 16, 96, splits=3, loop=2), CodegenParams(**DOT, dot_acc=1))
    assert re.search(r"(acc\d+) = tl\.dot\(.*, \1 \* alpha\d+\[:, None\]", src), src


def test_dot_acc_off_keeps_the_separate_add():
    (src,) = generate_source(fused_rmsnorm_linear(16, 64, 32, n_blocks=2, loop=4), CodegenParams(**DOT))
    assert re.search(r"acc\d+ \+= t\d+", src) and not re.search(r"(acc\d+) = tl\.dot\(.*\1\)", src)


def test_dot_acc_leaves_fma_and_shared_matmuls_alone():
    (src,) = generate_source(fused_rmsnorm_linear(16, 64, 32, n_blocks=2, loop=4), CodegenParams(matmul="fma", dot_acc=1))
    assert "tl.dot" not in src and re.search(r"acc\d+ \+= t\d+", src)


def test_dot_acc_smaller_batch_than_bucket():
    _check(_graphs("bfloat16")["norm_then_linear"], "bfloat16", CodegenParams(**DOT, dot_swap=1, dot_acc=1, pdl=1), n_rows=5)


def test_dot_acc_params_round_trip_and_key():
    p = CodegenParams(dot_acc=1)
    assert p.cache_params() == {"dot_acc": 1} and CodegenParams.from_dict(p.cache_params()) == p
    assert CodegenParams().key() == CodegenParams(dot_acc=0).key() != p.key()
    with pytest.raises(ValueError, match="dot_acc"):
        CodegenParams(dot_acc=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norm_then_linear_is_the_rmsnorm_linear_spec(dtype):
    """Two kernels: the normalised rows in the graph's dtype, then the matmul; compared with the spec's reference."""
    spec = build_spec("rmsnorm_linear", {"batch": 16, "hidden": 64, "out": 48}, dtype=dtype)
    g = V.norm_then_linear(16, 64, 48, n_blocks=3, loop=2, norm_blocks=4, dtype=dtype)
    srcs = _check(g, dtype, CodegenParams(**DOT, dot_swap=1, pdl=1), spec=spec)
    assert len(srcs) == 2 and "tl.rsqrt" in srcs[0] and "tl.rsqrt" not in srcs[1]
    assert _check(g, dtype, CodegenParams(**DOT, dot_swap=1, pdl=1), n_rows=3, spec=spec)
    from mirage_serve.verify.certificate import verify_equivalent

    assert verify_equivalent(g, spec).verdict == "equivalent"


def test_norm_then_linear_candidates_at_batch_8_and_up():
    names = [c.name for c in V.candidates_for("rmsnorm_linear", {"batch": 32, "hidden": 4096, "out": 6144}, "bfloat16")]
    assert "norm2 c48 k256" in names and "norm2 c64 k128" in names
    names = [c.name for c in V.candidates_for("rmsnorm_linear", {"batch": 1, "hidden": 4096, "out": 6144}, "bfloat16")]
    assert not any(n.startswith("norm2") for n in names)


@pytest.mark.parametrize("name", ["norm_then_linear", "attention"])
def test_dot_acc_compiles_to_hopper_ptx(name):
    from mirage_serve.codegen.runtime import _plan, compile_for_target

    g = _graphs("bfloat16")[name]
    p = CodegenParams(**DOT, dot_swap=int(name != "attention"), dot_acc=1, pdl=1)
    for ks in _plan(g, p, ()).kernels:
        if ks is not None:
            ptx = compile_for_target(ks, params=p)
            assert f".entry {ks.name}" in ptx and ".target sm_90" in ptx
