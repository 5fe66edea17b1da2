"""``mirage-serve search``: argument parsing, errors, table and JSON output."""

import argparse
import json

import pytest
from test_search_standins import numeric_engine

import mirage_serve.search.cli as search_cli
import mirage_serve.search.driver as driver
from mirage_serve.cli import build_parser
from mirage_serve.mugraph import MuGraphError, graph_from_obj
from mirage_serve.search.cli import format_table, parse_dims, result_to_obj


def test_parse_dims():
    assert parse_dims("batch=16, hidden=4096") == {"batch": 16, "hidden": 4096}
    assert parse_dims("") == {}
    with pytest.raises(MuGraphError, match="NAME=VALUE"):
        parse_dims("batch16")
    with pytest.raises(MuGraphError, match="integer"):
        parse_dims("batch=x")


def test_dispatcher_knows_the_command():
    args = build_parser(only="search").parse_args(["search", "gated_mlp", "--dims", "batch=2", "--no-prune", "--jobs", "1"])
    assert args.spec == "gated_mlp" and args.no_prune and args.jobs == 1 and args.dtype == "bfloat16"


def _args(**kw):
    p = argparse.ArgumentParser()
    search_cli.add_arguments(p)
    argv = [kw.pop("spec")]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return p.parse_args(argv)


def test_bad_spec_or_dims_exit_2(capsys):
    assert search_cli.run(_args(spec="nope", dims="a=1")) == 2
    assert "unknown spec" in capsys.readouterr().err
    assert search_cli.run(_args(spec="gated_mlp", dims="batch=2")) == 2
    assert "needs dim" in capsys.readouterr().err


def test_search_writes_verified_graphs_best_first(tmp_path, monkeypatch, capsys):
    # drive the enumeration with the numeric stand-in (no abstract expressions needed here)
    real = driver.superoptimize

    def small(spec, cfg):
        cfg = cfg.replace(max_grid_dims=1, tile_widths=(8,), loop_chunks=(16,), max_block_inputs=2)
        return real(spec, cfg, engine_factory=numeric_engine)

    monkeypatch.setattr(search_cli, "superoptimize", small)
    out = tmp_path / "r.json"
    rc = search_cli.run(_args(spec="rmsnorm_linear", dims="batch=2,hidden=32,out=16", dtype="float32", json=out,
                              max_kernel_ops=2, max_block_ops=1, jobs=2, time_budget=20, no_progress=True))
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "rank" in text and "verdict" in text and "equivalent" in text
    obj = json.loads(out.read_text())
    assert obj["spec"] == "rmsnorm_linear" and obj["stats"]["verified"] >= 1
    costs = [c["cost_s"] for c in obj["candidates"]]
    assert costs == sorted(costs)
    for c in obj["candidates"]:
        assert c["certificate"]["verdict"] == "equivalent"
        graph_from_obj(c["graph"])  # canonical, valid μGraph JSON


def test_format_table_on_empty_result():
    r = driver.SearchResult()
    assert "0 verified" in format_table(r)
    assert result_to_obj(r, {"spec": "x"})["candidates"] == []
