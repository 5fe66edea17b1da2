"""Upstream Mirage μGraphs: import, validate, and re-execute against their reference programs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MUGRAPHS

from mirage_serve.mugraph import MuGraphError, content_hash, from_json, to_json
from mirage_serve.mugraph.mirage_import import import_mirage_file, import_mirage_graph, import_mirage_obj
from mirage_serve.reference import execute

FILES = [
    "rmsnorm_bs1.json",
    "rmsnorm_bs8.json",
    "gqa_bs1.json",
    "lora.json",
    "single_lora.json",
    "gated_mlp.json",
    "ntrans_bs1.json",
    "qknorm_gqa_bs1.json",
]
needs_corpus = pytest.mark.skipif(not MUGRAPHS.is_dir(), reason=f"upstream Mirage corpus not found at {MUGRAPHS} (place shared/ beside the checkout)")


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True))


def _attention(q, k, v):
    e = torch.exp(q @ k)
    return (e / e.sum(-1, keepdim=True)) @ v


def _uniform(g: torch.Generator, shape, a: float) -> torch.Tensor:
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * a


def _normal(g: torch.Generator, shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


# file -> (inputs from the graph's input shapes, reference program); README of the corpus.
# Attention logits stay O(1) so exp neither overflows nor saturates the softmax: Q, K
# uniform in ±0.5 gives logits of std ~0.7; qknorm normalises Q to unit RMS, so K is
# scaled to ±0.25 (logit std ~1) and the wrong graphs cannot hide behind a flat softmax.
PROGRAMS = {
    "rmsnorm": (lambda g, s: [_normal(g, s[0]), _normal(g, s[1])], lambda x, w: _rms(x) @ w),
    "gqa_bs1": (lambda g, s: [_uniform(g, s[0], 0.5), _uniform(g, s[1], 0.5), _uniform(g, s[2], 1.0)], _attention),
    "qknorm": (
        lambda g, s: [_uniform(g, s[0], 1.0), _uniform(g, s[1], 0.25), _uniform(g, s[2], 1.0)],
        lambda q, k, v: _attention(_rms(q), k, _rms(v)),
    ),
    "lora": (lambda g, s: [_normal(g, x) for x in s], lambda x, w, a, b: x @ w + (x @ a) @ b),
    "gated_mlp": (
        lambda g, s: [_normal(g, s[0]), _normal(g, s[1], 0.05), _normal(g, s[2], 0.05)],
        lambda x, w1, w2: torch.nn.functional.silu(x @ w1) * (x @ w2),
    ),
    "ntrans": (lambda g, s: [_normal(g, x) for x in s], lambda h, x, alpha: _rms(x + alpha * (_rms(h) + x))),
}


def _program(name: str):
    return next(v for k, v in PROGRAMS.items() if k in name)


@pytest.fixture(scope="module")
def corpus() -> dict[str, list]:
    return {name: import_mirage_file(MUGRAPHS / name) for name in FILES}


@needs_corpus
def test_corpus_lists_every_file():
    assert sorted(p.name for p in MUGRAPHS.glob("*.json")) == sorted(FILES)


@needs_corpus
@pytest.mark.parametrize("name", FILES)
def test_every_graph_imports_validates_and_round_trips(name, corpus):
    graphs = corpus[name]
    raw = json.loads((MUGRAPHS / name).read_text())
    assert len(graphs) == len(raw) > 0
    first_inputs = [graphs[0].info[t] for t in graphs[0].input_ids]
    for g, r in zip(graphs, raw, strict=True):
        assert [g.info[t] for t in g.input_ids] == first_inputs  # every graph computes the same signature
        assert len(g.outputs) == sum(op["op_type"] == "kn_output_op" for op in r)
        assert len(g.customized_ops) == sum(op["op_type"] == "kn_customized_op" for op in r)
        assert all(g.info[t].dtype == "float16" for t in range(g.num_tensors))
        text = to_json(g)
        assert from_json(text) == g and to_json(from_json(text)) == text


@needs_corpus
@pytest.mark.parametrize("name", [f for f in FILES if f != "qknorm_gqa_bs1.json"])
def test_upstream_graphs_compute_their_reference_program(name, corpus):
    make_inputs, program = _program(name)
    graphs = corpus[name]
    shapes = [graphs[0].info[t].shape for t in graphs[0].input_ids]
    inputs = make_inputs(torch.Generator().manual_seed(0), shapes)
    ref = program(*inputs)
    errors = []
    for g in graphs:
        (out,) = execute(g, inputs)
        assert out.shape == ref.shape
        errors.append(float((out - ref).norm() / ref.norm()))
    assert max(errors) <= 1e-9, f"{name}: relative errors {errors}"


@needs_corpus
def test_qknorm_graphs_do_not_compute_their_reference_program(corpus):
    make_inputs, program = _program("qknorm")
    graphs = corpus["qknorm_gqa_bs1.json"]
    assert len(graphs) == 190
    shapes = [graphs[0].info[t].shape for t in graphs[0].input_ids]
    inputs = make_inputs(torch.Generator().manual_seed(0), shapes)
    ref = program(*inputs)
    errors = [float((execute(g, inputs)[0] - ref).norm() / ref.norm()) for g in graphs]
    assert min(errors) > 1e-2, f"some qknorm graph matches its reference: {sorted(errors)[:5]}"


@needs_corpus
def test_qknorm_reference_program_is_attention_on_normalised_inputs(corpus):
    """Guards the negative result above: on inputs whose Q and V already have unit RMS the
    qknorm program is plain attention, which the (correct) gqa graphs compute."""
    make_inputs, program = _program("qknorm")
    q, k, v = make_inputs(torch.Generator().manual_seed(1), [(2, 256, 64), (2, 64, 4096), (2, 4096, 64)])
    q, v = _rms(q), _rms(v)
    (out,) = execute(corpus["gqa_bs1.json"][0], [q, k, v])
    ref = program(q, k, v)
    assert float((out - ref).norm() / ref.norm()) < 1e-12


@needs_corpus
def test_grid_dims_are_trimmed_and_maps_follow(corpus):
    g = corpus["gqa_bs1.json"][0]
    first, second = g.customized_ops
    assert first.block.grid == (2, 8, 16) and first.block.forloop_range == 4
    assert first.block.inputs[0].input_map == (0, -1, 1)
    assert second.block.grid == (2, 16)  # z = 1 trimmed
    assert second.block.outputs[0].output_map == (0, 1)
    assert [op.attr("fn") for op in second.block.ops if op.kind == "accum"] == ["sum_last", "sum_to"]
    assert [op.attr("size") for op in second.block.ops if op.attr("fn") == "sum_to"] == [64]
    rms = corpus["rmsnorm_bs1.json"][0].customized_ops[0].block
    assert rms.grid == (256,) and rms.forloop_range == 32
    assert [op.attr("fn") for op in rms.ops if op.kind == "accum"] == ["rms_last", "sum"]


@needs_corpus
def test_later_spelling_imports_to_the_same_graph(corpus):
    raw = json.loads((MUGRAPHS / "gqa_bs1.json").read_text())[3]
    later = json.loads(json.dumps(raw).replace('"tb_accum_', '"tb_forloop_accum_').replace('"data_type": 921', '"data_type": 941'))
    assert "tb_forloop_accum_nored_op" in json.dumps(later)
    assert import_mirage_graph(later) == corpus["gqa_bs1.json"][3]
    assert content_hash(import_mirage_graph(later)) == content_hash(corpus["gqa_bs1.json"][3])


# --- hand-written upstream graphs: the op mappings and the errors ---------------------------


def _t(guid: int, shape, code: int = 921, after: bool | None = None) -> dict:
    t = {"guid": guid, "dim": list(shape) + [0] * (4 - len(shape)), "num_dims": len(shape), "data_type": code, "layout": "DmemRowMajor"}
    if after is not None:
        t["after_accum"] = after
    return t


def _xyz(x: int = -1, y: int = -1, z: int = -1) -> dict:
    return {"x": x, "y": y, "z": z}


def _kn_input(guid: int, shape, code: int = 921) -> dict:
    return {"op_type": "kn_input_op", "input_tensors": [], "output_tensors": [_t(guid, shape, code)], "input_map": _xyz()}


def _kn(op_type: str, ins: list[dict], out: dict) -> dict:
    return {"op_type": op_type, "input_tensors": ins, "output_tensors": [out]}


def _kn_output(t: dict) -> dict:
    return {"op_type": "kn_output_op", "input_tensors": [t], "output_tensors": [], "output_map": _xyz()}


def _rowsum_graph(accum: str = "tb_accum_red_ld_sum_op", code: int = 921) -> list:
    """Y[r] = Σ_c X[r, c] over a (4, 64) input: grid 4 over rows, 2 loop iterations."""
    x, y = _t(1, (4, 64), code), _t(2, (4, 1), code)
    tile, acc = _t(11, (1, 32), code, False), _t(12, (1, 1), code, True)
    bgraph = {
        "grid_dim": _xyz(4, 1, 1),
        "block_dim": _xyz(128, 1, 1),
        "forloop_range": 2,
        "reduction_dimx": 64,
        "operators": [
            {"op_type": "tb_input_op", "dtensor": x, "input_map": _xyz(0), "forloop_dim": 1, "input_tensors": [], "output_tensors": [tile]},
            {"op_type": accum, "input_tensors": [tile], "output_tensors": [acc]},
            {"op_type": "tb_output_op", "dtensor": y, "output_map": _xyz(0), "input_tensors": [acc], "output_tensors": []},
        ],
    }
    graph = [_kn_input(1, (4, 64), code), {"op_type": "kn_customized_op", "input_tensors": [x], "output_tensors": [y], "bgraph": bgraph}, _kn_output(y)]
    return json.loads(json.dumps(graph))  # no shared sub-objects, as in a parsed file


def test_hand_written_block_graph_imports_and_runs():
    g = import_mirage_graph(_rowsum_graph())
    (op,) = g.customized_ops
    assert op.block.grid == (4,) and op.block.inputs[0].input_map == (0,) and op.block.inputs[0].forloop_dim == 1
    x = torch.randn(4, 64, dtype=torch.float64)
    assert torch.allclose(execute(g, [x])[0], x.sum(-1, keepdim=True))


def test_non_row_major_input_strides_are_kept():
    raw = _rowsum_graph()
    raw[0]["input_strides"] = [1, 4]  # column-major (4, 64)
    assert import_mirage_graph(raw).ops[0].attr("strides") == (1, 4)
    raw[0]["input_strides"] = [64, 1]
    assert import_mirage_graph(raw).ops[0].attr("strides") is None


def test_maps_of_size_one_grid_dims_are_ignored():
    raw = _rowsum_graph()
    raw[1]["bgraph"]["operators"][0]["input_map"].update(y=1, z=0)  # y, z have size 1: no split
    assert import_mirage_graph(raw) == import_mirage_graph(_rowsum_graph())


def test_red_ld_mean_is_sum_then_scale():
    g = import_mirage_graph(_rowsum_graph("tb_accum_red_ld_mean_op"))
    ops = g.customized_ops[0].block.ops
    assert [(op.kind, op.attr("fn")) for op in ops] == [("accum", "sum_last"), ("unary", "mul_scalar")]
    x = torch.randn(4, 64, dtype=torch.float64)
    assert torch.allclose(execute(g, [x])[0], x.mean(-1, keepdim=True))


@pytest.mark.parametrize(
    ("op_type", "torch_fn"),
    [
        ("kn_exp_op", torch.exp),
        ("kn_sqrt_op", torch.sqrt),
        ("kn_square_op", torch.square),
        ("kn_silu_op", torch.nn.functional.silu),
    ],
)
def test_kernel_unary_ops(op_type, torch_fn):
    x, y = _t(1, (3, 8)), _t(2, (3, 8))
    g = import_mirage_graph([_kn_input(1, (3, 8)), _kn(op_type, [x], y), _kn_output(y)])
    a = torch.rand(3, 8, dtype=torch.float64) + 0.1
    assert torch.allclose(execute(g, [a])[0], torch_fn(a))


@pytest.mark.parametrize(("op_type", "fn"), [("kn_add_op", torch.add), ("kn_sub_op", torch.sub), ("kn_mul_op", torch.mul), ("kn_div_op", torch.div)])
def test_kernel_binary_ops_broadcast(op_type, fn):
    a, b, y = _t(1, (3, 8)), _t(2, (3, 1)), _t(3, (3, 8))
    g = import_mirage_graph([_kn_input(1, (3, 8)), _kn_input(2, (3, 1)), _kn(op_type, [a, b], y), _kn_output(y)])
    xa, xb = torch.rand(3, 8, dtype=torch.float64), torch.rand(3, 1, dtype=torch.float64) + 0.5
    assert torch.allclose(execute(g, [xa, xb])[0], fn(xa, xb))


def test_kernel_reduction_matmul_and_dtypes():
    a, b, m, r = _t(1, (2, 3, 8), 930), _t(2, (8, 5), 930), _t(3, (2, 3, 5), 930), _t(4, (2, 1, 5), 930)
    g = import_mirage_graph([_kn_input(1, (2, 3, 8), 930), _kn_input(2, (8, 5), 930), _kn("kn_matmul_op", [a, b], m), _kn("kn_reduction_1_op", [m], r), _kn_output(r)])
    assert g.info[g.outputs[0]].dtype == "float32"
    xa, xb = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
    assert torch.allclose(execute(g, [xa, xb])[0], (xa @ xb).sum(1, keepdim=True))
    assert import_mirage_graph([_kn_input(1, (4,), 920), _kn_output(_t(1, (4,), 920))]).info[0].dtype == "bfloat16"


def test_unknown_kernel_op_type_names_type_and_position():
    x, y = _t(1, (3, 8)), _t(2, (3, 8))
    with pytest.raises(MuGraphError, match=r"kernel op 1 \(kn_gelu_op\).*unknown operator type 'kn_gelu_op'"):
        import_mirage_graph([_kn_input(1, (3, 8)), _kn("kn_gelu_op", [x], y), _kn_output(y)])


def test_unknown_block_op_type_names_type_and_position():
    raw = _rowsum_graph()
    raw[1]["bgraph"]["operators"][1]["op_type"] = "tb_relu_op"
    with pytest.raises(MuGraphError, match=r"kernel op 1 \(kn_customized_op\), block op 1 \(tb_relu_op\).*unknown operator type"):
        import_mirage_graph(raw)


def test_unknown_accumulator_is_refused():
    with pytest.raises(MuGraphError, match=r"block op 1 \(tb_forloop_accum_max_op\).*unknown accumulator"):
        import_mirage_graph(_rowsum_graph("tb_forloop_accum_max_op", code=941))


def test_unsupported_dtype_code_is_refused():
    with pytest.raises(MuGraphError, match=r"data_type code 940 is not supported; known codes in the 2024 numbering: .*921 \(float16\)"):
        import_mirage_graph(_rowsum_graph(code=940))  # 940 is float64 in the 2024 numbering


def test_declared_shape_mismatch_is_reported():
    raw = _rowsum_graph()
    raw[1]["bgraph"]["operators"][0]["output_tensors"][0]["dim"][1] = 16  # claims a (1, 16) tile
    with pytest.raises(MuGraphError, match=r"block op 0 \(tb_input_op\): tile 11 is declared \[1, 16\] but imports as \[1, 32\]"):
        import_mirage_graph(raw)
    raw = _rowsum_graph()
    raw[1]["output_tensors"][0]["dim"][1] = 2
    with pytest.raises(MuGraphError, match=r"kernel op 1 \(kn_customized_op\): tensor 2 is declared"):
        import_mirage_graph(raw)


def test_mul_scalar_without_scalar_is_refused():
    x, y = _t(1, (3, 8)), _t(2, (3, 8))
    with pytest.raises(MuGraphError, match="scalar is not recorded"):
        import_mirage_graph([_kn_input(1, (3, 8)), _kn("kn_mul_scalar_op", [x], y), _kn_output(y)])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r[1].pop("bgraph"), r"kernel op 1 \(kn_customized_op\): missing field 'bgraph'"),
        (lambda r: r[0]["output_tensors"][0].update(num_dims="2"), r"field 'num_dims' should be int"),
        (lambda r: r[2]["input_tensors"][0].update(guid=99), r"kernel op 2 \(kn_output_op\): input tensor guid 99 is not produced"),
        (lambda r: r[1]["bgraph"]["operators"][0]["dtensor"].update(guid=7), r"loads kernel tensor 7, which is not an input"),
        (lambda r: r[1]["bgraph"]["operators"].pop(2), r"written by no tb_output_op"),
        (lambda r: r.pop(2), r"no kn_output_op"),
        (lambda r: r[2].update(input_tensors=[]), r"kernel op 2 \(kn_output_op\): kn_output_op takes exactly one input tensor, got 0"),
        (lambda r: r[0].update(input_strides=[64, "1"]), r"kernel op 0 \(kn_input_op\): input_strides \[64, '1'\] should be 2 positive integers"),
        (lambda r: r[1]["bgraph"]["operators"][1].update(input_tensors=[]), r"as imported \(block inputs numbered first\): kernel op 1 \(customized\), block op 0 \(accum\(fn=sum_last\)\): takes 1 input\(s\), got 0"),
        (lambda r: r[1]["bgraph"]["grid_dim"].update(y=0), r"grid_dim.y = 0 must be positive"),
        (lambda r: r[1]["bgraph"]["operators"][0]["input_map"].update(x=-3), r"input_map.x = -3; expected a tensor dim or -1"),
        (lambda r: r[1]["bgraph"]["operators"][2]["output_map"].update(x=5), r"output_map\[0\] = 5 is not a dim"),
    ],
)
def test_malformed_upstream_graphs(mutate, message):
    raw = _rowsum_graph()
    mutate(raw)
    with pytest.raises(MuGraphError, match=message):
        import_mirage_graph(raw)


def test_file_level_errors_name_the_graph(tmp_path):
    bad = _rowsum_graph()
    bad[1]["op_type"] = "kn_mystery_op"
    path = tmp_path / "two.json"
    path.write_text(json.dumps([_rowsum_graph(), bad]))
    with pytest.raises(MuGraphError, match=r"two.json: graph 1: .*kn_mystery_op"):
        import_mirage_file(path)
    (tmp_path / "bad.json").write_text("[[{")
    with pytest.raises(MuGraphError, match="not valid JSON"):
        import_mirage_file(tmp_path / "bad.json")
    with pytest.raises(MuGraphError, match="not an upstream Mirage"):
        import_mirage_obj({"format": "mirage-serve.mugraph"})
    assert len(import_mirage_obj(_rowsum_graph())) == 1  # a bare single graph is accepted too
