"""mirage_serve.verify.rows: row-separable graphs are verified on a row-reduced instance."""

import math

import pytest
import torch
from handwritten import fused_rmsnorm_linear, split_kv_attention

from mirage_serve.mugraph import BlockBuilder, GraphBuilder
from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec
from mirage_serve.verify import Certificate, verify_equivalent
from mirage_serve.verify.rows import common_group, reduced_rows, row_split, rows_within_memory, verify_memory_bytes, with_rows

DIMS = {"batch": 4, "q_heads": 4, "kv_heads": 2, "head_dim": 16, "kv_len": 64}


def attention_spec(**kw):
    return build_spec("attention_decode", {**DIMS, **kw}, "float32")


def attention_candidate(batch=4, splits=2, d_split=1):
    return split_kv_attention(batch, 4, 2, 16, 64, splits=splits, loop=2, d_split=d_split)


def test_decode_attention_spec_and_split_kv_candidates_are_row_separable():
    s = row_split(attention_spec())
    assert s is not None and s.rows == 8 and s.group == 1
    for d_split in (1, 4):
        c = row_split(attention_candidate(d_split=d_split))
        assert c is not None and c.rows == 8 and c.group == 1 and len(c.grid_dims) == 2
    assert common_group(attention_candidate(), attention_spec()) == (8, 1)


@pytest.mark.parametrize("d_split", [1, 4])
def test_a_reduced_instance_computes_the_first_rows_of_the_full_one(d_split):
    full = attention_candidate(batch=4, d_split=d_split)
    small = with_rows(full, 2)
    assert small.info[small.input_ids[1]].shape == (2, 64, 16)
    assert small == with_rows(attention_candidate(batch=1, d_split=d_split), 2)  # the graph at batch 1
    xs = random_inputs(full, torch.Generator().manual_seed(0))
    (out_full,) = execute(full, xs)
    (out_small,) = execute(small, [x[:2] for x in xs])
    torch.testing.assert_close(out_small, out_full[:2], rtol=0, atol=0)
    assert with_rows(small, 8) == full


def test_graphs_that_mix_or_broadcast_rows_are_not_row_separable():
    # a reduction over the rows
    g = GraphBuilder()
    x = g.input("X", (8, 4), "float32")
    assert row_split(g.build([g.reduce("sum", x, 0)])) is None
    # the spec of a linear layer: the weight's dim 0 is not the batch
    assert row_split(build_spec("rmsnorm_linear", {"batch": 4, "hidden": 32, "out": 16}, "float32")) is None
    assert row_split(fused_rmsnorm_linear(4, 32, 16, n_blocks=2, loop=2)) is None
    # a block that streams the rows through its for-loop (rows are summed across iterations)
    g = GraphBuilder()
    x = g.input("X", (8, 4), "float32")
    b = BlockBuilder((1,), 2)
    t = b.input(0, (-1,), 0)
    b.output(b.accum("sum", t), (-1,))
    assert row_split(g.build(list(g.customized([x], b.build())))) is None
    # a block replicated over the grid dim that splits the other input's rows
    g = GraphBuilder()
    x, y = g.input("X", (8, 4), "float32"), g.input("Y", (8, 4), "float32")
    b = BlockBuilder((8,), 1)
    tx, ty = b.input(0, (0,), -1), b.input(1, (-1,), -1)
    b.output(b.binary("mul", tx, b.reduce("sum", ty, 0)), (0,))
    assert row_split(g.build(list(g.customized([x, y], b.build())))) is None


def test_row_groups_are_the_rows_one_program_reads():
    g = GraphBuilder()
    x = g.input("X", (8, 4), "float32")
    b = BlockBuilder((2,), 1)
    t = b.input(0, (0,), -1)
    b.output(b.binary("mul", t, b.reduce("sum", t, 0)), (0,))  # mixes the 4 rows of its own tile
    graph = g.build(list(g.customized([x], b.build())))
    s = row_split(graph)
    assert s is not None and s.group == 4
    with pytest.raises(ValueError, match="multiple"):
        with_rows(graph, 2)
    assert reduced_rows(8, 4, 7) == 4 and reduced_rows(8, 4, 3) is None and reduced_rows(256, 1, 100) == 64


