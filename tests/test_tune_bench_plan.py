"""CPU-side planning of benchmarks/kernels.py: the shape list, the generated variants, targets, reports."""

from __future__ import annotations

import argparse

import pytest
import torch

from mirage_serve import cmd_bench
from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec

K = cmd_bench.load_bench("kernels")
V = K.V


def test_shape_list_covers_the_llama3_8b_decode_cases():
    cases = {c.label: c for c in K.plan()}
    for n in (6144, 28672):
        for b in (1, 8, 32):
            c = next(c for c in cases.values() if c.spec == "rmsnorm_linear" and c.dims == {"batch": b, "hidden": 4096, "out": n})
            assert c.candidates and "cublas_graph" in c.contenders() and "eager_graph" in c.contenders()
    att = [c for c in cases.values() if c.spec == "attention_decode"]
    assert sorted((c.dims["batch"], c.dims["kv_len"]) for c in att) == [(1, 1024), (1, 4096), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (8, 32768)]
    assert all(c.dims["q_heads"] == 32 and c.dims["kv_heads"] == 8 and c.dims["head_dim"] == 128 and c.candidates for c in att)
    assert {c.dims["rank"] for c in cases.values() if c.spec == "lora_linear"} == {16, 64}
    assert any(c.spec == "gated_mlp" for c in cases.values())
    assert "compile_max_graph" in cases["rmsnorm_qkv_b1"].contenders()
    assert "compile_max_graph" not in K.plan(labels=["rmsnorm_qkv_b1"], max_autotune="none")[0].contenders()


def test_batch_1_candidates_are_gemv_shaped_and_include_split_k():
    cands = V.candidates_for("rmsnorm_linear", {"batch": 1, "hidden": 4096, "out": 6144}, "bfloat16")
    assert len({c.name for c in cands}) == len(cands)
    for c in cands:
        blk = c.graph.customized_ops[0].block
        if c.name.startswith("fused"):
            cols, chunk = 6144 // blk.grid[0], 4096 // blk.forloop_range
            assert 4 <= cols <= 16 and 512 <= chunk <= 1024
    assert any(c.name.startswith("splitk") for c in cands)
    assert any(c.name.startswith("splitk") for c in V.candidates_for("rmsnorm_linear", {"batch": 8, "hidden": 4096, "out": 6144}, "bfloat16"))


def test_first_round_tries_gemv_math_and_a_swapped_dot_for_one_row_and_tl_dot_for_more():
    from mirage_serve.tune.search import first_round

    b1 = first_round(V.candidates_for("rmsnorm_linear", {"batch": 1, "hidden": 4096, "out": 6144}, "bfloat16"))
    assert {t.params.get("matmul") for t in b1} == {"fma", "dot"} and all(t.params.get("dot_swap") for t in b1 if t.params["matmul"] == "dot")
    b32 = first_round(V.candidates_for("rmsnorm_linear", {"batch": 32, "hidden": 4096, "out": 6144}, "bfloat16"))
    assert {t.params.get("matmul") for t in b32} == {"dot"} and all(t.params["dot_precision"] == "input" for t in b32)
    att = V.candidates_for("attention_decode", {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "kv_len": 8192}, "bfloat16")
    assert all(c.variable_dims == V.ATTENTION_VARIABLE_DIMS for c in att)
    assert all(64 <= 8 * c.graph.customized_ops[0].block.grid[1] <= 1024 for c in att)


@pytest.mark.parametrize(
    ("spec", "dims"),
    [
        ("rmsnorm_linear", {"batch": 2, "hidden": 1024, "out": 512}),
        ("lora_linear", {"batch": 2, "in": 4096, "out": 256, "rank": 4}),
        ("gated_mlp", {"batch": 2, "hidden": 1024, "intermediate": 256}),
        ("attention_decode", {"batch": 1, "q_heads": 4, "kv_heads": 2, "head_dim": 16, "kv_len": 4096}),
    ],
)
def test_every_generated_candidate_computes_its_spec(spec, dims):
    ref_graph = build_spec(spec, dims)
    vs = V.candidates_for(spec, dims, "float32")
    assert vs
    ins = random_inputs(ref_graph, torch.Generator().manual_seed(1))
    want = execute(ref_graph, ins)[0]
    for v in vs:
        got = execute(v.graph, ins)[0]
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-9), v.name


