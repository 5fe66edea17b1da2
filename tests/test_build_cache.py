"""``mirage-serve build-cache``: planning, dry runs, argument errors, and honest failures of missing steps."""

from __future__ import annotations

import json
import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mirage_serve import cmd_build_cache  # noqa: E402
from mirage_serve.cli import main  # noqa: E402
from mirage_serve.models import get_adapter  # noqa: E402
from mirage_serve.models.base import Subgraph  # noqa: E402


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    """``build-cache ARGV --json`` without the shipped entries (which would make the bundled models cached)."""
    rc = main(["build-cache", *argv, "--json", *([] if "--no-package" in argv else ["--no-package"])])
    return rc, json.loads(capsys.readouterr().out)


def test_dry_run_lists_every_subgraph_and_bucket(capsys, tmp_path):
    rc, report = run_json(capsys, "meta-llama/Llama-3.1-8B-Instruct", "--dry-run", "--cache-dir", str(tmp_path / "c"))
    assert rc == 0 and report["dry_run"]
    assert report["config_source"] == "bundled:meta-llama/Llama-3.1-8B-Instruct"
    assert report["batch_sizes"] == [1, 2, 4, 8, 16, 32, 64] and report["kv_len_buckets"] == [1024, 4096, 16384]
    # 5 projection/MLP kernels + 3 attention buckets per batch bucket
    assert report["distinct_kernels"] == 7 * 8 == len(report["results"])
    assert {r["status"] for r in report["results"]} <= {"planned", "cached"}
    assert report["counts"]["built"] == 0
    qkv = next(r for r in report["results"] if r["subgraph"] == "attn_norm_qkv" and r["dims"]["batch"] == 8)
    assert qkv["dims"] == {"batch": 8, "hidden": 4096, "out": (32 + 2 * 8) * 128}
    assert qkv["dtype"] == "bfloat16" and qkv["options"] == {"eps": 1e-05} and qkv["sites"] == 32 * 4
    att = [r for r in report["results"] if r["spec"] == "attention_decode" and r["dims"]["batch"] == 64]
    assert sorted(r["dims"]["kv_len"] for r in att) == [1024, 4096, 16384]
    assert not list(tmp_path.rglob("*.json"))  # nothing written


def test_dry_run_default_model_table(capsys):
    rc = main(["build-cache", "--dry-run", "--batch-sizes", "1,8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("meta-llama/Llama-3.2-1B-Instruct: llama, bfloat16")
    for col in ("subgraph", "bucket", "status", "verified", "speed-up", "time"):
        assert col in out
    assert "rmsnorm_linear(batch=8,hidden=2048,out=3072)" in out
    assert "attention_decode(batch=1,q_heads=32,kv_heads=8,head_dim=64,kv_len=16384)" in out


def test_dry_run_options(capsys, tmp_path):
    lora = tmp_path / "adapter_config.json"
    lora.write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}))
    rc, report = run_json(capsys, "Qwen/Qwen3-8B", "--dry-run", "--batch-sizes", "4", "--tensor-parallel", "2",
                          "--lora-config", str(lora), "--kv-lens", "2048", "--dtype", "float16")
    assert rc == 0 and report["tensor_parallel"] == 2 and report["kv_len_buckets"] == [2048]
    by_sub = {r["subgraph"]: r for r in report["results"]}
    assert by_sub["attention_decode"]["dims"] == {"batch": 4, "q_heads": 16, "kv_heads": 4, "head_dim": 128, "kv_len": 2048}
    assert by_sub["lora:q_proj"]["dims"] == {"batch": 4, "in": 4096, "out": 2048, "rank": 16}
    assert by_sub["lora:v_proj"]["dims"] == {"batch": 4, "in": 4096, "out": 512, "rank": 16}
    assert by_sub["lora:q_proj"]["options"] == {"scale": 2.0}
    assert {r["dtype"] for r in report["results"]} == {"float16"}
    assert any("q_norm" in u for u in by_sub["attn_norm_qkv"]["unfused"])


def test_identical_subgraphs_are_built_once():
    sg = get_adapter("llama").subgraphs({"model_type": "llama", "hidden_size": 64, "intermediate_size": 32,
                                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                                         "max_position_embeddings": 128}, [1])
    # q+k+v out = 3*64 = 192 and gate+up out = 2*32 = 64 differ, so force a collision with a copy
    twin = Subgraph(sg[0].spec_name, dict(sg[0].dims), "other_role", ["x.y"], sg[0].dtype, dict(sg[0].options))
    items = cmd_build_cache.dedupe([*sg, twin])
    assert len(items) == len(sg)
    assert items[0].roles == [sg[0].role, "other_role"] and items[0].sites[-1] == "x.y"
    differing_eps = Subgraph(sg[0].spec_name, dict(sg[0].dims), "r", [], sg[0].dtype, {"eps": 1e-3})
    assert len(cmd_build_cache.dedupe([sg[0], differing_eps])) == 2


