"""The fuzzer's own parts: generated programs mean what they say (every lowering agrees
with the unfused spec), rewrites are identities, the oracles catch planted faults (a
kernel off by 1e-4, NaN turned into zeros, a verifier that accepts anything) and let
correct low-precision results through, and the minimiser isolates a failure."""

from __future__ import annotations

import random

import pytest
import torch

import mirage_serve.codegen as codegen
import mirage_serve.verify as verify
from mirage_serve.fuzz import blocks, kernels, programs
from mirage_serve.fuzz.oracles import check_codegen, check_reference_agrees, check_verifier, ground_truth
from mirage_serve.fuzz.shrink import minimise
from mirage_serve.reference import execute


def test_every_lowering_of_a_program_agrees_with_its_spec():
    kinds = set()
    for seed in range(40):
        rng = random.Random(seed)
        prog = programs.random_program(rng)
        kinds.add(prog.skeleton)
        graphs = {"spec": programs.lower_spec(prog)}
        for j in range(3):
            t = programs.random_tiling(prog, rng)
            graphs[t.describe() + f" #{j}"] = programs.lower_block(prog, t)
        assert check_reference_agrees(graphs, seed) is None, prog.to_obj()
    assert kinds == set(programs.SKELETONS)


def test_program_json_round_trip():
    prog = programs.random_program(random.Random(3))
    assert programs.Program.from_obj(prog.to_obj()) == prog


def test_rewrites_are_identities():
    applied = set()
    for seed in range(60):
        rng = random.Random(seed)
        g = kernels.random_kernel_graph(rng)
        rw, what = kernels.rewrite(g, rng, 2)
        applied.update(what)
        truth, _ = ground_truth(rw, g, seed)
        assert truth in ("same", "unclear") or not torch.isfinite(execute(rw, [torch.ones(g.info[t].shape, dtype=torch.float64) for t in g.input_ids])[0]).all(), what
    assert len(applied) >= 6


def test_mutants_are_valid_graphs():
    made = 0
    for seed in range(40):
        rng = random.Random(seed)
        g = blocks.random_block_graph(rng)
        m = kernels.mutate(g, rng)
        if m is not None:
            m[0].validate()
            made += 1
    assert made >= 30


def _graph():
    prog = programs.random_program(random.Random(11), skeleton="matmul", dtype="float32")
    return programs.lower_block(prog, programs.random_tiling(prog, random.Random(1)))


def _wrapping(monkeypatch, transform):
    real = codegen.compile_graph

    def fake(graph, params=None):
        cg = real(graph, params)

        class Wrapped:
            def __getattr__(self, name):
                return getattr(cg, name)

            def __call__(self, *xs):
                return [transform(y) for y in cg(*xs)]

        return Wrapped()

    monkeypatch.setattr(codegen, "compile_graph", fake)


def test_codegen_oracle_passes_the_real_kernel():
    assert check_codegen(_graph(), 0).outcome == "pass"


def test_codegen_oracle_catches_a_small_error(monkeypatch):
    _wrapping(monkeypatch, lambda y: y * (1 + 1e-4))
    r = check_codegen(_graph(), 0)
    assert r.outcome == "finding" and r.tag == "mismatch", r


def test_codegen_oracle_catches_silent_zeros(monkeypatch):
    _wrapping(monkeypatch, lambda y: torch.nan_to_num(y, nan=0.0))
    r = check_codegen(_graph(), 0, faults=2)
    assert r.outcome == "finding" and r.tag == "nan-dropped", r


def test_codegen_oracle_accepts_bf16_truncation():
    """One bf16 ulp of truncation on store (what the interpreter does) is within the bound."""
    prog = programs.random_program(random.Random(5), skeleton="matmul", dtype="bfloat16")
    g = programs.lower_block(prog, programs.random_tiling(prog, random.Random(2)))
    assert check_codegen(g, 1).outcome == "pass"


def test_verifier_oracle_catches_a_false_accept(monkeypatch):
    prog = programs.random_program(random.Random(4), skeleton="matmul", dtype="float32")
    spec = programs.lower_spec(prog)
    mutant = None
    rng = random.Random(0)
    while mutant is None or ground_truth(mutant, spec, 0)[0] != "differs":
        mutant = kernels.mutate(spec, rng)[0]
    assert check_verifier(mutant, spec, 0).outcome == "agree"

    class Yes:
        verdict, reason = "equivalent", "stub that accepts everything"

    monkeypatch.setattr(verify, "verify_equivalent", lambda *a, **k: Yes())
    r = check_verifier(mutant, spec, 0)
    assert r.outcome == "finding" and r.tag == "false-accept"


def test_minimiser_isolates_a_planted_failure():
    g = blocks.random_block_graph(random.Random(8))
    while not any(o.kind == "unary" for op in g.ops if op.block for o in op.block.ops):
        g = blocks.random_block_graph(random.Random(len(g.ops) * 7919 + 1))

    def has_unary(gs):
        return any(o.kind == "unary" for op in gs["graph"].ops if op.block for o in op.block.ops)

    small = minimise({"graph": g}, has_unary, budget_s=30)["graph"]
    blk = next(op.block for op in small.ops if op.block)
    kinds = [o.kind for o in blk.ops]
    assert kinds.count("unary") == 1 and len(kinds) <= 2  # a per-iteration tile needs an accumulator to be written
    assert all(s <= 2 for t in small.input_ids for s in small.info[t].shape)


@pytest.mark.parametrize("kind", ["program", "kernel", "block"])
def test_one_case_of_each_kind_runs(kind):
    from mirage_serve.fuzz.runner import FuzzConfig, Fuzzer

    f = Fuzzer(FuzzConfig(seed=1, kinds=(kind,), minimise_s=5))
    for i in range(3):
        f.case(i)
    assert f.report.cases[kind] == 3 and not f.report.crashes


def test_reports_read_back_and_add_up(tmp_path, capsys):
    import json

    from mirage_serve.fuzz.__main__ import summarise
    from mirage_serve.fuzz.runner import FuzzConfig, FuzzReport, format_report, merge_reports, run_fuzz

    reports = [run_fuzz(FuzzConfig(seed=s, max_cases=4, codegen=False)) for s in (3, 4)]
    back = [FuzzReport.from_obj(json.loads(json.dumps(r.to_obj(), default=str))) for r in reports]
    assert [format_report(b) for b in back] == [format_report(r) for r in reports]
    total = merge_reports(back)
    assert sum(total.cases.values()) == 8 and total.graphs == reports[0].graphs + reports[1].graphs
    assert total.outcomes == reports[0].outcomes + reports[1].outcomes and total.faults == reports[0].faults + reports[1].faults
    paths = []
    for i, r in enumerate(reports):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r.to_obj(), default=str))
    assert summarise(paths) == 0
    out = capsys.readouterr().out
    assert "| r0.json | 3 | 4 |" in out and f"8 cases, {sum(total.graphs.values())} graphs" in out
