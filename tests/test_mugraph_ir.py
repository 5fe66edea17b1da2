"""The μGraph IR: shape and phase rules, and the errors that name the operator and the problem."""

from __future__ import annotations

import pytest
import torch
from handwritten import fused_gated_mlp, fused_lora, fused_rmsnorm_linear, split_kv_attention
from hypothesis import HealthCheck, given, settings
from test_mugraph_json import kernel_graphs

from mirage_serve.mugraph import BlockBuilder, GraphBuilder, KernelGraph, MuGraphError, Op, TensorInfo, from_json, to_json
from mirage_serve.mugraph.shapes import block_tile_infos
from mirage_serve.reference import execute, random_inputs

HANDWRITTEN = {
    "fused_rmsnorm_linear": lambda: fused_rmsnorm_linear(4, 64, 48, n_blocks=6, loop=4),
    "split_kv_attention": lambda: split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4),
    "fused_lora": lambda: fused_lora(5, 64, 32, 8, n_blocks=4, loop=2),
    "fused_gated_mlp": lambda: fused_gated_mlp(3, 64, 32, n_blocks=2, loop=8),
}


@pytest.mark.parametrize("name", sorted(HANDWRITTEN))
def test_handwritten_graphs_validate_and_round_trip(name):
    g = HANDWRITTEN[name]()
    assert g.validate() is g
    text = to_json(g)
    back = from_json(text)
    assert back == g and to_json(back) == text
    assert from_json(to_json(g, indent=2)) == g


def test_handwritten_shapes_and_phases():
    g = split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4)
    first, second = g.customized_ops
    # partial results get a leading dim per unmapped grid dim: [splits, bk, group, 1|d]
    assert [g.info[t].shape for t in range(3, 6)] == [(3, 4, 4, 1), (3, 4, 4, 1), (3, 4, 4, 16)]
    assert g.info[g.outputs[0]] == TensorInfo((4, 4, 16), "float32")
    tiles = block_tile_infos(first.block, [g.info[t] for t in first.inputs])
    assert [t.phase for t in tiles[:3]] == ["invariant", "loop", "loop"]
    assert tiles[3].shape == (1, 4, 8) and tiles[3].phase == "loop"  # q @ k^T per iteration: 96 / 3 / 4 = 8
    assert "both" in {t.phase for t in tiles} and "post" in {t.phase for t in tiles}


def _one_kernel(shape_x, shape_w, grid, rng, imap_x, fdim_x, imap_w, fdim_w, omap) -> KernelGraph:
    g = GraphBuilder()
    x, w = g.input("X", shape_x), g.input("W", shape_w)
    b = BlockBuilder(grid, rng)
    tx, tw = b.input(0, imap_x, fdim_x), b.input(1, imap_w, fdim_w)
    b.output(b.accum("sum", b.matmul(tx, tw)), omap)
    (y,) = g.customized([x, w], b.build())
    return KernelGraph(tuple(g.ops), (y,))


def test_valid_one_kernel_matmul():
    g = _one_kernel((8, 64), (64, 32), (4,), 2, (-1,), 1, (1,), 0, (1,))
    assert g.info[2].shape == (8, 32)


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        # matmul inner dims
        (lambda: _kernel_matmul((4, 8), (16, 3)), r"kernel op 2 \(matmul\): inner dims differ: a\[4, 8\] has 8 columns, b\[16, 3\] has 16 rows"),
        (lambda: _kernel_matmul((4, 8), (3, 16), trans_b=True), r"kernel op 2 \(matmul\(trans_b=True\)\): inner dims differ.*columns \(trans_b\)"),
        (lambda: _kernel_matmul((2, 4, 8), (3, 8, 5)), r"kernel op 2 \(matmul\): batch dims differ: \[2\] vs \[3\]"),
        (lambda: _kernel_matmul((8,), (8, 5)), r"kernel op 2 \(matmul\): matmul needs rank >= 2"),
        # input maps
        (lambda: _one_kernel((8, 64), (64, 32), (4,), 1, (2,), -1, (1,), 0, (1,)), r"block input 0: input_map\[0\] = 2 is not a dim of a rank-2 tensor"),
        (lambda: _one_kernel((8, 64), (64, 32), (4, 2), 1, (-1,), -1, (1, -1), 0, (1, -1)), r"block input 0: input_map has 1 entries for a 2-dim grid"),
        (lambda: _one_kernel((8, 64), (64, 32), (3,), 1, (-1,), -1, (1,), -1, (1,)), r"block input 1: dim 1 \(size 32\) does not divide evenly over grid dim 0 \(size 3\)"),
        (lambda: _one_kernel((8, 64), (64, 32), (4, 2), 1, (-1, -1), -1, (1, 1), -1, (1, -1)), r"block input 1: tensor dim 1 is split by grid dims 0 and 1"),
        # for-loop
        (lambda: _one_kernel((8, 64), (64, 32), (4,), 3, (-1,), 1, (1,), 0, (1,)), r"block input 0: for-loop dim 1 \(size 64 per block\) does not divide into 3 iterations"),
        (lambda: _one_kernel((8, 64), (64, 32), (4,), 2, (-1,), 5, (1,), 0, (1,)), r"block input 0: forloop_dim 5 is not a dim"),
        (lambda: _one_kernel((8, 64), (64, 32), (4,), 0, (-1,), 1, (1,), 0, (1,)), r"forloop_range 0 must be a positive integer"),
        # grids and output maps
        (lambda: _one_kernel((8, 64), (64, 32), (2, 2, 2, 2), 1, (-1,) * 4, -1, (-1,) * 4, -1, (-1,) * 4), r"grid \[2, 2, 2, 2\] must have 1..3 positive dims"),
        (lambda: _one_kernel((8, 64), (64, 32), (4,), 2, (-1,), 1, (1,), 0, (2,)), r"block output 0: output_map\[0\] = 2 is not a dim of the rank-2 tile"),
        (lambda: _one_kernel((8, 64), (64, 32), (4,), 2, (-1,), 1, (1,), 0, (1, -1)), r"block output 0: output_map has 2 entries for a 1-dim grid"),
    ],
)
def test_shape_errors_name_operator_and_problem(build, pattern):
    with pytest.raises(MuGraphError, match=pattern):
        build().validate()