def test_dry_run_lists_the_plan_without_a_gpu(capsys):
    p = argparse.ArgumentParser()
    K.add_arguments(p)
    assert K.run(p.parse_args(["--dry-run", "--specs", "lora_linear", "attention_decode"])) == 0
    out = capsys.readouterr().out
    assert "lora_b1_r16" in out and "attn_b8_kv32k" in out and "rmsnorm" not in out
    assert "2kernel c16 k512" in out and "splitkv" in out and "model" in out
    assert "12 cases" in out
    rows = K.describe_plan(K.plan(specs=["rmsnorm_linear"], labels=["qkv_b1"]))
    assert rows[0]["floor_bytes"] == 2 * (4096 + 4096 + 6144 * 4096 + 6144)
    assert all(v["model_us"] > 0 for v in rows[0]["variants"])


def _fake_result(spec, dims, ours, **stock):
    return {"spec": spec, "dims": dims, "label": "x", "floor_us": 10.0,
            "ours": {"variant": "v", "median_us": ours, "rel_error": 1e-3},
            "contenders": {k: {"median_us": t, "passed": True} for k, t in stock.items()}}


def test_targets_are_evaluated_from_measured_ratios():
    r = _fake_result("rmsnorm_linear", {"batch": 1}, 12.0, cublas_graph=11.5, eager_graph=30.0, compile_graph=11.9)
    goals = {g["goal"]: g for g in K.evaluate_targets(r)}
    assert goals["<= 1.1x cuBLAS linear alone"] == {"goal": "<= 1.1x cuBLAS linear alone", "ratio": round(12 / 11.5, 3), "met": True}
    assert goals[">= 1.4x faster than eager+graph"]["met"] is True
    assert goals["faster than torch.compile"]["met"] is False
    assert goals["faster than torch.compile max-autotune"]["met"] is None
    a = _fake_result("attention_decode", {"batch": 1, "kv_len": 8192}, 10.0, sdpa_graph=14.0)
    assert [g["met"] for g in K.evaluate_targets(a)] == [True, False]
    a8 = _fake_result("attention_decode", {"batch": 8, "kv_len": 8192}, 10.0, sdpa_graph=14.0)
    assert len(K.evaluate_targets(a8)) == 1


def test_markdown_report_and_strict_json():
    r = _fake_result("lora_linear", {"batch": 1}, 10.0, eager_graph=22.0, compile_graph=float("inf"))
    r["targets"] = K.evaluate_targets(r)
    env = {"gpu": "G", "date_utc": "d", "torch": "t", "triton": "tr", "transformers": "hf", "cuda": "c",
           "copy_bandwidth_tb_s": 4.2, "dtype": "bfloat16", "timing": "median", "mugraph_source": V.MUGRAPH_SOURCE}
    md = K.markdown({"environment": env, "cases": [r]})
    assert "## lora_linear" in md and "| x | 10.0 | 22.0 |" in md and "NOT met" not in md.split(">= 1.8x faster than eager+graph")[1].splitlines()[0]
    assert K.clean_json({"a": [float("nan"), 1.0]}) == {"a": [None, 1.0]}


def test_bench_command_has_room_for_more_benchmarks():
    p = argparse.ArgumentParser()
    cmd_bench.add_arguments(p)
    args = p.parse_args(["kernels", "--dry-run", "--cases", "gated_mlp_b1"])
    assert cmd_bench.run(args) == 0
    assert set(cmd_bench.BENCHES) >= {"kernels", "e2e"}


def test_e2e_dry_run_names_the_dtype(capsys):
    p = argparse.ArgumentParser()
    cmd_bench.add_arguments(p)
    assert cmd_bench.run(p.parse_args(["e2e", "--dry-run", "--dtype", "float32", "--layers", "2"])) == 0
    out = capsys.readouterr().out
    assert "float32 weights" in out and "layers 2" in out
    with pytest.raises(SystemExit):
        p.parse_args(["e2e", "--dtype", "int8"])


