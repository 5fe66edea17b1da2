"""``mirage-serve verify``: file formats, dims inference, output, exit codes, bad input."""

import json

import pytest
from handwritten import fused_rmsnorm_linear
from test_verify_mutants import attention_graph, rmsnorm_linear_graph

from mirage_serve.cli import main
from mirage_serve.mugraph import to_json


def _write(tmp_path, name, graph):
    p = tmp_path / name
    p.write_text(to_json(graph))
    return str(p)


def test_equivalent_canonical_file_exit_0(tmp_path, capsys):
    path = _write(tmp_path, "good.json", fused_rmsnorm_linear(4, 64, 48, 6, 4))
    assert main(["verify", path, "--spec", "rmsnorm_linear"]) == 0
    out = capsys.readouterr().out
    assert "graph 0: equivalent against rmsnorm_linear(batch=4, hidden=64, out=48)" in out
    assert "trial 3: p=" in out and "float float32" in out


def test_not_equivalent_exit_1_and_json(tmp_path, capsys):
    path = _write(tmp_path, "bad.json", rmsnorm_linear_graph(eps=1e-5))
    assert main(["verify", path, "--spec", "rmsnorm_linear", "--json", "--seed", "5", "--trials", "2"]) == 1
    doc = json.loads(capsys.readouterr().out)
    (res,) = doc["results"]
    cert = res["certificate"]
    assert cert["verdict"] == "not_equivalent" and cert["seed"] == 5 and cert["trials"] == 2
    assert res["dims"] == {"batch": 4, "hidden": 64, "out": 64}
    assert doc["summary"] == "0 equivalent, 1 not equivalent, 0 unknown"


def test_unknown_exit_2(tmp_path, capsys):
    path = _write(tmp_path, "maxdep.json", attention_graph(plain_sum=True))
    dims = "batch=2,q_heads=4,kv_heads=2,head_dim=16,kv_len=64"
    assert main(["verify", path, "--spec", "attention_decode", "--dims", dims, "--no-float-check"]) == 2
    assert "graph 0: unknown" in capsys.readouterr().out
    # with the float check the difference is found
    assert main(["verify", path, "--spec", "attention_decode", "--dims", dims]) == 1


def test_bad_input_exit_2_with_message(tmp_path, capsys):
    good = _write(tmp_path, "good.json", fused_rmsnorm_linear(4, 64, 48, 6, 4))
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "num.json").write_text("3")
    cases = [
        ([str(tmp_path / "missing.json"), "--spec", "rmsnorm_linear"], "no such file"),
        ([str(tmp_path / "junk.json"), "--spec", "rmsnorm_linear"], "not valid JSON"),
        ([str(tmp_path / "num.json"), "--spec", "rmsnorm_linear"], "neither"),
        ([good, "--spec", "no_such_spec"], "unknown spec"),
        ([good, "--spec", "rmsnorm_linear", "--dims", "batch=four"], "not name=integer"),
        ([good, "--spec", "rmsnorm_linear", "--dims", "batch=4,depth=3"], "no dim(s) ['depth']"),
        ([good, "--spec", "rmsnorm_linear", "--index", "3"], "holds graphs 0..0"),
        ([good, "--spec", "rmsnorm_linear", "--trials", "0"], "at least one trial"),
    ]
    for argv, message in cases:
        assert main(["verify", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)


def test_upstream_file_needs_index_or_all(capsys):
    from conftest import MUGRAPHS

    if not MUGRAPHS.is_dir():
        pytest.skip(f"upstream Mirage corpus not found at {MUGRAPHS}")

    path = str(MUGRAPHS / "lora.json")
    assert main(["verify", path, "--spec", "mirage_lora"]) == 2
    assert "holds 4 graphs; pass --index N or --all" in capsys.readouterr().err
    assert main(["verify", path, "--spec", "mirage_lora", "--index", "2", "--trials", "1"]) == 0
    assert "graph 2: equivalent against mirage_lora(batch=16, in=256, out=4096, rank=16)" in capsys.readouterr().out
