"""Generated kernels (TRITON_INTERPRET=1) match the float64 reference, in fp32 and bf16, at and below the bucket."""

from __future__ import annotations

import pytest
import torch
from codegen_graphs import split_k_rmsnorm_linear, two_kernel_add_rmsnorm_linear
from handwritten import fused_gated_mlp, fused_lora, fused_rmsnorm_linear, split_kv_attention

from mirage_serve.codegen import CodegenParams, compile_graph, generate_source, supports
from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec

TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def check(graph, dtype: str, params: CodegenParams | None = None, n_rows: int | None = None, seed: int = 0):
    """Run the compiled graph and the float64 reference on the same inputs; return max relative errors."""
    cg = compile_graph(graph, params)
    ins = random_inputs(graph, torch.Generator().manual_seed(seed))
    refs = execute(graph, ins)
    if n_rows is not None:
        assert cg.variable_batch, cg.rows.reason
        ins = [x[:n_rows].clone() if i in cg.row_inputs else x for i, x in enumerate(ins)]
        refs = [r[:n_rows] for r in refs]
    outs = cg(*ins)
    errs = []
    for y, r in zip(outs, refs, strict=True):
        assert y.shape == r.shape and y.dtype == ins[0].dtype
        errs.append(float((y.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)))
    assert max(errs) < TOL[dtype], errs
    return cg, errs


def _graphs(dtype: str):
    return {
        "rmsnorm_linear_gemv_b1": fused_rmsnorm_linear(1, 64, 48, n_blocks=6, loop=4, dtype=dtype),
        "rmsnorm_linear_gemv_b4": fused_rmsnorm_linear(4, 96, 24, n_blocks=2, loop=2, dtype=dtype),  # ragged 48-wide K chunks, 12 columns
        "rmsnorm_linear_dot_b16": fused_rmsnorm_linear(16, 64, 32, n_blocks=2, loop=4, dtype=dtype),
        "split_kv_attention": split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4, dtype=dtype),
        "lora": fused_lora(5, 64, 32, 8, n_blocks=4, loop=2, dtype=dtype),
        "gated_mlp": fused_gated_mlp(3, 64, 32, n_blocks=2, loop=8, dtype=dtype),
        "split_k_rmsnorm_linear": split_k_rmsnorm_linear(3, 64, 32, n_blocks=2, splits=2, loop=2, dtype=dtype),
        "two_kernel_add_rmsnorm_linear": two_kernel_add_rmsnorm_linear(4, 48, 24, n_blocks=3, loop=3, dtype=dtype),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(_graphs("float32")))
def test_fused_graphs_match_reference(name, dtype):
    check(_graphs(dtype)[name], dtype)


@pytest.mark.parametrize("name,n_rows", [("rmsnorm_linear_gemv_b4", 3), ("rmsnorm_linear_dot_b16", 5), ("split_kv_attention", 2),
                                         ("split_k_rmsnorm_linear", 1), ("two_kernel_add_rmsnorm_linear", 2), ("lora", 4)])
def test_smaller_batch_than_bucket(name, n_rows):
    check(_graphs("float32")[name], "float32", n_rows=n_rows)


@pytest.mark.parametrize("mode", ["dot", "fma"])
def test_matmul_modes_agree(mode):
    cg, _ = check(fused_rmsnorm_linear(16, 64, 32, n_blocks=2, loop=2), "float32", CodegenParams(matmul=mode))
    assert ("tl.dot(" in cg.sources[0]) == (mode == "dot")
    cg, _ = check(fused_rmsnorm_linear(4, 64, 32, n_blocks=2, loop=2), "float32", CodegenParams(matmul=mode))
    assert ("tl.dot(" in cg.sources[0]) == (mode == "dot")  # dot pads 4 rows to 16


def test_gemv_loads_weight_rows_along_k_and_dot_loads_transposed():
    (src,) = generate_source(fused_rmsnorm_linear(1, 64, 48, n_blocks=6, loop=4))
    assert "tl.dot" not in src and "tl.sum(t3[None, :] * t2, axis=1)" in src and "* 64 + r0[None, :]" in src  # W [N, K]: K contiguous
    (src,) = generate_source(fused_rmsnorm_linear(16, 64, 32, n_blocks=2, loop=4))
    assert "tl.dot(t3, t2" in src and "tl.trans" not in src  # trans_b by load order