def test_argument_errors(capsys):
    assert main(["build-cache", "nobody/nothing", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "not found offline" in err and "models--nobody--nothing" in err
    assert main(["build-cache", "meta-llama/Llama-3.1-8B-Instruct", "--dry-run", "--tensor-parallel", "3"]) == 2
    assert "tensor_parallel=3 does not divide" in capsys.readouterr().err
    assert main(["build-cache", "--dry-run", "--batch-sizes", "1,x"]) == 2
    assert "comma-separated" in capsys.readouterr().err


def test_patience_reaches_the_search_and_zero_turns_it_off(capsys, tmp_path, monkeypatch):
    from mirage_serve.search.driver import SearchResult, SearchStats

    configs = []

    def empty_search(spec, config):
        configs.append(config)
        return SearchResult([], SearchStats(complete=True))

    monkeypatch.setattr("mirage_serve.search.superoptimize", empty_search)
    for argv, want in (((), cmd_build_cache.DEFAULT_PATIENCE_S), (("--patience", "5"), 5.0), (("--patience", "0"), None)):
        rc, _ = run_json(capsys, "--batch-sizes", "1", "--only", "attn_norm_qkv", "--rebuild", *argv, "--cache-dir", str(tmp_path))
        assert rc == 0 and configs[-1].patience_s == want
    assert main(["build-cache", "--dry-run", "--patience", "-1"]) == 2
    assert "--patience >= 0" in capsys.readouterr().err


def test_a_missing_step_fails_clearly_and_writes_nothing(capsys, tmp_path, monkeypatch):
    """A pipeline piece absent from the build must fail its step with a message naming it, never fake an entry."""
    real_import = cmd_build_cache.importlib.import_module

    def without_search(name, *a, **k):
        if name == "mirage_serve.search":
            raise ImportError("No module named 'mirage_serve.search' (hidden by the test)")
        return real_import(name, *a, **k)

    monkeypatch.setattr(cmd_build_cache.importlib, "import_module", without_search)
    rc, report = run_json(capsys, "--batch-sizes", "1", "--kv-lens", "1024", "--cache-dir", str(tmp_path / "c"), "--no-package")
    assert rc == 1
    assert report["counts"]["built"] == 0 and report["counts"]["failed"] == report["distinct_kernels"]
    for r in report["results"]:
        assert r["status"] == "failed" and r["verified"] is None and r["entry_id"] is None
        assert r["failed_step"] in ("lookup", "search") and "mirage_serve." in r["message"]
    assert not list(tmp_path.rglob("*.json"))


def test_only_filters_roles_and_specs(capsys):
    rc, report = run_json(capsys, "--dry-run", "--batch-sizes", "1,2", "--only", "attention_decode,attn_norm_qkv")
    assert rc == 0
    assert {r["subgraph"] for r in report["results"]} == {"attention_decode", "attn_norm_qkv"}
    assert len(report["results"]) == 2 * (3 + 1)
    assert main(["build-cache", "--dry-run", "--only", "nonsense"]) == 2
    assert "matches no subgraph" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["rmsnorm_linear", "attention_decode"])
def test_reinstantiate_carries_a_structure_to_other_buckets(case):
    """A fused μGraph built for one bucket, re-instantiated at another bucket's shapes, computes that bucket's spec.

    (build-cache then verifies each re-instantiated graph afresh; this checks the re-instantiation itself.)"""
    pytest.importorskip("mirage_serve.search.enumerate")
    import torch
    from handwritten import fused_rmsnorm_linear, split_kv_attention

    from mirage_serve.reference import execute, random_inputs
    from mirage_serve.search.config import SearchConfig
    from mirage_serve.specs import build_spec

    if case == "rmsnorm_linear":
        seed = fused_rmsnorm_linear(1, 256, 128, n_blocks=4, loop=2, eps=1e-5)
        targets = [{"batch": b, "hidden": 256, "out": 128} for b in (2, 64)]
        options = {"eps": 1e-5}
    else:
        seed = split_kv_attention(1, 4, 2, 32, 128, splits=2, loop=2)
        targets = [{"batch": 8, "q_heads": 4, "kv_heads": 2, "head_dim": 32, "kv_len": kv} for kv in (128, 512)]
        options = {}
    for dims in targets:
        spec = build_spec(case, dims, "float32", **options)
        graphs = cmd_build_cache.reinstantiate(seed, spec, SearchConfig())
        assert graphs
        x = random_inputs(spec, torch.Generator().manual_seed(0), dtype=torch.float64)
        want = execute(spec, x)
        for g in graphs:
            assert [g.info[t].shape for t in g.input_ids] == [spec.info[t].shape for t in spec.input_ids]
            assert all(torch.allclose(a, b) for a, b in zip(execute(g, x), want))
    # a structure for another spec's inputs does not carry over
    other = build_spec("gated_mlp", {"batch": 2, "hidden": 256, "intermediate": 128}, "float32")
    assert cmd_build_cache.reinstantiate(fused_rmsnorm_linear(1, 256, 128, 4, 2), other, SearchConfig()) == []


def test_a_seed_from_another_head_dim_takes_the_new_attention_scale():
    """Decode attention's 1/sqrt(head_dim) is a constant of the μGraph: a structure found at head dim 32
    seeds head dim 48 (group 1) only with that constant carried over, and then computes the new spec."""
    import torch
    from handwritten import split_kv_attention

    from mirage_serve.reference import execute, random_inputs
    from mirage_serve.search.config import SearchConfig
    from mirage_serve.specs import build_spec

    seed = split_kv_attention(1, 4, 2, 32, 128, splits=2, loop=2)
    spec = build_spec("attention_decode", {"batch": 2, "q_heads": 4, "kv_heads": 4, "head_dim": 48, "kv_len": 256}, "float32")
    assert cmd_build_cache.spec_scalar_map(seed, spec, "attention_decode") == {1 / math.sqrt(32): 1 / math.sqrt(48)}
    x = random_inputs(spec, torch.Generator().manual_seed(0), dtype=torch.float64)
    (want,) = execute(spec, x)
    carried = cmd_build_cache.reinstantiate(seed, spec, SearchConfig(), "attention_decode", {})
    assert carried and all(torch.allclose(execute(g, x)[0], want) for g in carried)
    stale = cmd_build_cache.reinstantiate(seed, spec, SearchConfig())  # without the spec's name: the old scale stays
    assert stale and not any(torch.allclose(execute(g, x)[0], want) for g in stale)
    # specs without dim-derived constants, and graphs whose spec cannot be rebuilt, map nothing
    rms = build_spec("rmsnorm_linear", {"batch": 2, "hidden": 64, "out": 32}, "float32")
    assert cmd_build_cache.spec_scalar_map(rms, rms, "rmsnorm_linear") == {}
    assert cmd_build_cache.spec_scalar_map(seed, spec, "no_such_spec") == {}


def test_family_ignores_only_the_bucketed_dims():
    a = Subgraph("attention_decode", {"batch": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 64, "kv_len": 1024}, "r", [])
    b = Subgraph("attention_decode", {"batch": 64, "q_heads": 8, "kv_heads": 2, "head_dim": 64, "kv_len": 16384}, "r", [])
    c = Subgraph("attention_decode", {"batch": 1, "q_heads": 8, "kv_heads": 1, "head_dim": 64, "kv_len": 1024}, "r", [])
    assert cmd_build_cache.family_of(a) == cmd_build_cache.family_of(b) != cmd_build_cache.family_of(c)


def test_a_spec_without_a_fused_form_runs_the_original_code(capsys, tmp_path, monkeypatch):
    """A search that ends without a verified μGraph is reported as 'original' (not a failure, no
    entry), and the other buckets and families of that spec are not searched again."""
    from mirage_serve.search.driver import SearchResult, SearchStats

    calls = []

    def empty_search(spec, config):
        calls.append(spec)
        return SearchResult([], SearchStats(enumerated=123, complete=True))

    monkeypatch.setattr("mirage_serve.search.superoptimize", empty_search)
    rc, report = run_json(capsys, "--batch-sizes", "1,2", "--only", "attn_norm_qkv,mlp_norm_gate_up",
                          "--cache-dir", str(tmp_path / "c"))
    assert rc == 0, report
    assert report["counts"]["original"] == report["distinct_kernels"] == 4 and report["counts"]["failed"] == 0
    assert len(calls) == 1  # QKV at batch 1; gate/up and batch 2 are the same spec
    first, *rest = report["results"]
    assert "no verified fused μGraph" in first["message"] and "searched its whole space" in first["message"]
    assert all("not searched" in r["message"] for r in rest)
    assert all(r["entry_id"] is None and r["verified"] is None for r in report["results"])
    assert not list((tmp_path / "c").rglob("entries/*.json"))
    # a second run does not repeat the search (the outcome is recorded beside the entries) ...
    rc, again = run_json(capsys, "--batch-sizes", "1,2", "--only", "attn_norm_qkv,mlp_norm_gate_up",
                         "--cache-dir", str(tmp_path / "c"))
    assert rc == 0 and len(calls) == 1 and again["counts"]["original"] == 4
    assert "recorded by an earlier run" in again["results"][0]["message"]
    # ... unless the budget grows, or --rebuild
    rc, bigger = run_json(capsys, "--batch-sizes", "1", "--only", "attn_norm_qkv", "--time-budget", "999",
                          "--cache-dir", str(tmp_path / "c"))
    assert rc == 0 and len(calls) == 2
    (tmp_path / "c" / "searches" / "x.json").write_text("{not json")  # foreign files are ignored
    rc, _ = run_json(capsys, "--batch-sizes", "1", "--only", "attn_norm_qkv", "--rebuild", "--cache-dir", str(tmp_path / "c"))
    assert rc == 0 and len(calls) == 3


def test_a_bucket_is_seeded_from_its_family_first_then_from_other_families():
    from mirage_serve.search.config import SearchConfig
    from mirage_serve.specs import build_spec
    from tests.handwritten import fused_rmsnorm_linear

    own, other = fused_rmsnorm_linear(1, 256, 128, n_blocks=4, loop=2), fused_rmsnorm_linear(1, 256, 64, n_blocks=2, loop=2)
    assert cmd_build_cache.seeds_for([own], [own, other]) == [own, other]
    assert cmd_build_cache.seeds_for(None, [other]) == [other]
    assert cmd_build_cache.seeds_for([], None) is None
    # the other family's structure re-instantiates at this family's shapes
    spec = build_spec("rmsnorm_linear", {"batch": 2, "hidden": 256, "out": 128}, "float32")
    assert cmd_build_cache.reinstantiate(other, spec, SearchConfig())


def test_seeds_are_distinct_structures_and_a_freshly_searched_bucket_leads_them(capsys, tmp_path, monkeypatch):
    from tests.handwritten import fused_rmsnorm_linear

    a1, a2 = fused_rmsnorm_linear(1, 256, 128, n_blocks=4, loop=2), fused_rmsnorm_linear(1, 256, 128, n_blocks=2, loop=4)
    b = fused_rmsnorm_linear(1, 256, 128, n_blocks=4, loop=2, eps=1e-5)  # another structure (its norm's eps)
    assert a1 != a2 and cmd_build_cache.structure_key(a1) == cmd_build_cache.structure_key(a2) != cmd_build_cache.structure_key(b)
    assert cmd_build_cache.distinct_structures([a1, a2, b]) == [a1, b]
    assert cmd_build_cache.merged_seeds([b], [a1, a2]) == [b, a1]

    # the run loop: batch 1's structures do not fit batch 2 (searched afresh); batch 4 gets batch 2's first
    seen: dict[int, list] = {}

    def fake_build(item, cache, arch, opts, seeds=None):
        batch = item.subgraph.dims["batch"]
        seen[batch] = list(seeds or [])
        graph, origin = {1: (a1, "search"), 2: (b, "search"), 4: (b, "seeded")}[batch]
        return cmd_build_cache.ItemResult(item, "built", verified=True, graphs=[graph], details={"origin": origin})

    monkeypatch.setattr(cmd_build_cache, "build_item", fake_build)
    rc, report = run_json(capsys, "--batch-sizes", "1,2,4", "--only", "gated_mlp", "--cache-dir", str(tmp_path / "c"))
    assert rc == 0 and report["counts"]["built"] == 3
    assert seen == {1: [], 2: [a1], 4: [b, a1]}


def test_a_bucket_too_large_to_verify_here_runs_the_original_code(capsys, tmp_path, monkeypatch):
    """Nothing unverified is cached, the build does not fail, and the bucket is not recorded as
    having no fused form (a build on a larger machine searches it)."""
    monkeypatch.setattr(cmd_build_cache, "available_memory_bytes", lambda: 1)
    rc, report = run_json(capsys, "--batch-sizes", "1", "--kv-lens", "1024", "--only", "attention_decode",
                          "--cache-dir", str(tmp_path / "c"))
    assert rc == 0 and report["results"]
    for r in report["results"]:
        assert r["status"] == "original" and r["entry_id"] is None
        assert "GiB" in r["message"] and "larger machine" in r["message"]
    assert not list(tmp_path.rglob("*.json"))


TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "vocab_size": 64, "torch_dtype": "float32",
}


