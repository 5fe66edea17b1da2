"""Upstream Mirage μGraphs (../shared/mirage-mugraphs): every imported graph is supported by the
generator, and the first graph of each file compiles to Hopper PTX."""

from __future__ import annotations

import pytest
from conftest import MUGRAPHS

from mirage_serve.codegen import CodegenParams, compile_graph, supports
from mirage_serve.codegen.aot import compile_to_ptx

FILES = sorted(MUGRAPHS.glob("*.json")) if MUGRAPHS.is_dir() else []
pytestmark = pytest.mark.skipif(not FILES, reason="upstream corpus not present")


def _import(path):
    mi = pytest.importorskip("mirage_serve.mugraph.mirage_import")
    return mi.import_mirage_file(path)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_upstream_graph_is_supported(path):
    graphs = _import(path)
    assert graphs
    unsupported = [(i, why) for i, g in enumerate(graphs) for ok, why in [supports(g)] if not ok]
    assert not unsupported, unsupported[:3]


def test_first_graph_of_each_file_compiles_to_ptx():
    sources = []
    for path in FILES:
        sources += compile_graph(_import(path)[0], CodegenParams()).kernel_sources
    ptxs = compile_to_ptx(sources, arch=90)
    assert all(f".entry {s.name}" in p for s, p in zip(sources, ptxs, strict=True))


@pytest.mark.parametrize("name,index", [("lora.json", 0), ("ntrans_bs1.json", 0)])
def test_small_upstream_graphs_match_reference_in_fp16(name, index):
    import torch

    from mirage_serve.reference import execute, random_inputs

    path = MUGRAPHS / name
    if not path.exists():
        pytest.skip(f"{name} not in the corpus")
    g = _import(path)[index]
    ins = random_inputs(g, torch.Generator().manual_seed(0), scale=0.3)
    outs, refs = compile_graph(g)(*ins), execute(g, ins)
    for o, r in zip(outs, refs, strict=True):
        assert float((o.double() - r).abs().max() / r.abs().max()) < 5e-3
