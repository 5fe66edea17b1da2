"""``mirage-serve show``: readable listings and canonical JSON of our files and upstream ones."""

from __future__ import annotations

import json

import pytest
from conftest import MUGRAPHS
from handwritten import fused_rmsnorm_linear, split_kv_attention
from test_mirage_import import _rowsum_graph

from mirage_serve.cli import main
from mirage_serve.mugraph import from_json, to_json
from mirage_serve.mugraph.mirage_import import import_mirage_file, import_mirage_obj


@pytest.fixture
def kv_file(tmp_path):
    path = tmp_path / "kv.json"
    path.write_text(to_json(split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4), indent=2))
    return path


@pytest.fixture
def upstream_file(tmp_path):
    path = tmp_path / "upstream.json"
    path.write_text(json.dumps([_rowsum_graph(), _rowsum_graph("tb_accum_red_ld_rms_op"), _rowsum_graph("tb_accum_red_ld_mean_op")]))
    return path


def _show(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["show", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_show_canonical_lists_ops_and_block_graphs(capsys, kv_file):
    rc, out, err = _show(capsys, kv_file)
    assert rc == 0 and err == ""
    for expected in [
        "kernel graph: 3 input(s), 2 operator(s) (2 customized), 1 output(s); content hash ",
        "t0 = input 'Q': float32[4, 4, 16]",
        "t3, t4, t5 = customized(t0, t1, t2)  [kernel op 3]",
        "grid [4, 3] (12 blocks), forloop_range 4",
        "b1 = load t1 (arg 1) input_map [0, 1], forloop_dim 1: tile float32[1, 8, 16], per iteration",
        "b0 = load t0 (arg 0) input_map [0, -1], no for-loop dim: tile float32[1, 4, 16], loop-invariant",
        "b3 = matmul(b0, b1, trans_b=True): float32[1, 4, 8], per iteration",
        "b5 = accum.max_last(b4): float32[1, 4, 1], running max",
        "b10 = accum.rescaled_sum(b9, b5): float32[1, 4, 16], after the loop",
        "t5 <- b10 output_map [0, -1]: float32[3, 4, 4, 16] (partial results over grid dim(s) [1])",
        "b7 = reduce.sum(b6, dim=0, keepdim=False): float32[1, 4, 16], loop-invariant",
        "t6 <- b10 output_map [0]: float32[4, 4, 16]",
        "outputs: t6",
    ]:
        assert expected in out, expected
    assert "# graph" not in out  # a single graph has no per-graph headers


def test_show_json_reemits_canonical_form(capsys, kv_file):
    rc, out, _ = _show(capsys, kv_file, "--json")
    assert rc == 0
    graph = split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4)
    assert out == to_json(graph) + "\n"  # the file was indented; the output is canonical
    assert from_json(out) == graph


def test_show_upstream_file_all_graphs_and_index(capsys, upstream_file):
    graphs = import_mirage_file(upstream_file)
    rc, out, _ = _show(capsys, upstream_file)
    assert rc == 0
    assert [line for line in out.splitlines() if line.startswith("# graph")] == [f"# graph {i} of 3 in {upstream_file}" for i in range(3)]
    assert "accum.sum_last(b0)" in out and "accum.rms_last(b0)" in out and "unary.mul_scalar(b1, scalar=0.015625)" in out
    rc, out, _ = _show(capsys, upstream_file, "--index", "1")
    assert rc == 0 and "# graph 1 of 3" in out and "accum.rms_last(b0): float16[1, 1], after the loop" in out
    assert "# graph 0" not in out and "# graph 2" not in out
    rc, out, _ = _show(capsys, upstream_file, "--json")
    lines = out.splitlines()
    assert rc == 0 and [from_json(line) for line in lines] == graphs
    rc, out, _ = _show(capsys, upstream_file, "--json", "--index", "2")
    assert out == to_json(graphs[2]) + "\n"


def test_show_a_bare_upstream_graph(capsys, tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(_rowsum_graph()))
    rc, out, _ = _show(capsys, path, "--json")
    assert rc == 0 and from_json(out) == import_mirage_obj(_rowsum_graph())[0]


@pytest.mark.skipif(not MUGRAPHS.is_dir(), reason=f"upstream Mirage corpus not found at {MUGRAPHS}")
def test_show_every_corpus_file(capsys):
    for path in sorted(MUGRAPHS.glob("*.json")):
        n = len(json.loads(path.read_text()))
        rc, out, err = _show(capsys, path)
        assert rc == 0 and err == "", path
        assert out.count("# graph ") == (n if n > 1 else 0) and out.count("kernel graph:") == n
    rc, out, _ = _show(capsys, MUGRAPHS / "rmsnorm_bs1.json", "--index", "0")
    assert "grid [256] (256 blocks), forloop_range 32" in out
    assert "b2 = accum.rms_last(b0): float16[2, 1], after the loop" in out
    assert "t2 <- b5 output_map [1]: float16[2, 6144]" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("42", "neither a mirage-serve μGraph"),
        ('{"format": "mirage-serve.mugraph", "version": 9, "kernel": {}}', "version 9 is not supported"),
        (json.dumps([[{"op_type": "kn_conv_op", "input_tensors": [], "output_tensors": []}]]), "graph 0: upstream Mirage graph, kernel op 0 (kn_conv_op)"),
        ("[" * 50000 + "]" * 50000, "nested too deeply"),
    ],
)
def test_show_errors_go_to_stderr_with_status_2(capsys, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    rc, out, err = _show(capsys, path)
    assert rc == 2 and out == ""
    assert err.startswith("mirage-serve show: ") and message in err


def test_show_missing_file_and_bad_index(capsys, tmp_path, upstream_file):
    rc, out, err = _show(capsys, tmp_path / "absent.json")
    assert rc == 2 and out == "" and "No such file" in err
    rc, out, err = _show(capsys, upstream_file, "--index", "3")
    assert rc == 2 and out == "" and "holds 3 graph(s); --index must be 0..2, got 3" in err
    path = tmp_path / "g.json"
    path.write_text(to_json(fused_rmsnorm_linear(4, 64, 48, n_blocks=6, loop=4)))
    rc, _, err = _show(capsys, path, "--index", "-1")
    assert rc == 2 and "--index must be 0..0, got -1" in err
    rc, out, _ = _show(capsys, path, "--index", "0")
    assert rc == 0 and "mean_sq_last" in out