def test_verification_on_fewer_rows_records_it_and_names_the_full_graphs():
    spec, cand = attention_spec(), attention_candidate()
    cert = verify_equivalent(cand, spec, trials=2, seed=1, max_rows=3)
    assert cert.verdict == "equivalent", cert.reason
    assert cert.rows == {"rows": 8, "verified_rows": 2, "group": 1}
    assert "2 of 8 rows" in cert.reason and "row-reduced" in cert.method
    full = verify_equivalent(cand, spec, trials=2, seed=1)
    assert (cert.candidate_hash, cert.spec_hash) == (full.candidate_hash, full.spec_hash) and full.rows is None
    back = Certificate.from_dict(cert.to_dict())
    assert back.rows == cert.rows and "rows" not in full.to_dict()
    assert Certificate.from_dict(full.to_dict()).rows is None
    assert "verified on 2 of 8 rows" in cert.summary()


def test_a_wrong_candidate_fails_on_the_reduced_instance_too():
    spec = attention_spec()
    g = GraphBuilder()
    q, k, v = (g.input(n, s, "float32") for n, s in (("Q", (8, 2, 16)), ("K", (8, 64, 16)), ("V", (8, 64, 16))))
    s = g.unary("mul_scalar", g.matmul(q, k, trans_b=True), scalar=1.0 / math.sqrt(16))
    e = g.unary("exp", g.binary("sub", s, g.reduce("max", s, -1)))
    wrong = g.build([g.matmul(e, v)])  # no normalisation by the softmax denominator
    cert = verify_equivalent(wrong, spec, trials=2, seed=0, max_rows=2)
    assert cert.verdict == "not_equivalent" and cert.rows is not None


def test_pairs_that_are_not_row_separable_are_not_decided_on_fewer_rows():
    spec = build_spec("rmsnorm_linear", {"batch": 4, "hidden": 32, "out": 16}, "float32")
    cert = verify_equivalent(fused_rmsnorm_linear(4, 32, 16, n_blocks=2, loop=2), spec, trials=1, max_rows=2)
    assert cert.verdict == "unknown" and "not both row-separable" in cert.reason and cert.rows is None


def test_malformed_rows_in_a_stored_certificate_are_rejected():
    d = verify_equivalent(attention_candidate(), attention_spec(), trials=1, max_rows=2).to_dict()
    d["rows"] = {"rows": 8, "verified_rows": "2", "group": 1}
    with pytest.raises(ValueError, match="rows"):
        Certificate.from_dict(d)


def test_memory_estimates_scale_with_the_rows():
    spec = attention_spec()
    assert verify_memory_bytes(spec, rows=2) * 4 == verify_memory_bytes(spec)
    need = verify_memory_bytes(spec)
    assert rows_within_memory(spec, need) is None
    assert rows_within_memory(spec, need - 1) == 3  # half of it holds 3 of 8 rows


def test_reductions_and_concats_without_a_dim_attribute_use_the_defaults():
    from mirage_serve.mugraph.graph import KernelGraph, Op

    x = Op.make("input", name="X", shape=(8, 4), dtype="float32")
    assert row_split(KernelGraph((x, Op.make("reduce", (0,), fn="sum")), (1,))) is not None  # over the last dim
    assert row_split(KernelGraph((x, Op.make("concat", (0, 0))), (1,))) is None  # along dim 0: the rows


def test_invalid_or_mismatched_candidates_get_a_certificate_on_the_reduced_path():
    from mirage_serve.mugraph.graph import KernelGraph, Op

    spec = attention_spec()
    broken = KernelGraph((Op.make("input", name="Q", shape=(8, 2, 16), dtype="float32"), Op.make("unary", (5,), fn="exp")), (1,))
    cert = verify_equivalent(broken, spec, trials=1, max_rows=2)
    assert cert.verdict == "not_equivalent" and "not a valid" in cert.reason
    other_rows = attention_candidate(batch=2)
    cert = verify_equivalent(other_rows, spec, trials=1, max_rows=2)
    assert cert.verdict == "not_equivalent" and "input 0" in cert.reason
    with pytest.raises(ValueError, match="run_candidate"):
        verify_equivalent(attention_candidate(), spec, trials=1, max_rows=2, run_candidate=lambda *a: a)