def _kernel_matmul(sa, sb, trans_b=False) -> KernelGraph:
    g = GraphBuilder()
    a, b = g.input("A", sa), g.input("B", sb)
    return KernelGraph(tuple(g.ops) + (Op.make("matmul", (a, b), trans_b=trans_b or None),), (2,))


def _block_graph(body, grid=(2,), rng=2) -> KernelGraph:
    """X (8, 16) streamed along dim 1 into ``body(builder, tile)``, which returns the output tile."""
    g = GraphBuilder()
    x = g.input("X", (8, 16))
    b = BlockBuilder(grid, rng)
    t = b.input(0, (0,), 1)
    b.output(body(b, t), (0,))
    (y,) = g.customized([x], b.build())
    return KernelGraph(tuple(g.ops), (y,))


def test_mixing_loop_and_post_loop_tiles():
    def body(b, t):
        acc = b.accum("sum", t)
        return b.binary("add", t, acc)

    with pytest.raises(MuGraphError, match=r"block op 1 \(binary\(fn=add\)\): mixes a per-iteration tile with an accumulated one; accumulate first"):
        _block_graph(body).validate()


def test_output_of_a_per_iteration_tile():
    with pytest.raises(MuGraphError, match=r"block output 0: tile 1 is a per-iteration value; outputs must be accumulated first"):
        _block_graph(lambda b, t: b.unary("exp", t)).validate()


def test_accumulator_rules():
    with pytest.raises(MuGraphError, match=r"block op 1 \(accum\(fn=sum\)\): accumulates tile 1, which is already accumulated"):
        _block_graph(lambda b, t: b.accum("sum", b.accum("sum", t))).validate()
    with pytest.raises(MuGraphError, match=r"block op 0 \(accum\(fn=rescaled_sum\)\): second input must be the output of a max_last accumulator"):
        _block_graph(lambda b, t: b.accum("rescaled_sum", t, t)).validate()
    with pytest.raises(MuGraphError, match=r"accum\(fn=sum_to, size=3\)\): sum_to size 3 must divide the last dim 8"):
        _block_graph(lambda b, t: b.accum("sum_to", t, size=3)).validate()
    with pytest.raises(MuGraphError, match=r"block op 0 \(accum\(fn=sum, size=4\)\): only sum_to takes a size"):
        _block_graph(lambda b, t: b.accum("sum", t, size=4)).validate()
    with pytest.raises(MuGraphError, match=r"block op 0 \(accum\(fn=mean\)\): unknown accumulator 'mean'; known: \['sum'"):
        _block_graph(lambda b, t: b.accum("mean", t)).validate()
    g = _block_graph(lambda b, t: b.accum("sum_to", t, size=4))
    assert g.info[1].shape == (8, 4)


def test_unknown_op_kind_and_fn():
    with pytest.raises(MuGraphError, match=r"unknown operator kind 'conv'; known: \["):
        Op.make("conv", (0,))
    with pytest.raises(MuGraphError, match=r"operator 'unary' takes no attribute\(s\) \['dim'\]"):
        Op.make("unary", (0,), fn="exp", dim=1)
    g = GraphBuilder()
    x = g.input("X", (4, 8))
    with pytest.raises(MuGraphError, match=r"kernel op 1 \(unary\(fn=cube\)\): unknown unary fn 'cube'; known: \['exp'"):
        g.build([g.unary("cube", x)])
    with pytest.raises(MuGraphError, match=r"block op 0 \(binary\(fn=pow\)\): unknown binary fn 'pow'"):
        _block_graph(lambda b, t: b.accum("sum", b.binary("pow", t, t))).validate()
    with pytest.raises(MuGraphError, match=r"kernel op 1 \(reduce\(dim=1, fn=mean, keepdim=True\)\): unknown reduction 'mean'"):
        KernelGraph((Op.make("input", name="X", shape=(4, 8)), Op.make("reduce", (0,), fn="mean", dim=1, keepdim=True)), (1,)).validate()
    with pytest.raises(MuGraphError, match=r"'scalar' is required for mul_scalar/add_scalar and only for them"):
        KernelGraph((Op.make("input", name="X", shape=(4,)), Op.make("unary", (0,), fn="mul_scalar")), (1,)).validate()


