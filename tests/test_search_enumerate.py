"""Enumeration rules: partition tags, canonical order, map choices, output maps, instantiation."""

import pytest
from handwritten import fused_gated_mlp, fused_lora, fused_rmsnorm_linear, split_kv_attention

from mirage_serve.mugraph import BlockBuilder, GraphBuilder, Op
from mirage_serve.mugraph.shapes import TensorInfo
from mirage_serve.search import abstract
from mirage_serve.search.config import SearchConfig
from mirage_serve.search.driver import default_engine
from mirage_serve.search.enumerate import (
    LOOP,
    Counters,
    Tags,
    Vocabulary,
    accum_tags,
    block_rejection,
    canonical_block_order,
    canonical_ok,
    instantiations,
    map_choices,
    output_map_of,
    tile_tags,
)
from mirage_serve.specs import build_spec

E = frozenset()


def _info(shape, phase="loop"):
    return TensorInfo(tuple(shape), "float32", phase)


@pytest.mark.parametrize(
    "graph",
    [
        fused_rmsnorm_linear(16, 4096, 6144, n_blocks=192, loop=16),
        split_kv_attention(1, 32, 8, 128, 4096, splits=8, loop=8),
        fused_lora(8, 4096, 4096, 16, n_blocks=64, loop=8),
        fused_gated_mlp(8, 4096, 11008, n_blocks=86, loop=8),
    ],
    ids=["rmsnorm_linear", "split_kv_attention", "lora", "gated_mlp"],
)
def test_hand_written_fused_blocks_lie_in_the_search_space(graph):
    info = graph.info
    for op in graph.customized_ops:
        args = [info[t] for t in op.inputs]
        assert block_rejection(canonical_block_order(op.block), args) is None


def test_matmul_contracting_differently_split_dims_is_rejected():
    a, b = _info((16, 64)), _info((32, 64))
    mm = Op.make("matmul", (0, 1), trans_b=True)
    ok = tile_tags(mm, [a, b], [Tags((E, frozenset({LOOP}))), Tags((frozenset({"g0"}), frozenset({LOOP})))], _info((16, 32)))
    assert ok == Tags((E, frozenset({"g0"})), frozenset({LOOP}))
    bad = tile_tags(mm, [a, b], [Tags((E, frozenset({LOOP}))), Tags((frozenset({LOOP}), frozenset({"g0"})))], _info((16, 32)))
    assert bad is None


def test_nonlinear_function_of_a_partial_sum_is_rejected():
    x = _info((16, 32))
    partial = Tags((E, frozenset({"g0"})), frozenset({LOOP}))
    assert tile_tags(Op.make("unary", (0,), fn="exp"), [x], [partial], x) is None
    assert tile_tags(Op.make("unary", (0,), fn="mul_scalar", scalar=2.0), [x], [partial], x) == partial


def test_accumulators_need_a_loop_split_quantity():
    assert accum_tags("sum", Tags((E, E), frozenset({LOOP}))) == Tags((E, E))
    assert accum_tags("sum", Tags((E, frozenset({LOOP})))) is None  # summing different columns
    assert accum_tags("mean_sq_last", Tags((E, frozenset({LOOP})))) == Tags((E, E))
    assert accum_tags("max_last", Tags((E, frozenset({"g1", LOOP})))) == Tags((E, E), E, frozenset({"g1"}))
    # a value scaled by the running max needs a rescaled accumulator
    scaled = Tags((E, frozenset({LOOP})), E, frozenset({"M"}))
    assert accum_tags("sum_last", scaled) is None
    assert accum_tags("rescaled_sum_last", scaled) == Tags((E, E))


def test_output_map_from_tags_partial_and_replicated():
    assert output_map_of(Tags((E, frozenset({"g0"}))), 1) == (1,)
    assert output_map_of(Tags((frozenset({"g0"}), E), frozenset({"g1"})), 2) == (0, -1)
    assert output_map_of(Tags((E, E)), 1) is None