def test_entries_already_in_the_cache_seed_another_models_build(capsys, tmp_path):
    """A model built earlier into the same cache seeds the next one: the structure of a cached
    RMSNorm→linear entry (other dims, same spec, dtype and eps) is re-instantiated at the new
    model's shapes and verified there afresh, so no search runs; --no-seed searches."""
    from mirage_serve.cache import CacheEntry, CacheKey, KernelCache
    from mirage_serve.specs import build_spec
    from mirage_serve.verify import verify_equivalent
    from tests.handwritten import fused_rmsnorm_linear

    cache_dir = tmp_path / "c"
    key = CacheKey("rmsnorm_linear", {"batch": 4, "hidden": 256, "out": 32}, "float32", "unprofiled", options={"eps": 1e-5})
    graph = fused_rmsnorm_linear(4, 256, 32, n_blocks=4, loop=4, eps=1e-5)
    cert = verify_equivalent(graph, build_spec("rmsnorm_linear", key.dims_dict, "float32", eps=1e-5), trials=2)
    assert cert.verdict == "equivalent"
    KernelCache(cache_dir, readonly_dirs=()).put(CacheEntry.create(key, graph, certificate=cert, params={}, timings={}))
    seeds = cmd_build_cache.cache_seeds(KernelCache(cache_dir, readonly_dirs=()), ("rmsnorm_linear", "float32", (("eps", 1e-5),)))
    assert seeds == [graph]

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    rc, report = run_json(capsys, str(model), "--only", "attn_norm_qkv", "--batch-sizes", "2", "--cache-dir", str(cache_dir),
                          "--no-package", "--time-budget", "30")
    (r,) = report["results"]
    assert rc == 0 and r["status"] == "built", r
    assert r["details"]["origin"] == "seeded" and "search" not in r["details"], r["details"]
    assert r["details"]["seeded"]["verified"] == 1
    # only the entry files of the wanted specs are read
    assert [e.key.spec for e in KernelCache(cache_dir, readonly_dirs=()).entries(specs={"gated_mlp"})] == []
    assert len(KernelCache(cache_dir, readonly_dirs=()).entries(specs={"rmsnorm_linear"})) == 2