def test_auto_moves_a_spilling_gemv_of_a_few_rows_onto_tl_dot():
    from mirage_serve.codegen.params import gemv_fits

    assert gemv_fits(1, 4096, 4096, 4)  # one row: always GEMV (the MMA would pad it to 16)
    assert gemv_fits(8, 16, 128, 4)  # 16384 products: 128 a thread at 4 warps
    assert not gemv_fits(8, 48, 256, 4) and gemv_fits(8, 48, 256, 32)  # spills at 4 warps; fits at 32
    assert gemv_fits(8, 48, 512, 4)  # spills, but tl.dot's tf32 tiles (64 x 512 x 4 B a stage) do not fit either
    # 4 rows x 32 columns x 256: GEMV would hold 256 products a thread; auto takes tl.dot, and it is right
    g = fused_rmsnorm_linear(4, 256, 64, n_blocks=2, loop=1, dtype="bfloat16")
    (src,) = generate_source(g)
    assert "tl.dot(" in src
    (fma,) = generate_source(g, CodegenParams(matmul="fma"))
    assert "tl.dot(" not in fma
    _, errs = check(g, "bfloat16")
    assert max(errs) <= TOL["bfloat16"]


def test_auto_precision_multiplies_16_bit_inputs_natively_and_computed_operands_in_tf32():
    g = fused_lora(16, 64, 32, 8, n_blocks=2, loop=2, dtype="bfloat16")
    (src,) = generate_source(g)
    # X@W^T and X@A^T read 16-bit inputs as loaded: the MMA takes them as they are (exact products,
    # fp32 accumulation), and those loads stay 16-bit; (X@A^T)@B^T has a computed operand: tf32
    assert src.count("tl.dot(") == 3 and src.count('input_precision="tf32"') == 1
    assert src.count(".to(tl.float32)") == 1 and "t3 = tl.load(in3_ptr + off3, mask=mask3, other=0.0).to(tl.float32)" in src
    _, errs = check(g, "bfloat16")
    assert max(errs) <= TOL["bfloat16"]
    (src32,) = generate_source(fused_lora(16, 64, 32, 8, n_blocks=2, loop=2))
    assert src32.count('input_precision="ieee"') == 3  # fp32 graphs: exact fp32 dots
    (tf32,) = generate_source(g, CodegenParams(dot_precision="tf32"))
    assert tf32.count('input_precision="tf32"') == 3  # asked for tf32: every dot


def test_auto_counts_16_bit_operand_tiles_at_2_bytes_for_shared_memory():
    from mirage_serve.codegen.params import gemv_fits
    from mirage_serve.tune.cost_model import estimate

    # 4 rows x 128 columns x 256: GEMV would spill; tl.dot's tiles are 147 KB as tf32, 74 KB as bf16
    assert gemv_fits(4, 128, 256, 4) and not gemv_fits(4, 128, 256, 4, operand_bytes=2)
    g = fused_gated_mlp(4, 512, 256, n_blocks=2, loop=2, dtype="bfloat16")
    (src,) = generate_source(g)
    assert src.count("tl.dot(") == 2 and "input_precision" not in src and ".to(tl.float32)" not in src.split("for i in")[1].split("tl.dot")[0]
    assert estimate(g).kernels[0].matmul_mode == "dot"  # the cost model follows
    assert gemv_fits(4, 128, 256, 4)  # fp32 tiles: too large for one iteration (the loop is then split: test_codegen_loop_split)
    _, errs = check(g, "bfloat16")
    assert max(errs) <= TOL["bfloat16"]


@pytest.mark.parametrize("spec,dims", [
    ("rmsnorm_linear", {"batch": 3, "hidden": 32, "out": 16}),
    ("add_rmsnorm_linear", {"batch": 3, "hidden": 32, "out": 16}),
    ("attention_decode", {"batch": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 8, "kv_len": 16}),
    ("lora_linear", {"batch": 3, "in": 32, "out": 16, "rank": 4}),
    ("gated_mlp", {"batch": 3, "hidden": 32, "intermediate": 16}),
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_specs_run_as_torch_ops(spec, dims, dtype):
    g = build_spec(spec, dims, dtype=dtype)
    cg, _ = check(g, dtype)
    assert cg.sources == []
    check(g, dtype, n_rows=2)


def test_source_is_deterministic():
    a = generate_source(split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4))
    b = generate_source(split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4))
    assert a == b and len(a) == 2


def test_unsupported_is_reported_not_raised():
    from mirage_serve.mugraph import BlockBuilder, GraphBuilder

    g = GraphBuilder()
    x = g.input("X", (4, 8))
    b = BlockBuilder((1,), 1)
    t = b.input(0, (-1,), -1)
    b.output(b.op("concat", t, t, dim=1), (-1,))
    (y,) = g.customized([x], b.build())
    ok, why = supports(g.build([y]))
    assert not ok and "concat" in why