def test_canonical_order_generates_independent_ops_once():
    g = GraphBuilder()
    x = g.input("X", (4, 8))
    ops = tuple(g.ops)
    a = Op.make("unary", (x,), fn="exp")
    b = Op.make("unary", (x,), fn="neg")
    orders = [(a, b), (b, a)]
    allowed = [o for o in orders if canonical_ok(ops + (o[0],), 2, o[1])]
    assert len(allowed) == 1
    # an op reading the newest tensor is always allowed
    assert canonical_ok(ops + (b,), 2, Op.make("unary", (1,), fn="exp"))


def test_map_choices_follow_the_rules():
    spec = build_spec("rmsnorm_linear", {"batch": 16, "hidden": 4096, "out": 6144})
    infos = [spec.info[t] for t in spec.input_ids]
    c = Counters()
    choices = map_choices(infos, 1, c)
    assert choices and c.pruned_other > 0
    for ch in choices:
        for g in range(len(ch.grid)):
            extents = {infos[j].shape[m[g]] for j, m in enumerate(ch.input_maps) if m[g] >= 0}
            assert len(extents) == 1
        loops = {infos[j].shape[f] for j, f in enumerate(ch.forloop_dims) if f >= 0}
        assert len(loops) <= 1
    wanted = ((-1,), (-1,), (0,))
    assert any(ch.input_maps == wanted and ch.forloop_dims == (1, 0, 1) for ch in choices)


def test_map_choices_for_a_dim_of_one_never_split():
    infos = [TensorInfo((1, 64), "float32"), TensorInfo((32, 64), "float32")]
    for ch in map_choices(infos, 2):
        assert all(m[0] != 0 for m in [ch.input_maps[0]])


def test_instantiations_respect_divisibility_and_shared_memory():
    g = fused_gated_mlp(8, 4096, 11008, n_blocks=2, loop=2)
    cfg = SearchConfig()
    inst = instantiations(g, cfg)
    assert inst and [c for c, _ in inst] == sorted(c for c, _ in inst)
    for _, ig in inst:
        (op,) = ig.customized_ops
        assert 11008 % op.block.grid[0] == 0 and 4096 % op.block.forloop_range == 0
    tiny = cfg.replace(target=cfg.target.__class__(smem_per_block=1024))
    assert instantiations(g, tiny) == []


def test_vocabulary_reads_scalars_and_eps_from_the_spec():
    v = Vocabulary.from_spec(build_spec("rmsnorm_linear", {"batch": 2, "hidden": 8, "out": 4}))
    assert v.eps == (1e-6,) and 1e-6 in v.add_scalars
    v = Vocabulary.from_spec(build_spec("attention_decode", {"batch": 1, "q_heads": 4, "kv_heads": 1, "head_dim": 16, "kv_len": 32}))
    assert v.mul_scalars == (0.25,)


def test_block_rejection_explains():
    g = GraphBuilder()
    x, w = g.input("X", (4, 64)), g.input("W", (32, 64))
    b = BlockBuilder((2,), 2)
    tx, tw = b.input(0, (-1,), 1), b.input(1, (0,), 1)
    y = b.unary("exp", b.matmul(tx, tw, trans_b=True))
    b.output(b.accum("sum", y), (1,))
    op = Op.make("customized", (x, w), block=b.build())
    (out,) = g.customized([x, w], op.block)
    g.build([out])  # valid IR: exp of a per-iteration partial sum, then summed; no spec computes that
    reason = block_rejection(op.block, [TensorInfo((4, 64), "float32"), TensorInfo((32, 64), "float32")])
    assert reason is not None and "partition" in reason


