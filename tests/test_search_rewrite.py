"""The rewrites of verified μGraphs (mirage_serve.search.rewrite): exp shifting and
loop splitting produce graphs the verifier accepts, the generator compiles and
the interpreter runs to the float64 reference; a rewrite that changes the
function is rejected by the verifier, not trusted."""

from __future__ import annotations

import math

import pytest
import torch
from handwritten import fused_gated_mlp, fused_rmsnorm_linear, split_kv_attention

from mirage_serve.mugraph import BlockBuilder, GraphBuilder
from mirage_serve.search.config import SearchConfig
from mirage_serve.search.enumerate import instantiations
from mirage_serve.search.rewrite import grid_last_dim, split_loop, stabilize_exp, variants
from mirage_serve.specs import build_spec
from mirage_serve.verify import verify_equivalent

DIMS = dict(batch=1, q_heads=4, kv_heads=2, head_dim=32, kv_len=64)


def exp_sum_attention(bk=2, group=2, d=32, kv=64, loop=2, divide=True):
    """Single-kernel attention without a max: exp(Q·K^T·s) summed with and without V."""
    g = GraphBuilder()
    q, k, v = g.input("Q", (bk, group, d)), g.input("K", (bk, kv, d)), g.input("V", (bk, kv, d))
    b = BlockBuilder((bk,), loop)
    tq, tk, tv = b.input(0, (0,), -1), b.input(1, (0,), 1), b.input(2, (0,), 1)
    e = b.unary("exp", b.unary("mul_scalar", b.matmul(tq, tk, trans_b=True), scalar=1 / math.sqrt(d)))
    den = b.accum("sum_last", e)
    num = b.accum("sum", b.matmul(e, tv))
    b.output(b.binary("div", num, den) if divide else num, (0,))
    (out,) = g.customized([q, k, v], b.build())
    return g.build([out])


def _kinds(graph):
    return [[(o.kind, o.attr("fn")) for o in op.block.ops] for op in graph.customized_ops]


def _run_matches_reference(graph, spec, tol=1e-4):
    from mirage_serve.codegen import compile_graph
    from mirage_serve.reference import execute, random_inputs

    ins = random_inputs(graph, torch.Generator().manual_seed(3), scale=0.5)
    out, ref = compile_graph(graph)(*ins), execute(spec, ins)
    err = float((out[0].double() - ref[0]).abs().max() / ref[0].abs().max())
    assert err < tol, err


def test_exp_shifting_gives_the_online_softmax_and_it_verifies():
    g = exp_sum_attention()
    op = g.customized_ops[0]
    (nb,) = stabilize_exp(op.block, [g.info[t] for t in op.inputs])
    fns = [(o.kind, o.attr("fn")) for o in nb.ops]
    assert ("accum", "max_last") in fns and ("accum", "rescaled_sum_last") in fns and ("accum", "rescaled_sum") in fns
    assert ("accum", "sum") not in fns and ("accum", "sum_last") not in fns
    spec = build_spec("attention_decode", DIMS)
    (shifted, *_) = variants(g)
    assert verify_equivalent(shifted, spec, trials=2).verdict == "equivalent"
    _run_matches_reference(shifted, spec)


def test_loop_split_of_attention_is_split_kv_with_max_rescaling():
    spec = build_spec("attention_decode", DIMS)
    vs = variants(exp_sum_attention())
    split = [v for v in vs if len(v.customized_ops) == 2 and len(v.customized_ops[1].block.grid) == 1]
    assert len(split) == 2  # of the plain form and of the shifted one
    safe = next(v for v in split if ("accum", "max_last") in _kinds(v)[0])
    partials, combine = safe.customized_ops
    # kernel 1 grids over the KV length as well (partial results), kernel 2 rescales and sums them
    assert len(partials.block.grid) == 2 and all(bo.output_map[-1] == -1 for bo in partials.block.outputs)
    assert [k for k in _kinds(safe)[1] if k[0] == "reduce"] == [("reduce", "max"), ("reduce", "sum"), ("reduce", "sum")]
    assert ("unary", "exp") in _kinds(safe)[1]
    for v in split:
        inst = instantiations(v, SearchConfig())
        assert inst
        ig = inst[0][1]
        assert verify_equivalent(ig, spec, trials=2).verdict == "equivalent"
        _run_matches_reference(ig, spec)