def test_entries_of_another_triton_version_still_seed_the_search(tmp_path, caplog):
    """The package's entries are built with one Triton; on a machine with another they are stale
    (their code is not run), but their μGraphs still seed build-cache's searches: seeds are
    re-instantiated and verified afresh, so nothing of the stale entry is trusted."""
    from mirage_serve.cache import CacheEntry, CacheKey, KernelCache
    from mirage_serve.cache.entry import checksum_of
    from mirage_serve.specs import build_spec
    from mirage_serve.verify import verify_equivalent
    from tests.handwritten import fused_rmsnorm_linear

    pkg = tmp_path / "pkg"
    (pkg / "entries").mkdir(parents=True)
    key = CacheKey("rmsnorm_linear", {"batch": 4, "hidden": 256, "out": 32}, "float32", "unprofiled", options={"eps": 1e-5})
    graph = fused_rmsnorm_linear(4, 256, 32, n_blocks=4, loop=4, eps=1e-5)
    cert = verify_equivalent(graph, build_spec("rmsnorm_linear", key.dims_dict, "float32", eps=1e-5), trials=2)
    obj = CacheEntry.create(key, graph, certificate=cert, params={}, timings={}).to_obj()
    obj["key"]["triton_version"] = "0.0.1"
    obj["checksum"] = checksum_of(obj)
    (pkg / "entries" / CacheKey.from_obj(obj["key"]).filename).write_text(json.dumps(obj))
    cache = KernelCache(tmp_path / "user", readonly_dirs=(pkg,))
    assert cache.entries() == []
    with caplog.at_level("INFO", logger="mirage_serve.cmd_build_cache"):
        assert cmd_build_cache.cache_seeds(cache, ("rmsnorm_linear", "float32", (("eps", 1e-5),))) == [graph]
    assert "1 rmsnorm_linear entries of the cache were built for another Triton" in caplog.text and "triton 0.0.1" in caplog.text
    assert cmd_build_cache.cache_seeds(cache, ("rmsnorm_linear", "float32", (("eps", 1e-6),))) == []