def test_a_tile_the_abstraction_reduces_to_a_number_is_not_a_duplicate_source():
    """The split-KV combine rescales partial results by exp(m_i - M): abstractly 1
    (maxima are size-free), concretely not. ``collapsed`` marks such tiles, and the
    enumerator does not drop ``partial * exp(m_i - M)`` as equal to ``partial``."""
    spec = build_spec("attention_decode", {"batch": 1, "q_heads": 4, "kv_heads": 2, "head_dim": 32, "kv_len": 64})
    graph = split_kv_attention(1, 4, 2, 32, 64, splits=2, loop=2)
    engine = default_engine(spec, True)
    exprs = abstract.graph_exprs(graph)
    comb = graph.customized_ops[1]
    tiles, _ = abstract.block_exprs(comb.block, [exprs[t] for t in comb.inputs], [graph.info[t] for t in comb.inputs])
    kinds = [(op.kind, op.attr("fn")) for op in comb.block.ops]
    n_in = len(comb.block.inputs)
    factor = tiles[n_in + kinds.index(("unary", "exp"))]  # exp(m_i - max_i m_i)
    assert engine.collapsed(factor)
    assert not any(engine.collapsed(e) for e in tiles[:n_in])
    # the rescaled partial has the expression of the partial itself, so without the
    # exemption the duplicate rule would remove the only safe combine
    first_mul = n_in + kinds.index(("binary", "mul"))
    assert engine.fingerprint(tiles[first_mul]) in {engine.fingerprint(e) for e in tiles[:n_in]}


def test_final_operator_grids_only_over_output_labels():
    """The operator producing the spec's outputs may not split a contracted label
    over its grid (that makes partials): for decode attention, no grid dim along
    the KV length or the head dim of Q·K, while the head and value dims stay."""
    from mirage_serve.search.enumerate import final_grid_ok, prefix_graph
    from mirage_serve.search.labels import kernel_labels

    spec = build_spec("attention_decode", dict(batch=1, q_heads=4, kv_heads=2, head_dim=32, kv_len=64))
    vocab = Vocabulary.from_spec(spec)
    inputs = tuple(op for op in spec.ops if op.kind == "input")
    g = prefix_graph(inputs)
    infos, labels = list(g.info), kernel_labels(g, vocab.labels)
    choices = map_choices(infos, 2, None, labels, vocab.labels)
    final = [c for c in choices if final_grid_ok(c, labels, vocab.labels)]
    assert 0 < len(final) < len(choices) / 2
    kv, d_qk = labels[1][1], labels[0][2]
    for c in choices:
        gridded = {labels[j][m[gd]] for gd in range(len(c.grid)) for j, m in enumerate(c.input_maps) if m[gd] >= 0}
        assert (c in final) == (not gridded & {kv, d_qk})
    # the single-kernel flash form's choice (grid over batch*kv_heads, loop over the KV length) stays
    assert any(c.input_maps == ((0,), (0,), (0,)) and c.forloop_dims == (-1, 1, 1) for c in final)
    # the split-KV partial kernel's choice (grid also over the KV length) is not final
    assert any(c.input_maps == ((0, -1), (0, 1), (0, 1)) and c not in final for c in choices)


def test_map_choices_stream_every_input_along_the_loop_label():
    """A loop over a label streams every input carrying it: holding one input's whole extent
    of the label while another streams a chunk of it combines nothing (RMSNorm→linear: X and W
    both loop over the hidden dim or neither does; attention: K and V both over the KV length)."""
    from mirage_serve.search.enumerate import prefix_graph
    from mirage_serve.search.labels import kernel_labels

    for name, dims in [("rmsnorm_linear", dict(batch=2, hidden=64, out=32)),
                       ("attention_decode", dict(batch=1, q_heads=4, kv_heads=2, head_dim=32, kv_len=64))]:
        spec = build_spec(name, dims)
        vocab = Vocabulary.from_spec(spec)
        g = prefix_graph(tuple(op for op in spec.ops if op.kind == "input"))
        infos, labels = list(g.info), kernel_labels(g, vocab.labels)
        choices = map_choices(infos, 2, None, labels, vocab.labels)
        looped = [c for c in choices if any(f >= 0 for f in c.forloop_dims)]
        assert looped, name
        for c in looped:
            (label,) = {labels[j][f] for j, f in enumerate(c.forloop_dims) if f >= 0}
            carriers = [j for j in range(len(infos)) if label in labels[j]]
            assert all(c.forloop_dims[j] >= 0 for j in carriers), (name, c)
    # decode attention's single-loop choice (K and V stream the KV length, Q is whole) is kept
    assert any(c.input_maps == ((0,), (0,), (0,)) and c.forloop_dims == (-1, 1, 1) for c in choices)