def test_the_merge_of_split_kv_is_also_gridded_along_the_head_dim():
    """The merge kernel of the loop split, gridded along its output's last dim: the max and sum
    partials are read by every head-dim block, the V partials are split; at sizes it verifies."""
    from mirage_serve.mugraph.serialize import content_hash

    spec = build_spec("attention_decode", DIMS)
    vs = variants(exp_sum_attention())
    wide = [v for v in vs if len(v.customized_ops) == 2 and len(v.customized_ops[1].block.grid) == 2]
    assert len(wide) == 2  # of the plain split and of the max-rescaled one
    for v in wide:
        combine = v.customized_ops[1].block
        assert [bo.output_map[-1] for bo in combine.outputs] == [2]
        assert sum(bi.input_map[-1] >= 0 for bi in combine.inputs) == 1
        inst = [g for _, g in instantiations(v, SearchConfig()) if g.customized_ops[1].block.grid[-1] > 1]
        assert inst
        assert verify_equivalent(inst[0], spec, trials=2).verdict == "equivalent"
        _run_matches_reference(inst[0], spec)
    # on the hand-written split-KV graph, the rewrite gives exactly its head-dim-split combine
    (g,) = grid_last_dim(split_kv_attention(1, 8, 2, 64, 256, 4, 64))
    assert content_hash(g) == content_hash(split_kv_attention(1, 8, 2, 64, 256, 4, 64, d_split=2))
    # a merge already gridded along its output's last dim (split-K of the gated MLP) is left alone
    assert grid_last_dim(split_loop(fused_gated_mlp(2, 64, 32, n_blocks=2, loop=4))) == []


def test_loop_split_of_the_fused_gated_mlp_is_split_k():
    spec = build_spec("gated_mlp", {"batch": 2, "hidden": 64, "intermediate": 32})
    g = split_loop(fused_gated_mlp(2, 64, 32, n_blocks=2, loop=4))
    assert g is not None and len(g.customized_ops) == 2
    # both sums merge by adding the parts; silu and the product run after the merge
    assert _kinds(g)[1] == [("reduce", "sum"), ("reduce", "sum"), ("unary", "silu"), ("binary", "mul")]
    ig = instantiations(g, SearchConfig())[0][1]
    assert verify_equivalent(ig, spec, trials=2).verdict == "equivalent"
    _run_matches_reference(ig, spec)


def test_an_accumulator_every_block_computes_alike_is_not_split():
    """The norm's mean of squares does not vary along the grid dim over W's rows:
    as partials, every block of that dim would write the same slice."""
    assert split_loop(fused_rmsnorm_linear(2, 64, 32, n_blocks=2, loop=4)) is None


def test_rewritten_graphs_compile_for_hopper():
    from mirage_serve.codegen import CodegenParams, compile_graph
    from mirage_serve.codegen.aot import compile_to_ptx

    pytest.importorskip("triton")
    sources = []
    for v in variants(exp_sum_attention(bk=8, group=4, d=128, kv=4096, loop=8)):
        ig = instantiations(v, SearchConfig())[0][1]
        sources += compile_graph(ig, CodegenParams()).kernel_sources
    ptxs = compile_to_ptx(sources, arch=90)
    assert len(ptxs) == len(sources) >= 3 and all(f".entry {s.name}" in p for s, p in zip(sources, ptxs, strict=True))


def test_a_shift_the_function_depends_on_is_rejected_by_the_verifier():
    """Σ exp(s)·V without the division is not invariant under the shift: the
    rewrite still proposes the shifted form, and the verifier turns it down."""
    from mirage_serve.mugraph import GraphBuilder as G

    d, kv = 32, 64
    sb = G()
    q, k, v = sb.input("Q", (2, 2, d)), sb.input("K", (2, kv, d)), sb.input("V", (2, kv, d))
    spec = sb.build([sb.matmul(sb.unary("exp", sb.unary("mul_scalar", sb.matmul(q, k, trans_b=True), scalar=1 / math.sqrt(d))), v)])
    plain = exp_sum_attention(divide=False)
    assert verify_equivalent(plain, spec, trials=2).verdict == "equivalent"
    (shifted, *_) = variants(plain)
    assert ("accum", "max_last") in _kinds(shifted)[0]
    assert verify_equivalent(shifted, spec, trials=2).verdict != "equivalent"


def test_what_does_not_split_is_left_alone():
    def one_kernel(loop, body):
        g = GraphBuilder()
        x = g.input("X", (2, 64))
        b = BlockBuilder((2,), loop)
        b.output(body(b, b.input(0, (0,), 1 if loop > 1 else -1)), (0,))
        (y,) = g.customized([x], b.build())
        return g.build([y])

    rms = one_kernel(4, lambda b, t: b.accum("rms_last", t))
    assert split_loop(rms) is None  # a root of a sum does not merge by parts
    no_loop = one_kernel(1, lambda b, t: b.unary("exp", t))
    assert split_loop(no_loop) is None and variants(no_loop) == []  # no loop, no exp in a loop