def _tile_ops_graph(dtype: str = "float32"):
    """Ragged tiles (24 and 48 wide) through sum_to (both lowerings), reduce max, block rms_norm and rms_last."""
    from mirage_serve.mugraph import BlockBuilder, GraphBuilder

    g = GraphBuilder()
    x, w = g.input("X", (6, 96), dtype), g.input("W", (48,), dtype)
    b = BlockBuilder((3,), 2)
    tx, tw = b.input(0, (0,), 1), b.input(1, (-1,), 0)  # x tile [2, 48], w tile [24]
    s1 = b.accum("sum_to", tx, size=16)  # 48 -> 16, padded 64: selection lowering
    s2 = b.accum("sum_to", b.op("sum_to", tx, size=24), size=8)  # 24 -> 8
    mx = b.accum("max_last", tx)
    rn = b.accum("sum", b.op("rms_norm", b.binary("add", b.unary("neg", tx), b.reduce("max", tx, 1)), eps=1e-5))
    rms = b.accum("rms_last", tx)
    b.output(s1, (0,))
    b.output(s2, (0,))
    b.output(b.binary("mul", mx, rms), (0,))
    b.output(rn, (0,))
    del tw
    outs = g.customized([x, w], b.build())
    return g.build(list(outs))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_tile_ops(dtype):
    check(_tile_ops_graph(dtype), dtype)


def test_launch_grid_shrinks_with_rows():
    cg = compile_graph(split_kv_attention(4, 4, 2, 8, 32, splits=2, loop=2))
    assert cg.kernel_sources[0].rows_per_program == (1, 0) and cg.kernel_sources[1].rows_per_program == (1,)
    check(split_kv_attention(4, 4, 2, 8, 32, splits=2, loop=2), "float32", n_rows=3)


def test_ops_on_running_max_are_recomputed_after_the_loop():
    """An op on a max_last value runs in the loop with m_i and again after it with m_R."""
    from mirage_serve.mugraph import BlockBuilder, GraphBuilder

    g = GraphBuilder()
    x = g.input("X", (4, 40))
    b = BlockBuilder((2,), 4)
    tx = b.input(0, (0,), 1)
    m = b.accum("max_last", tx)
    e = b.unary("exp", b.binary("sub", tx, m))
    den = b.accum("rescaled_sum_last", e, m)
    b.output(b.binary("mul", den, b.unary("exp", b.unary("neg", m))), (0,))  # sum(exp(x - m)) * exp(-m)
    (y,) = g.customized([x], b.build())
    graph = g.build([y])
    (src,) = generate_source(graph)
    assert "_post = " in src
    check(graph, "float32")


KNOBS = {
    "dot-native": CodegenParams(matmul="dot", dot_precision="input"),
    "dot-swap": CodegenParams(matmul="dot", dot_precision="input", dot_swap=1),
    "chunks": CodegenParams(k_chunks=2),
    "dot-chunks": CodegenParams(matmul="dot", dot_precision="input", k_chunks=2),
}


@pytest.mark.parametrize("knobs", list(KNOBS))
@pytest.mark.parametrize("name", ["rmsnorm_linear_dot_b16", "split_kv_attention", "lora", "gated_mlp", "split_k_rmsnorm_linear"])
def test_codegen_knobs_keep_the_function(name, knobs):
    check(_graphs("bfloat16")[name], "bfloat16", KNOBS[knobs])


def test_native_dot_reads_16_bit_operands_directly():
    g = fused_rmsnorm_linear(16, 64, 32, n_blocks=2, loop=4, dtype="bfloat16")
    (src,) = generate_source(g, KNOBS["dot-native"])
    w_load = next(line for line in src.splitlines() if "tl.load(in2_ptr" in line)
    assert not w_load.rstrip().endswith(".to(tl.float32)")  # W goes to tl.dot in bfloat16, no round trip
    assert "tl.dot((t3).to(tl.bfloat16), t2)" in src
    (src,) = generate_source(g, KNOBS["dot-swap"])
    assert "tl.trans(tl.dot(t2, tl.trans((t3).to(tl.bfloat16))))" in src


def test_k_chunks_split_the_loop_and_refuse_what_does_not_decompose():
    from mirage_serve.mugraph import BlockBuilder, GraphBuilder

    g = fused_rmsnorm_linear(1, 64, 48, n_blocks=6, loop=2)
    (src,) = generate_source(g, CodegenParams(k_chunks=4))
    assert "for i in range(8):" in src and "r1 = tl.arange(0, 8)" in src
    gb = GraphBuilder()
    x = gb.input("X", (4, 64))
    b = BlockBuilder((1,), 2)
    tx = b.input(0, (-1,), 1)
    b.output(b.accum("sum", b.unary("exp", b.reduce("sum", tx, 1))), (-1,))  # sum_i exp(sum of chunk i): not splittable
    (y,) = gb.customized([x], b.build())
    ok, why = supports(gb.build([y]), CodegenParams(k_chunks=2))
    assert not ok and "reduces over the loop dim" in why
    assert supports(gb.build([y]))[0]