def test_a_labelled_axis_of_extent_one_lines_up_only_with_itself():
    """Multi-head attention (one query per KV head): Q's group axis has extent one. It must not
    broadcast against K's KV-length axis (Q ⊙ K is no intermediate of Q·Kᵀ at any other group
    size), while the kept dim of a reduction (label None) still broadcasts as before."""
    from mirage_serve.search.labels import op_labels, spec_labels

    spec = build_spec("attention_decode", dict(batch=1, q_heads=2, kv_heads=2, head_dim=32, kv_len=64))
    lab = spec_labels(spec)
    lq, lk, _ = lab.inputs
    q, k = (1, 1, 32), (1, 16, 32)
    assert op_labels(Op.make("binary", (0, 1), fn="mul"), [q, k], [lq, lk], (1, 16, 32), lab) is None
    s_lab = op_labels(Op.make("matmul", (0, 1), trans_b=True), [q, k], [lq, lk], (1, 1, 16), lab)
    assert s_lab == (lq[0], lq[1], lk[1])
    m_lab = op_labels(Op.make("reduce", (0,), fn="max", dim=-1), [(1, 1, 16)], [s_lab], (1, 1, 1), lab)
    assert m_lab == (lq[0], lq[1], None)
    assert op_labels(Op.make("binary", (0, 1), fn="sub"), [(1, 1, 16), (1, 1, 1)], [s_lab, m_lab], (1, 1, 16), lab) == s_lab


def test_multi_head_attention_reaches_the_single_loop_kernel_as_soon_as_grouped_query_attention():
    """The block enumeration of the flash form's map choice (grid over batch x KV heads, loop over
    the KV length) reaches the single-loop softmax·V kernel within the same number of block nodes
    for one query per KV head as for two; before the rule above it was not reached in 90000."""
    from mirage_serve.search.enumerate import Budget, enumerate_blocks, prefix_graph
    from mirage_serve.search.labels import kernel_labels

    wanted = sorted([("matmul", None), ("unary", "mul_scalar"), ("unary", "exp"), ("accum", "sum_last"),
                     ("matmul", None), ("accum", "sum"), ("binary", "div")])
    reached = {}
    for q_heads in (4, 2):
        spec = build_spec("attention_decode", dict(batch=1, q_heads=q_heads, kv_heads=2, head_dim=32, kv_len=64))
        engine, vocab = default_engine(spec, True), Vocabulary.from_spec(spec)
        g = prefix_graph(tuple(op for op in spec.ops if op.kind == "input"))
        infos, exprs, labels = list(g.info), engine.graph_exprs(g), kernel_labels(g, vocab.labels)
        (choice,) = [c for c in map_choices(infos, 1, None, labels, vocab.labels)
                     if c.input_maps == ((0,), (0,), (0,)) and c.forloop_dims == (-1, 1, 1)]
        budget = Budget(None, 30000)
        for comp in enumerate_blocks(choice, (0, 1, 2), infos, exprs, g, engine, vocab, 7, 1, Counters(), budget, labels):
            if sorted((op.kind, op.attr("fn")) for op in comp.op.block.ops) == wanted:
                reached[q_heads] = budget.nodes
                break
    assert set(reached) == {4, 2}, reached
    assert reached[2] <= 1.1 * reached[4]