def test_block_only_ops_at_kernel_level():
    with pytest.raises(MuGraphError, match=r"kernel op 1 \(accum\(fn=sum\)\): 'accum' is a block-level operator"):
        KernelGraph((Op.make("input", name="X", shape=(4,)), Op.make("accum", (0,), fn="sum")), (1,)).validate()
    with pytest.raises(MuGraphError, match=r"'customized' is not a block-level operator"):
        _block_graph(lambda b, t: b.op("customized", t)).validate()


def test_bad_dtype_and_shapes():
    with pytest.raises(MuGraphError, match=r"kernel op 0 \(input\(dtype=float64, name=X\)\): dtype 'float64' not supported; use one of \['float32'"):
        KernelGraph((Op.make("input", name="X", shape=(4,), dtype="float64"),), (0,)).validate()
    with pytest.raises(MuGraphError, match=r"kernel op 0 \(input\(.*\)\): rank 5 not supported \(1..4\)"):
        KernelGraph((Op.make("input", name="X", shape=(1, 2, 2, 2, 2)),), (0,)).validate()
    with pytest.raises(MuGraphError, match=r"rank 0 not supported"):
        KernelGraph((Op.make("input", name="X", shape=()),), (0,)).validate()
    with pytest.raises(MuGraphError, match=r"dim 1 has size 0; sizes must be positive integers"):
        KernelGraph((Op.make("input", name="X", shape=(4, 0)),), (0,)).validate()


def test_rank_above_four_through_partial_outputs():
    # grid dims that no output dim takes add leading partial dims; rank 3 tile + 2 partial = 5
    g = GraphBuilder()
    x = g.input("X", (4, 4, 8))
    b = BlockBuilder((2, 2), 1)
    t = b.input(0, (-1, -1), -1)
    b.output(b.accum("sum", t), (-1, -1))
    (y,) = g.customized([x], b.build())
    with pytest.raises(MuGraphError, match=r"block output 0: output rank 5 \(with 2 partial dims\) exceeds 4"):
        KernelGraph(tuple(g.ops), (y,)).validate()


def test_graph_level_errors():
    x = Op.make("input", name="X", shape=(4,))
    with pytest.raises(MuGraphError, match=r"kernel op 1 \(unary\(fn=exp\)\): reads tensor 3, which is not produced before it"):
        KernelGraph((x, Op.make("unary", (3,), fn="exp")), (1,)).validate()
    with pytest.raises(MuGraphError, match="kernel graph has no outputs"):
        KernelGraph((x,), ()).validate()
    with pytest.raises(MuGraphError, match=r"kernel graph output 7 is not a tensor of the graph \(1 tensors\)"):
        KernelGraph((x,), (7,)).validate()
    with pytest.raises(MuGraphError, match=r"shapes \[4\] and \[3\] do not broadcast \(dim 0: 4 vs 3\)"):
        KernelGraph((x, Op.make("input", name="Y", shape=(3,)), Op.make("binary", (0, 1), fn="add")), (2,)).validate()
    with pytest.raises(MuGraphError, match=r"kernel op 1 \(customized\): customized operator without a block graph"):
        KernelGraph((x, Op.make("customized", (0,))), ()).validate()
    with pytest.raises(MuGraphError, match=r"block graph has no outputs"):
        KernelGraph((x, Op.make("customized", (0,), block=BlockBuilder((1,)).build())), ()).validate()
    with pytest.raises(MuGraphError, match="block inputs must be declared before any operator"):
        b = BlockBuilder((1,))
        b.input(0, (-1,))
        b.unary("exp", 0)
        b.input(0, (-1,))


def test_ops_compare_by_value():
    assert Op.make("reduce", (0,), fn="sum", dim=1, keepdim=True) == Op.make("reduce", [0], keepdim=True, dim=1, fn="sum")
    assert Op.make("unary", (0,), fn="exp", scalar=None).attrs == (("fn", "exp"),)
    assert fused_lora(5, 64, 32, 8, n_blocks=4, loop=2) == fused_lora(5, 64, 32, 8, n_blocks=4, loop=2)
    assert fused_lora(5, 64, 32, 8, n_blocks=4, loop=2) != fused_lora(5, 64, 32, 8, n_blocks=2, loop=2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kernel_graphs())
def test_shape_rules_agree_with_the_reference_executor(graph):
    """Every random valid graph runs, and each output has the shape the rules infer."""
    inputs = random_inputs(graph, torch.Generator().manual_seed(0), dtype=torch.float64)
    outs = execute(graph, inputs)
    assert [tuple(o.shape) for o in outs] == [graph.info[t].shape for t in graph.outputs]