def test_a_run_that_finds_everything_cached_reads_no_seeds(capsys, tmp_path, monkeypatch):
    def fake_build(item, cache, arch, opts, seeds=None):
        return cmd_build_cache.ItemResult(item, "cached", verified=True)

    seen = []
    monkeypatch.setattr(cmd_build_cache, "build_item", fake_build)
    monkeypatch.setattr(cmd_build_cache, "cache_seeds", lambda cache, kind: seen.append(kind) or [])
    monkeypatch.setattr(cmd_build_cache, "lookup", lambda cache, key: object())  # every key present
    rc, report = run_json(capsys, "--only", "attn_norm_qkv,gated_mlp", "--batch-sizes", "1,2", "--cache-dir", str(tmp_path / "c"))
    assert rc == 0 and report["counts"]["cached"] == 4 and not seen


def test_no_seed_ignores_the_cache_entries(capsys, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(cmd_build_cache, "cache_seeds", lambda cache, kind: seen.append(kind) or [])
    rc, _ = run_json(capsys, "--only", "attn_norm_qkv", "--batch-sizes", "1", "--dry-run", "--cache-dir", str(tmp_path / "c"))
    assert rc == 0 and not seen  # a dry run builds nothing and reads no seeds

    def fake_build(item, cache, arch, opts, seeds=None):
        return cmd_build_cache.ItemResult(item, "built", verified=True, details={"origin": "search"})

    monkeypatch.setattr(cmd_build_cache, "build_item", fake_build)
    run_json(capsys, "--only", "attn_norm_qkv", "--batch-sizes", "1", "--no-seed", "--cache-dir", str(tmp_path / "c"))
    assert not seen
    run_json(capsys, "--only", "attn_norm_qkv", "--batch-sizes", "1", "--cache-dir", str(tmp_path / "c"))
    assert len(seen) == 1


def test_seeds_that_keep_the_max_guard_are_verified_first(monkeypatch):
    """Seeded candidates are tried guarded-first: one that drops the spec's max guard on exp is only
    reached when no guarded one verifies (the fused kernel and the spec each play the unguarded one)."""
    from mirage_serve.search import rewrite
    from mirage_serve.search.config import SearchConfig
    from mirage_serve.specs import build_spec
    from tests.handwritten import fused_rmsnorm_linear

    spec = build_spec("rmsnorm_linear", {"batch": 2, "hidden": 256, "out": 64}, "float32", eps=1e-5)
    seeds = [fused_rmsnorm_linear(1, 256, 32, n_blocks=2, loop=2, eps=1e-5), spec]
    opts = cmd_build_cache.BuildOptions(time_budget_s=5, jobs=1, rebuild=False, trials=2)
    fused = lambda g: any(op.kind == "customized" for op in g.ops)
    # whichever of the two the cost model ranks first, the guarded one is verified first
    monkeypatch.setattr(rewrite, "numerically_safe", lambda g, s: fused(g))
    found, _ = cmd_build_cache.seeded_candidates(seeds, spec, SearchConfig(), opts, "cpu")
    assert fused(found[0].graph)
    monkeypatch.setattr(rewrite, "numerically_safe", lambda g, s: not fused(g))
    found, _ = cmd_build_cache.seeded_candidates(seeds, spec, SearchConfig(), opts, "cpu")
    assert not fused(found[0].graph)


def test_candidates_without_the_max_guard_are_never_cached(capsys, tmp_path, monkeypatch):
    from mirage_serve.search import rewrite
    from mirage_serve.specs import build_spec
    from mirage_serve.verify import verify_equivalent
    from tests.handwritten import fused_rmsnorm_linear

    graph = fused_rmsnorm_linear(2, 64, 128, n_blocks=2, loop=2, eps=1e-5)
    cert = verify_equivalent(graph, build_spec("rmsnorm_linear", {"batch": 2, "hidden": 64, "out": 128}, "float32", eps=1e-5), trials=2)
    assert cert.verdict == "equivalent"
    monkeypatch.setattr(cmd_build_cache, "searched_candidates",
                        lambda spec, config, opts: ([cmd_build_cache.Found(graph, cert, "search")], {}))
    monkeypatch.setattr(rewrite, "numerically_safe", lambda g, s: False)  # every candidate drops the guard
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    rc, report = run_json(capsys, str(model), "--only", "attn_norm_qkv", "--batch-sizes", "2", "--cache-dir", str(tmp_path / "c"),
                          "--no-package", "--time-budget", "5")
    (r,) = report["results"]
    assert rc == 0 and r["status"] == "original" and "max guard" in r["message"], r["message"]
    assert not list((tmp_path / "c").rglob("entries/*.json"))


def test_an_attention_bucket_too_large_to_evaluate_is_verified_on_fewer_rows(capsys, tmp_path, monkeypatch):
    """Decode attention is row-separable: a bucket whose full-size verification does not fit in memory
    is verified on a row-reduced instance with a structure verified for another bucket; the
    certificate says so, and `cache verify` re-verifies it the same way."""
    import mirage_serve.memory
    from mirage_serve.cache import CacheEntry, CacheKey, KernelCache
    from mirage_serve.specs import build_spec
    from mirage_serve.verify import verify_equivalent
    from tests.handwritten import split_kv_attention

    cache_dir = tmp_path / "c"
    dims = {"batch": 1, "q_heads": 4, "kv_heads": 2, "head_dim": 16, "kv_len": 64}
    graph = split_kv_attention(1, 4, 2, 16, 64, splits=2, loop=2)
    cert = verify_equivalent(graph, build_spec("attention_decode", dims, "float32"), trials=2)
    KernelCache(cache_dir, readonly_dirs=()).put(CacheEntry.create(CacheKey("attention_decode", dims, "float32", "unprofiled"), graph,
                                                                   certificate=cert, params={}, timings={}))
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    big = build_spec("attention_decode", {**dims, "batch": 4}, "float32")
    available = cmd_build_cache.verify_memory_bytes(big) - 1  # half of it holds 3 of the 8 rows
    monkeypatch.setattr(cmd_build_cache, "available_memory_bytes", lambda: available)
    monkeypatch.setattr(mirage_serve.memory, "available_memory_bytes", lambda: available)
    rc, report = run_json(capsys, str(model), "--only", "attention_decode", "--batch-sizes", "4", "--kv-lens", "64",
                          "--cache-dir", str(cache_dir), "--time-budget", "30")
    (r,) = report["results"]
    assert rc == 0 and r["status"] == "built" and r["verified"], r
    assert r["details"]["origin"] == "seeded" and r["verified_rows"] == {"rows": 8, "verified_rows": 2, "group": 1}
    # the table marks it and says on how many rows
    assert main(["build-cache", str(model), "--only", "attention_decode", "--batch-sizes", "4", "--kv-lens", "64",
                 "--cache-dir", str(cache_dir), "--no-package"]) == 0
    out = capsys.readouterr().out
    assert "yes*" in out and "2 of 8 rows" in out
    cache = KernelCache(cache_dir, readonly_dirs=())
    (entry,) = [e for e in cache.entries(specs={"attention_decode"}) if e.key.dims_dict["batch"] == 4]
    assert entry.certificate["rows"] == {"rows": 8, "verified_rows": 2, "group": 1}
    res = cache.verify(entry.key, trials=2, seed=3)
    assert res.status == "equivalent" and res.certificate["rows"]["verified_rows"] == 2 and "on 2 of 8 rows" in res.reason
    # not even one row group fits: the original code runs, nothing is cached for the bucket
    monkeypatch.setattr(cmd_build_cache, "available_memory_bytes", lambda: 1)
    rc, report = run_json(capsys, str(model), "--only", "attention_decode", "--batch-sizes", "2", "--kv-lens", "64",
                          "--cache-dir", str(cache_dir), "--time-budget", "30")
    (r,) = report["results"]
    assert r["status"] == "original" and "one row group alone does not fit" in r["message"]


def _gpu_build(capsys, tmp_path, monkeypatch, stand_in, cache: str, *extra: str, tune_error: Exception | None = None,
               spills=lambda params: 0, events: list | None = None, blocks=(2, 4), passes: bool = True, tune_passes: bool = True):
    """build-cache for one RMSNorm->QKV bucket "on a GPU" whose profiling is replaced by ``stand_in(graph, params)``
    (µs), over two verified graphs of 2 and 4 blocks; returns (exit code, the item's report, the entry written)."""
    import mirage_serve.tune as tune_mod
    from mirage_serve.cache import CacheEntry
    from mirage_serve.specs import build_spec
    from mirage_serve.tune import profile, search
    from mirage_serve.verify import verify_equivalent
    from tests.handwritten import fused_rmsnorm_linear

    spec = build_spec("rmsnorm_linear", {"batch": 2, "hidden": 64, "out": 128}, "float32", eps=1e-5)
    graphs = [fused_rmsnorm_linear(2, 64, 128, n_blocks=nb, loop=2, eps=1e-5) for nb in blocks]
    found = [cmd_build_cache.Found(g, verify_equivalent(g, spec, trials=2), "search") for g in graphs]
    monkeypatch.setattr(cmd_build_cache, "searched_candidates", lambda spec, config, opts: (found, {}))
    monkeypatch.setattr(cmd_build_cache, "current_arch", lambda: "sm90")

    def rank(graphs, params_grid=None, device=None, *, spec=None, **kw):
        if events is not None:
            events.append(f"rank {device} {len(graphs)}")
        if device == "cpu":  # the cost model: the opposite order of the stand-in's, so only measured times decide
            return sorted((tune_mod.Ranked(g, None, 100.0 - stand_in(g, {}), False, True, {}) for g in graphs), key=lambda r: r.time_us)
        assert device == "cuda"
        ok = [passes or not g.customized_ops for g in graphs]  # ``passes`` False: every fused graph fails its float check
        return sorted((tune_mod.Ranked(g, None, stand_in(g, {}) if p else math.inf, True, p, {}) for g, p in zip(graphs, ok)),
                      key=lambda r: (not r.passed, r.time_us))

    class Compiled(search.Precompiler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if events is not None:
                events.append("start")

        def close(self, kill=False):
            if events is not None:
                events.append("close kill" if kill else "close")
            super().close(kill)

        def compile(self, trials):
            if tune_error is not None:
                raise tune_error
            for t in trials:
                t.compile = {"ok": True, "spills": spills(t.params)}

    class InProcess(search.Measurer):  # the stand-in profiler lives in this process
        def measure(self, trial, spec, reps):
            if events is not None:
                events.append("measure")
            return profile.ProfileResult(passes and tune_passes, 1e-3, 0.02, median_us=stand_in(trial.candidate.graph, trial.params)).to_dict()

    monkeypatch.setattr(tune_mod, "rank_candidates", rank)
    monkeypatch.setattr(search, "Precompiler", Compiled)
    monkeypatch.setattr(search, "Measurer", InProcess)
    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    rc, report = run_json(capsys, str(model), "--only", "attn_norm_qkv", "--batch-sizes", "2", "--cache-dir", str(tmp_path / cache),
                          "--no-package", "--time-budget", "5", *extra)
    if events is not None:
        events.append(report)
        return rc, None, None
    (r,) = report["results"]
    paths = list((tmp_path / cache).rglob("entries/*.json"))
    return rc, r, CacheEntry.from_obj(json.loads(paths[0].read_text())) if len(paths) == 1 else None


def _blocks(graph) -> int:
    return graph.customized_ops[0].block.grid[0] if graph.customized_ops else 0


def test_on_a_gpu_the_parameters_of_the_fastest_graphs_are_searched_and_written(capsys, tmp_path, monkeypatch):
    """At default parameters the 2-block graph is faster (22 against 24 µs); 8 warps take the 4-block graph to 19 µs:
    the entry gets the 4-block graph with 8 warps, its certificate and the tuned time."""

    def stand_in(graph, params):
        if not graph.customized_ops:
            return 70.0  # the unfused spec
        return 20.0 + _blocks(graph) - (5.0 if params.get("num_warps") == 8 and _blocks(graph) == 4 else 0.0)

    rc, r, entry = _gpu_build(capsys, tmp_path, monkeypatch, stand_in, "c")
    assert rc == 0 and r["status"] == "built", r
    tuned = r["details"]["tuned"]
    assert tuned["kept"] == "tuned" and tuned["params"]["num_warps"] == 8 and tuned["graphs"] == 2 and tuned["default_us"] == 22.0
    assert entry.key.gpu_arch == "sm90" and _blocks(entry.graph) == 4 and entry.params["num_warps"] == 8
    assert entry.timings["time_us"] == pytest.approx(19.0) and entry.verdict == "equivalent"
    assert r["speedup"] == pytest.approx(70.0 / 19.0)


def test_on_a_gpu_default_parameters_stay_unless_a_point_is_clearly_faster(capsys, tmp_path, monkeypatch):
    def stand_in(graph, params):  # 8 warps 1% faster: within timing noise
        return 20.0 + _blocks(graph) - (0.22 if params.get("num_warps") == 8 else 0.0) + (50.0 if not graph.customized_ops else 0.0)

    rc, r, entry = _gpu_build(capsys, tmp_path, monkeypatch, stand_in, "c")
    assert rc == 0 and r["details"]["tuned"]["kept"].startswith("default parameters")
    assert _blocks(entry.graph) == 2 and entry.params == {} and entry.timings["time_us"] == pytest.approx(22.0)

    rc, r, entry = _gpu_build(capsys, tmp_path, monkeypatch, stand_in, "c0", "--tune-budget", "0")  # no search at all
    assert rc == 0 and "tuned" not in r.get("details", {}) and entry.params == {}


def test_a_failing_parameter_search_keeps_the_profiled_default_winner(capsys, tmp_path, monkeypatch):
    def stand_in(graph, params):
        return 20.0 + _blocks(graph) + (50.0 if not graph.customized_ops else 0.0)

    rc, r, entry = _gpu_build(capsys, tmp_path, monkeypatch, stand_in, "c", tune_error=OSError("no process could be started"))
    assert rc == 0 and r["status"] == "built" and "OSError: no process could be started" in r["details"]["tuned"]["error"]
    assert _blocks(entry.graph) == 2 and entry.params == {} and entry.timings["time_us"] == pytest.approx(22.0)


def test_default_points_that_spill_do_not_void_the_search(capsys, tmp_path, monkeypatch):
    """Default-parameter points that spill registers are skipped once a spill-free point passed; the search's
    best spill-free point is then taken."""

    def stand_in(graph, params):
        return 20.0 + _blocks(graph) - (4.0 if params else 0.0) + (50.0 if not graph.customized_ops else 0.0)

    rc, r, entry = _gpu_build(capsys, tmp_path, monkeypatch, stand_in, "c", spills=lambda params: 0 if params else 512)
    assert rc == 0 and r["details"]["tuned"]["kept"].startswith("tuned (no default-parameter point was timed")
    # the report counts why points were not timed: here the two default points, skipped for spilling
    assert r["details"]["tuned"]["not_timed"] == {"skipped: spills registers": 2}
    assert _blocks(entry.graph) == 2 and entry.params and entry.timings["time_us"] == pytest.approx(18.0)


def test_the_search_processes_are_started_once_for_all_kernels_of_a_run(capsys, tmp_path, monkeypatch):
    """Starting the compile workers and the measuring process costs seconds (torch, Triton, a CUDA
    context): one run starts them at its first tuned kernel, keeps them for the next, and ends them."""

    def stand_in(graph, params):
        return 20.0 + _blocks(graph) - (2.0 if params.get("num_warps") == 8 else 0.0) + (50.0 if not graph.customized_ops else 0.0)

    events: list = []
    seeded = []
    real_seeded = cmd_build_cache.seeded_candidates
    monkeypatch.setattr(cmd_build_cache, "seeded_candidates", lambda seeds, *a, **kw: seeded.append(seeds) or real_seeded(seeds, *a, **kw))
    rc, _, _ = _gpu_build(capsys, tmp_path, monkeypatch, stand_in, "c", "--batch-sizes", "2,4", events=events)
    report = events.pop()
    assert rc == 0 and [r["status"] for r in report["results"]] == ["built", "built"], report["results"]
    # the second bucket is seeded with the first's structure as its fastest measured graph has it (the 2-block one;
    # both graphs share one structure, and the cost model had the 4-block graph first)
    assert [[_blocks(g) for g in seeds] for seeds in seeded] == [[2]]
    assert all(r["details"]["tuned"]["kept"] == "tuned" for r in report["results"])
    assert [e for e in events if e in ("start", "close", "close kill")] == ["start", "close"]
    # both verified graphs went to the parameter search, which measured them at default parameters itself: only
    # the cost model put them in order, and only the unfused spec (the speed-up's baseline) was profiled in-process
    assert [e for e in events if e.startswith("rank")] == ["rank cpu 2", "rank cuda 1"] * 2


def test_a_failed_search_ends_the_shared_processes_and_the_next_kernel_starts_new_ones(capsys, tmp_path, monkeypatch):
    def stand_in(graph, params):
        return 20.0 + _blocks(graph) + (50.0 if not graph.customized_ops else 0.0)

    events: list = []
    rc, _, _ = _gpu_build(capsys, tmp_path, monkeypatch, stand_in, "c", "--batch-sizes", "2,4", events=events,
                          tune_error=OSError("no process could be started"))
    report = events.pop()
    assert rc == 0 and [r["status"] for r in report["results"]] == ["built", "built"]
    assert all("OSError" in r["details"]["tuned"]["error"] for r in report["results"])
    assert [e for e in events if e in ("start", "close", "close kill")] == ["start", "close kill", "start", "close kill"]
    # without a parameter search's result the graphs are profiled in-process at default parameters
    assert [e for e in events if e.startswith("rank")] == ["rank cpu 2", "rank cuda 2", "rank cuda 1"] * 2


def test_more_verified_graphs_than_the_search_takes_are_profiled_to_pick_them(capsys, tmp_path, monkeypatch):
    """Four verified graphs, three searched: the in-process profile at default parameters picks the three
    (the 16-block graph, slowest there, is left out even though 8 warps would help it most)."""

    def stand_in(graph, params):
        if not graph.customized_ops:
            return 70.0
        return 20.0 + _blocks(graph) - (20.0 if params.get("num_warps") == 8 and _blocks(graph) == 16 else 0.0)

    events: list = []
    rc, _, _ = _gpu_build(capsys, tmp_path, monkeypatch, stand_in, "c", events=events, blocks=(1, 2, 4, 16))
    (r,) = events.pop()["results"]
    assert rc == 0 and r["status"] == "built" and r["details"]["tuned"]["graphs"] == 3
    assert r["details"]["tuned"]["default_us"] == 21.0
    assert [e for e in events if e.startswith("rank")] == ["rank cuda 4", "rank cuda 1"]


def test_a_search_where_no_point_passes_falls_back_to_the_in_process_profile(capsys, tmp_path, monkeypatch):
    """Both graphs went to the parameter search unprofiled; no point passed there, so they are profiled
    in-process at default parameters and the faster is written; where they fail that check too, the
    kernel fails at the tune step and nothing is written."""

    def stand_in(graph, params):
        return 20.0 + _blocks(graph) + (50.0 if not graph.customized_ops else 0.0)

    events: list = []
    rc, _, _ = _gpu_build(capsys, tmp_path, monkeypatch, stand_in, "c", events=events, tune_passes=False)
    (r,) = events.pop()["results"]
    assert "measure" in events and rc == 0 and r["status"] == "built" and r["profiled"] is True
    assert r["details"]["tuned"]["not_timed"] == {"failed its float check": r["details"]["tuned"]["points"]}
    assert r["details"]["tuned"]["kept"].startswith("default parameters of the ranking")
    assert [e for e in events if e.startswith("rank")] == ["rank cpu 2", "rank cuda 2", "rank cuda 1"]

    events.clear()
    rc, _, _ = _gpu_build(capsys, tmp_path, monkeypatch, stand_in, "c2", events=events, passes=False)
    (r,) = events.pop()["results"]
    assert rc == 1 and r["status"] == "failed" and r["failed_step"] == "tune" and "float check" in r["message"]
    assert not list((tmp_path / "c2").rglob("entries/*.json"))


def test_an_interrupt_in_the_parameter_search_kills_the_shared_processes(capsys, tmp_path, monkeypatch):
    events: list = []
    rc, _, _ = _gpu_build(capsys, tmp_path, monkeypatch, lambda g, p: 20.0, "c", events=events, tune_error=KeyboardInterrupt())
    report = events.pop()
    assert rc == 1 and report["results"] == []
    assert [e for e in events if e in ("start", "close", "close kill")] == ["start", "close kill"]