def test_rank_correlation_and_variant_tables():
    assert K.rank_correlation([(1, 10), (2, 20), (3, 30)]) == 1.0
    assert K.rank_correlation([(1, 30), (2, 20), (3, 10)]) == -1.0
    assert K.rank_correlation([(1, 1), (2, 2)]) is None
    r = _fake_result("gated_mlp", {"batch": 1}, 60.0, eager_graph=70.0)
    r["variants"] = [{"name": "fused c8 k512", "params": {"num_warps": 4}, "schedule": "s", "model_us": 61.0, "median_us": 60.0,
                      "rel_error": 3e-3, "passed": True},
                     {"name": "fused c16 k512", "params": {}, "schedule": "s", "model_us": 59.0, "error": "RuntimeError: boom"}]
    env = {"gpu": "G", "date_utc": "d", "torch": "t", "triton": "tr", "transformers": "hf", "cuda": "c",
           "copy_bandwidth_tb_s": 4.2, "dtype": "bfloat16", "timing": "median", "mugraph_source": V.MUGRAPH_SOURCE}
    md = K.markdown({"environment": env, "cases": [r]})
    assert "| fused c8 k512 | {'num_warps': 4} | s | 61.0 | 60.0 | 3.0e-03 | ok |" in md
    assert "RuntimeError: boom" in md


def test_flashinfer_contender_is_left_out_where_flashinfer_does_not_import(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    dims = {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "kv_len": 1024}
    assert K._flashinfer_decode(dims, 1.0) is None
    assert "flashinfer_graph" in K.Case("attention_decode", dims, "attn").contenders()


def _fake_flashinfer():
    """FlashInfer's paged batch decode as its documentation defines it (page table of indptr, indices and
    last-page lengths over an HND cache), in plain torch: checks what ``_flashinfer_decode`` plans and pages."""
    import types

    class Wrapper:
        def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False):
            assert kv_layout == "HND"
            self.tc = use_tensor_cores

        def plan(self, indptr, indices, last_page_len, hq, hk, dh, page, q_data_type=None, kv_data_type=None, sm_scale=None):
            self.table, self.heads, self.page, self.scale = (indptr, indices, last_page_len), (hq, hk), page, sm_scale

        def run(self, q, kv):
            (indptr, indices, last), (hq, hk) = self.table, self.heads
            outs = []
            for i in range(q.shape[0]):
                pages = indices[indptr[i]:indptr[i + 1]].long()
                k, v = (c[pages].transpose(0, 1).reshape(hk, -1, c.shape[-1]) for c in kv)  # [hk, pages * page, dh]
                n = (len(pages) - 1) * self.page + int(last[i])
                k, v = (t[:, :n].repeat_interleave(hq // hk, 0).float() for t in (k, v))
                w = torch.softmax(q[i].float()[:, None, :] @ k.transpose(1, 2) * self.scale, -1)
                outs.append((w @ v)[:, 0].to(q.dtype))
            return torch.stack(outs)

    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = Wrapper
    return fake


@pytest.mark.parametrize("batch,kv_len", [(1, 64), (3, 40)])
def test_flashinfer_contender_pages_the_cache_as_flashinfer_reads_it(monkeypatch, batch, kv_len):
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    hq, hk, dh = 8, 2, 16
    dims = {"batch": batch, "q_heads": hq, "kv_heads": hk, "head_dim": dh, "kv_len": kv_len}
    fn, prepare = K._flashinfer_decode(dims, 0.25, device="cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((batch, hq, 1, dh), (batch, hk, kv_len, dh), (batch, hk, kv_len, dh)))
    args = prepare(q, k, v)
    assert args[1].shape == (batch * -(-kv_len // K.FLASHINFER_PAGE), hk, K.FLASHINFER_PAGE, dh)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.25, enable_gqa=True)
    torch.testing.assert_close(fn(*args).double(), ref, rtol=1e-5, atol=1e-5)


def test_flashinfer_contender_is_left_out_when_switched_off(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    dims = {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "kv_len": 1024}
    assert K._flashinfer_decode(dims, 1.0, device="cpu") is not None  # importable: offered
    monkeypatch.setenv("MIRAGE_BENCH_FLASHINFER", "0")  # h200_run.sh sets it when the JIT warm-up failed
    assert K._flashinfer_decode(dims, 1.0, device="cpu") is None


def test_flashinfer_warm_reports_a_missing_flashinfer(monkeypatch, capsys):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", None)
    warm = importlib.import_module("flashinfer_warm")
    assert warm.main([]) == 1
    assert "does not import" in capsys.readouterr().out