def test_pdl_waits_before_touching_memory():
    (k0, k1) = generate_source(split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4), CodegenParams(pdl=1))
    for src in (k0, k1):
        body = src.split('"""')[2].strip().splitlines()
        assert body[0].strip() == "tl.extra.cuda.gdc_wait()" and body[1].strip() == "tl.extra.cuda.gdc_launch_dependents()"


@pytest.mark.parametrize("params", [CodegenParams(), KNOBS["dot-native"], KNOBS["chunks"]], ids=["fma", "dot", "chunks"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_kernel_serves_shorter_kv(dtype, params):
    """Declared variable KV dims: any length up to the bucket, given by the tensors or by a device length."""
    g = split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4, dtype=dtype)
    cg = compile_graph(g, params, variable_dims=((1, 1), (2, 1)))
    assert cg.extent_buckets == (96,)
    ins = random_inputs(g, torch.Generator().manual_seed(4))
    for kv in (96, 50, 8, 1):  # 8 and 1 leave whole splits empty
        spec = build_spec("attention_decode", {"batch": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 16, "kv_len": kv}, dtype)
        k, v = ins[1][:, :kv].contiguous(), ins[2][:, :kv].contiguous()
        ref = execute(spec, [ins[0], k, v])[0]
        for out in (cg(ins[0], k, v)[0], cg(*ins, lengths=torch.tensor([kv], dtype=torch.int32))[0]):
            assert torch.isfinite(out).all()
            assert float((out.double() - ref).abs().max() / ref.abs().max()) < TOL[dtype], kv
    with pytest.raises(Exception, match="variable extent 0 is 97"):
        cg(ins[0], torch.cat([ins[1], ins[1][:, :1]], 1), torch.cat([ins[2], ins[2][:, :1]], 1))


def test_variable_dims_refuse_count_dependent_math_and_the_rows():
    from mirage_serve.codegen import CodegenError

    g = fused_rmsnorm_linear(4, 64, 32, n_blocks=2, loop=2)
    ok, why = supports(g, variable_dims=((0, 1),))  # the mean of squares divides by the hidden size
    assert not ok and "number of positions" in why
    with pytest.raises(CodegenError, match="row"):
        compile_graph(g, variable_dims=((0, 0),))


def test_codegen_version_and_cache_params():
    from mirage_serve import codegen

    assert isinstance(codegen.CODEGEN_VERSION, str) and codegen.CODEGEN_VERSION
    p = CodegenParams(matmul="dot", dot_precision="input", pdl=1, shrink_grid=False)
    cp = p.cache_params()
    assert cp == {"matmul": "dot", "dot_precision": "input", "pdl": 1, "shrink_grid": 0}
    assert all(isinstance(v, int | str) and not isinstance(v, bool) for v in cp.values())
    assert CodegenParams.from_dict(cp) == p


def test_pdl_2_launches_the_first_kernel_plainly():
    """``pdl=2``: the graph's first kernel neither waits nor is launched with PDL, but still lets the
    next one launch early; the kernels after it wait first and are launched with PDL. Same results."""
    from mirage_serve.codegen.runtime import _plan

    g = split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4)
    k0, k1 = _plan(g, CodegenParams(pdl=2)).kernels[3:5]
    body0, body1 = (k.text.split('"""')[2].strip().splitlines() for k in (k0, k1))
    assert "gdc_wait" not in k0.text and body0[0].strip() == "tl.extra.cuda.gdc_launch_dependents()"
    assert body1[0].strip() == "tl.extra.cuda.gdc_wait()" and body1[1].strip() == "tl.extra.cuda.gdc_launch_dependents()"
    assert (k0.pdl, k1.pdl) == (False, True)
    assert all(k.pdl for k in _plan(g, CodegenParams(pdl=1)).kernels if k is not None)
    ins = random_inputs(g, torch.Generator().manual_seed(5))
    ref = compile_graph(g, CodegenParams())(*ins)[0]
    assert torch.equal(compile_graph(g, CodegenParams(pdl=2))(*ins)[0], ref)
    with pytest.raises(Exception, match="pdl=3"):
        CodegenParams(pdl=3)


def test_pdl_2_compiles_for_hopper():
    from mirage_serve.codegen.runtime import _plan, compile_for_target

    p = CodegenParams(matmul="dot", dot_precision="input", pdl=2)
    k0, k1 = (k for k in _plan(split_kv_attention(1, 32, 8, 128, 4096, splits=64, loop=1, dtype="bfloat16"), p).kernels if k is not None)
    ptx0, ptx1 = compile_for_target(k0, params=p), compile_for_target(k1, params=p)
    assert "griddepcontrol.launch_dependents" in ptx0 and "griddepcontrol.wait" not in ptx0
    assert "griddepcontrol.wait" in ptx1
