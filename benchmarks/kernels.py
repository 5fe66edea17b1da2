"""Kernel microbenchmarks at Llama-3-8B decode shapes: our fused kernels against the stock ones.

For every case (spec x shape) it times, in one run on one GPU, rotating through
enough input sets to keep weights and KV out of L2:

* ``ours``: the candidate μGraphs of :mod:`variants` (schedules), their codegen
  parameters searched by :func:`mirage_serve.tune.search.tune` (every point
  compiled by ``mirage_serve.codegen`` in parallel worker processes first, then
  float-checked against the float64 reference and timed here); the fastest
  passing point is "ours" for the case;
* stock code: transformers' ``LlamaRMSNorm`` + ``nn.Linear`` (or SDPA and
  transformers' eager attention, or an ``nn.Linear`` LoRA / gated MLP), eager
  and under a CUDA graph; ``torch.compile`` (default, and
  ``max-autotune-no-cudagraphs`` where asked) under a CUDA graph; cuBLAS's
  linear alone under a CUDA graph; FlashInfer's batch decode attention (paged
  KV cache; CUDA-core and tensor-core paths) under a CUDA graph where
  ``flashinfer`` imports (on the GPU machine: the wheels of
  ``benchmarks/peer_wheels.sh``, carried);
* the floor: the spec's bytes (inputs once, outputs once) at the measured copy bandwidth.

Usage: ``python benchmarks/kernels.py --dry-run`` lists the plan (no GPU
needed); ``python benchmarks/kernels.py --out DIR`` runs it and writes
``kernels-<tag>.json``, ``.md`` and ``.png`` to DIR. Also ``mirage-serve bench kernels``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import variants as V  # noqa: E402

from mirage_serve.specs import build_spec  # noqa: E402
from mirage_serve.tune.cost_model import estimate, floor_bytes  # noqa: E402

log = logging.getLogger("benchmarks.kernels")

HIDDEN, QKV_OUT, GATE_UP_OUT, INTER = 4096, 6144, 28672, 14336
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = "bfloat16"

# contender name -> the spec families it applies to
CONTENDERS = {
    "eager": ("rmsnorm_linear", "lora_linear", "gated_mlp"),
    "eager_graph": ("rmsnorm_linear", "lora_linear", "gated_mlp"),
    "compile_graph": ("rmsnorm_linear", "lora_linear", "gated_mlp"),
    "compile_max_graph": ("rmsnorm_linear", "lora_linear"),
    "cublas_graph": ("rmsnorm_linear", "lora_linear", "gated_mlp"),
    "sdpa": ("attention_decode",),
    "sdpa_graph": ("attention_decode",),
    "hf_eager_attn_graph": ("attention_decode",),
    "flashinfer_graph": ("attention_decode",),  # where flashinfer imports (benchmarks/peer_wheels.sh carries it to the GPU)
    "flashinfer_tc_graph": ("attention_decode",),  # the same with its tensor-core decode path
}


@dataclass
class Case:
    spec: str
    dims: dict[str, int]
    label: str
    max_autotune: bool = False  # torch.compile max-autotune-no-cudagraphs is slow to tune: only where asked
    candidates: list[V.Candidate] = field(default_factory=list)

    def contenders(self) -> list[str]:
        return [c for c, specs in CONTENDERS.items() if self.spec in specs and (c != "compile_max_graph" or self.max_autotune)]


def all_cases() -> list[Case]:
    """The shape list: Llama-3-8B decode shapes for each spec."""
    cases = []
    for out, name in ((QKV_OUT, "qkv"), (GATE_UP_OUT, "gate_up")):
        for b in (1, 8, 32):
            cases.append(Case("rmsnorm_linear", {"batch": b, "hidden": HIDDEN, "out": out}, f"rmsnorm_{name}_b{b}", max_autotune=out == QKV_OUT))
    for b in (1, 8):
        for kv in (1024, 4096, 8192, 32768) if b == 1 else (1024, 8192, 32768):
            cases.append(Case("attention_decode", {"batch": b, "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "kv_len": kv},
                              f"attn_b{b}_kv{kv // 1024}k"))
    for b, r in ((1, 16), (8, 16), (1, 64), (8, 64), (32, 64)):
        cases.append(Case("lora_linear", {"batch": b, "in": HIDDEN, "out": HIDDEN, "rank": r}, f"lora_b{b}_r{r}", max_autotune=r == 16))
    for b in (1, 8, 32):
        cases.append(Case("gated_mlp", {"batch": b, "hidden": HIDDEN, "intermediate": INTER}, f"gated_mlp_b{b}"))
    return cases


def plan(specs: list[str] | None = None, labels: list[str] | None = None, max_autotune: str = "some") -> list[Case]:
    """The cases to run, each with its candidate μGraphs generated (CPU only)."""
    out = []
    for c in all_cases():
        if specs and c.spec not in specs:
            continue
        if labels and not any(lab in c.label for lab in labels):
            continue
        c.max_autotune = {"none": False, "all": c.spec in CONTENDERS["compile_max_graph"], "some": c.max_autotune}[max_autotune]
        c.candidates = V.candidates_for(c.spec, c.dims, DTYPE)
        out.append(c)
    if specs:  # run in the order asked for
        out.sort(key=lambda c: specs.index(c.spec))
    return out


def describe_plan(cases: list[Case]) -> list[dict[str, Any]]:
    """What a run would tune first (round 1 of the search), with the cost model's estimate for each point (no GPU needed)."""
    from mirage_serve.tune.search import first_round

    rows = []
    for c in cases:
        spec = build_spec(c.spec, c.dims, dtype=DTYPE)
        rows.append({
            "label": c.label, "spec": c.spec, "dims": c.dims, "contenders": c.contenders(),
            "floor_bytes": floor_bytes(spec),
            "variants": [{"name": t.candidate.name, "params": t.params, "schedule": t.candidate.schedule,
                          "model_us": round(estimate(t.candidate.graph, t.params).time_s * 1e6, 2)} for t in first_round(c.candidates)],
        })
    return rows


# ---------------------------------------------------------------- GPU side


def _torch_dtype():
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[DTYPE]


def _stock_contenders(case: Case, sets: list[list[Any]]):
    """name -> (fn, arg_sets, reference kind) for the stock implementations, over the same tensors."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    d = case.dims
    out: dict[str, Any] = {}

    def frozen_linear(w):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        return lin

    if case.spec == "rmsnorm_linear":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        class NormLinear(nn.Module):
            def __init__(self, g, w):
                super().__init__()
                self.norm = LlamaRMSNorm(g.shape[0], eps=1e-6).to(device=g.device, dtype=g.dtype)
                self.norm.weight = nn.Parameter(g, requires_grad=False)
                self.proj = frozen_linear(w)

            def forward(self, x):
                return self.proj(self.norm(x))

        mods = [NormLinear(s[1], s[2]) for s in sets]
        xs = [(s[0],) for s in sets]
        out["eager"] = out["eager_graph"] = ([m.forward for m in mods], xs, "spec")
        out["compile_graph"] = ([torch.compile(m) for m in mods], xs, "spec")
        if case.max_autotune:
            out["compile_max_graph"] = ([torch.compile(m, mode="max-autotune-no-cudagraphs") for m in mods], xs, "spec")
        out["cublas_graph"] = (F.linear, [(s[0], s[2]) for s in sets], "linear")
    elif case.spec == "lora_linear":
        class LoraLinear(nn.Module):
            def __init__(self, w, a, b, scale=2.0):
                super().__init__()
                self.base, self.lora_A, self.lora_B, self.scale = frozen_linear(w), frozen_linear(a), frozen_linear(b), scale

            def forward(self, x):
                return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale

        mods = [LoraLinear(s[1], s[2], s[3]) for s in sets]
        xs = [(s[0],) for s in sets]
        out["eager"] = out["eager_graph"] = ([m.forward for m in mods], xs, "spec")
        out["compile_graph"] = ([torch.compile(m) for m in mods], xs, "spec")
        if case.max_autotune:
            out["compile_max_graph"] = ([torch.compile(m, mode="max-autotune-no-cudagraphs") for m in mods], xs, "spec")
        out["cublas_graph"] = (F.linear, [(s[0], s[1]) for s in sets], "linear")
    elif case.spec == "gated_mlp":
        class GateUp(nn.Module):
            def __init__(self, wg, wu):
                super().__init__()
                self.gate_proj, self.up_proj = frozen_linear(wg), frozen_linear(wu)

            def forward(self, x):
                return F.silu(self.gate_proj(x)) * self.up_proj(x)

        mods = [GateUp(s[1], s[2]) for s in sets]
        xs = [(s[0],) for s in sets]
        out["eager"] = out["eager_graph"] = ([m.forward for m in mods], xs, "spec")
        out["compile_graph"] = ([torch.compile(m) for m in mods], xs, "spec")
        # cuBLAS alone: one linear over the concatenated gate+up weight, as vLLM stores it
        out["cublas_graph"] = (F.linear, [(s[0], torch.cat([s[1], s[2]], 0)) for s in sets], "linear")
    elif case.spec == "attention_decode":
        from types import SimpleNamespace

        from transformers.models.llama.modeling_llama import eager_attention_forward

        b, L, dh = d["batch"], d["kv_len"], d["head_dim"]
        views = [(s[0].view(b, d["q_heads"], 1, dh), s[1].view(b, d["kv_heads"], L, dh), s[2].view(b, d["kv_heads"], L, dh)) for s in sets]
        scale = 1.0 / math.sqrt(dh)
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        out["sdpa"] = out["sdpa_graph"] = (sdpa, views, "attn4d")
        module = SimpleNamespace(num_key_value_groups=d["q_heads"] // d["kv_heads"], training=False)
        hf = lambda q, k, v: eager_attention_forward(module, q, k, v, None, scaling=scale, dropout=0.0)[0].transpose(1, 2)
        out["hf_eager_attn_graph"] = (hf, views, "attn4d")
        for name, tc in (("flashinfer_graph", False), ("flashinfer_tc_graph", True)):
            fi = _flashinfer_decode(d, scale, tensor_cores=tc)
            if fi is not None:
                fn, prepare = fi
                out[name] = (fn, [prepare(*v) for v in views], "attn4d")
    return out


FLASHINFER_PAGE = 16  # tokens a KV page: FlashInfer's and vLLM's usual decode page size


def _flashinfer_decode(d: dict[str, int], scale: float, tensor_cores: bool = False, device: str = "cuda"):
    """FlashInfer's batch decode attention as serving engines run it, or None where flashinfer does not
    import or ``MIRAGE_BENCH_FLASHINFER=0`` (set by ``h200_run.sh`` when its JIT warm-up failed or ran out
    of time). Returns ``(fn, prepare)``: ``prepare(q, k, v)`` copies a case's [batch, KV heads, length, head
    dim] K/V into FlashInfer's paged cache (``HND``, pages of :data:`FLASHINFER_PAGE` tokens), once and
    outside any timing; ``fn`` then takes what ``prepare`` returned. ``BatchDecodeWithPagedKVCacheWrapper``
    is planned once outside the timed graph; ``tensor_cores`` picks its tensor-core (prefill-kernel) path."""
    if os.environ.get("MIRAGE_BENCH_FLASHINFER", "1") == "0":
        log.info("flashinfer contender left out: MIRAGE_BENCH_FLASHINFER=0")
        return None
    try:
        import flashinfer
    except Exception as e:  # not installed here: the contender is left out, and the log says why
        log.info("flashinfer contender left out: %s", e)
        return None
    import torch
    import torch.nn.functional as F

    b, hq, hk, L, dh, P = d["batch"], d["q_heads"], d["kv_heads"], d["kv_len"], d["head_dim"], FLASHINFER_PAGE
    pages = -(-L // P)
    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND", use_tensor_cores=tensor_cores)
    i32 = dict(dtype=torch.int32, device=device)
    wrapper.plan(torch.arange(b + 1, **i32) * pages, torch.arange(b * pages, **i32), torch.full((b,), L - (pages - 1) * P, **i32),
                 hq, hk, dh, P, q_data_type=_torch_dtype(), kv_data_type=_torch_dtype(), sm_scale=scale)

    def paged(t):  # [b, hk, L, dh] -> [b * pages, hk, P, dh], the tail page zero-padded
        t = F.pad(t.reshape(b, hk, L, dh), (0, 0, 0, pages * P - L))
        return t.view(b, hk, pages, P, dh).transpose(1, 2).reshape(b * pages, hk, P, dh).contiguous()

    def prepare(q, k, v):
        return q.reshape(b, hq, dh), paged(k), paged(v)

    return (lambda q, kp, vp: wrapper.run(q, (kp, vp)).view(b, hq, 1, dh)), prepare


def _per_set(fn_or_list, arg_sets):
    """One callable per argument set (modules compiled per set) or the same callable for all."""
    if isinstance(fn_or_list, list):
        fns = fn_or_list
        return lambda i, *a: fns[i](*a), [(i, *a) for i, a in enumerate(arg_sets)]
    return lambda i, *a: fn_or_list(*a), [(i, *a) for i, a in enumerate(arg_sets)]


def _reference(case: Case, spec, inputs, kind: str):
    import torch

    from mirage_serve.reference import execute

    if kind == "linear":
        x, w = inputs[0], (inputs[2] if case.spec == "rmsnorm_linear" else inputs[1])
        if case.spec == "gated_mlp":
            w = torch.cat([inputs[1], inputs[2]], 0)
        return x.double() @ w.double().T
    ref = execute(spec, inputs, dtype=torch.float64)[0]
    if kind == "attn4d":
        d = case.dims
        return ref.view(d["batch"], d["q_heads"], 1, d["head_dim"])
    return ref


def _cuda_alive() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # an illegal access poisons the context: every later call fails
        return False


def _record(res: dict[str, Any], label: str):
    """An ``on_trial`` callback that appends each tuning point to ``res["variants"]``."""

    def record(t) -> None:
        r = t.result
        entry = {"name": t.candidate.name, "params": t.params, "round": t.round, "schedule": t.candidate.schedule,
                 "model_us": estimate(t.candidate.graph, t.params).time_s * 1e6, "compile": t.compile}
        for k in ("rel_error", "passed", "median_us", "p20_us", "p80_us", "error", "skipped", "compile_s"):
            if r.get(k) is not None:
                entry[k] = r[k]
        res["variants"].append(entry)
        log.info("%s %-44s %s err=%s", label, t.label, entry.get("median_us"), entry.get("rel_error"))

    return record


def new_result(case: Case, copy_bw: float) -> dict[str, Any]:
    spec = build_spec(case.spec, case.dims, dtype=DTYPE)
    fb = floor_bytes(spec)
    return {"label": case.label, "spec": case.spec, "dims": case.dims, "floor_bytes": fb, "floor_us": fb / copy_bw * 1e6,
            "contenders": {}, "variants": []}


def finish_case(case: Case, res: dict[str, Any], args) -> dict[str, Any]:
    """Stock contenders and the tuned winner measured side by side on the same input sets, float-checked
    against the same float64 reference; then the goals."""
    import torch

    from mirage_serve.tune.profile import random_device_inputs
    from mirage_serve.tune.timing import relative_error, sets_for, time_calls, tolerance_for

    spec = build_spec(case.spec, case.dims, dtype=DTYPE)
    n_sets = sets_for(res["floor_bytes"], l2_bytes=getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 * 2**20))
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    sets = [random_device_inputs(spec, "cuda", gen) for _ in range(n_sets)]
    tol = tolerance_for(_torch_dtype())
    res["sets"] = n_sets
    refs: dict[str, Any] = {}

    def ref(kind):
        if kind not in refs:
            refs[kind] = _reference(case, spec, sets[0], kind)
        return refs[kind]

    with torch.no_grad():
        for name, (fn, arg_sets, kind) in _stock_contenders(case, sets).items():
            if args.contenders is not None and name not in args.contenders:
                continue
            entry: dict[str, Any] = {}
            try:
                call, calls = _per_set(fn, arg_sets)
                t0 = time.perf_counter()
                o = call(*calls[0])
                torch.cuda.synchronize()
                entry["first_call_s"] = round(time.perf_counter() - t0, 2)
                entry["rel_error"] = relative_error(o, ref(kind))
                entry["passed"] = entry["rel_error"] <= tol
                t = time_calls(call, calls, cuda_graph=name not in ("eager", "sdpa"), reps=args.reps)
                entry.update(median_us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us)
            except Exception as e:  # a stock path that fails here (e.g. compile) is recorded, not fatal
                log.warning("%s %s failed: %s", case.label, name, e)
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res["contenders"][name] = entry
            log.info("%s %-20s %s", case.label, name, entry.get("median_us"))
        passed = [v for v in res["variants"] if v.get("passed") and "median_us" in v]
        if passed:
            best = min(passed, key=lambda v: v["median_us"])
            res["ours"] = {"variant": best["name"], "params": best["params"], "tuning_us": best["median_us"],
                           "tuning_rel_error": best["rel_error"]}
            try:  # the chosen point measured again like the stock contenders: their input sets, their reference
                from mirage_serve.codegen import compile_graph
                from mirage_serve.tune.profile import make_params

                cand = next(c for c in case.candidates if c.name == best["name"])
                compiled = compile_graph(cand.graph, make_params(best["params"]), cand.variable_dims)
                o = compiled(*sets[0], poison=True)[0]
                torch.cuda.synchronize()
                err = relative_error(o, ref("spec"))
                res["ours"]["rel_error"] = err
                if err <= tol:
                    t = time_calls(compiled, sets, cuda_graph=True, reps=args.reps)
                    res["ours"].update(median_us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us)
                else:
                    res["ours"]["error"] = f"float check on the benchmark's inputs failed: {err:.3g} > {tol:.3g}"
            except Exception as e:  # recorded; the case then has no "ours" time
                res["ours"]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res["model_rank_correlation"] = rank_correlation([(v["model_us"], v["median_us"]) for v in passed])
    res["targets"] = evaluate_targets(res)
    res["complete"] = True
    sets.clear()  # free the GPU memory before the next case
    refs.clear()
    torch.cuda.empty_cache()
    return res


def rank_correlation(pairs: list[tuple[float, float]]) -> float | None:
    """Spearman's rank correlation between the cost model's estimates and measured times (None below 3 points)."""
    if len(pairs) < 3:
        return None

    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        r = [0.0] * len(xs)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    a, b = ranks([p[0] for p in pairs]), ranks([p[1] for p in pairs])
    n = len(pairs)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b)) / (n * (n * n - 1))


def _t(res: dict[str, Any], name: str) -> float | None:
    if name == "ours":
        return res.get("ours", {}).get("median_us")
    c = res["contenders"].get(name, {})
    return c.get("median_us") if c.get("passed", True) else None


def evaluate_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals set for each spec, each with the measured ratio and whether it was met."""
    ours = _t(res, "ours")
    goals: list[tuple[str, str, str, float]] = []  # (text, baseline, relation, bound)
    s, d = res["spec"], res["dims"]
    if s == "rmsnorm_linear":
        goals = [("<= 1.1x cuBLAS linear alone", "cublas_graph", "ours/base<=", 1.1),
                 (">= 1.4x faster than eager+graph", "eager_graph", "base/ours>=", 1.4),
                 ("faster than torch.compile", "compile_graph", "base/ours>", 1.0),
                 ("faster than torch.compile max-autotune", "compile_max_graph", "base/ours>", 1.0)]
    elif s == "attention_decode":
        goals = [("at least as fast as SDPA+graph", "sdpa_graph", "base/ours>=", 1.0)]
        if d["batch"] == 1 and d["kv_len"] <= 8192:
            goals.append((">= 1.5x faster than SDPA+graph", "sdpa_graph", "base/ours>=", 1.5))
    elif s == "lora_linear":
        goals = [(">= 1.8x faster than eager+graph", "eager_graph", "base/ours>=", 1.8),
                 (">= 1.8x faster than torch.compile", "compile_graph", "base/ours>=", 1.8),
                 (">= 1.8x faster than torch.compile max-autotune", "compile_max_graph", "base/ours>=", 1.8)]
    out = []
    for text, base, rel, bound in goals:
        b = _t(res, base)
        if b is None or ours is None:
            out.append({"goal": text, "met": None, "why": "not measured"})
            continue
        ratio = ours / b if rel.startswith("ours") else b / ours
        met = ratio <= bound if rel.endswith("<=") else (ratio >= bound if rel.endswith(">=") else ratio > bound)
        out.append({"goal": text, "ratio": round(ratio, 3), "met": bool(met)})
    return out


def _codegen_digest() -> str:
    """Digest of mirage_serve/codegen/*.py as run (it may be ahead of any commit)."""
    import hashlib

    import mirage_serve.codegen as cg

    h = hashlib.sha256()
    for f in sorted(Path(cg.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def environment(copy_bw: float) -> dict[str, Any]:
    import torch
    import triton

    try:
        import transformers

        tv = transformers.__version__
    except ImportError:
        tv = None
    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0), "sms": p.multi_processor_count, "l2_bytes": getattr(p, "L2_cache_size", None),
        "torch": torch.__version__, "triton": triton.__version__, "transformers": tv, "cuda": torch.version.cuda,
        "python": platform.python_version(), "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "copy_bandwidth_tb_s": round(copy_bw / 1e12, 3), "dtype": DTYPE, "mugraph_source": V.MUGRAPH_SOURCE,
        "codegen_sources_sha256": _codegen_digest(),
        "timing": "median per call over CUDA-graph replays (or eager loops for 'eager'/'sdpa'), rotating input sets totalling >= 3x L2",
    }


# ---------------------------------------------------------------- reports

COLUMNS = ["ours", "eager", "eager_graph", "compile_graph", "compile_max_graph", "cublas_graph", "sdpa", "sdpa_graph", "hf_eager_attn_graph",
           "flashinfer_graph", "flashinfer_tc_graph"]


def _fmt(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# Kernel benchmarks — {env['gpu']}, {env['date_utc']} UTC", "",
             f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}, CUDA {env['cuda']}; "
             f"copy bandwidth {env['copy_bandwidth_tb_s']} TB/s; {env['dtype']}. Times in µs ({env['timing']}).", "",
             f"μGraphs: {env['mugraph_source']}.", ""]
    for spec in dict.fromkeys(r["spec"] for r in report["cases"]):
        rows = [r for r in report["cases"] if r["spec"] == spec]
        cols = [c for c in COLUMNS if any(_t(r, c) is not None for r in rows)]
        lines += [f"## {spec}", "", "| case | " + " | ".join(cols) + " | floor | best variant | rel. error | goals met |",
                  "|" + "---|" * (len(cols) + 5)]
        for r in rows:
            goals = r.get("targets", [])
            met = sum(1 for g in goals if g.get("met"))
            cells = [_fmt(_t(r, c)) for c in cols]
            ours = r.get("ours", {})
            lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {_fmt(r['floor_us'])} | {ours.get('variant', '—')} | "
                         f"{ours.get('rel_error', float('nan')):.1e} | {met}/{len(goals)} |")
        lines.append("")
        for r in rows:
            for g in r.get("targets", []):
                lines.append(f"- {r['label']}: {g['goal']}: " + ("not measured" if g["met"] is None else f"ratio {g['ratio']} — {'met' if g['met'] else 'NOT met'}"))
        lines.append("")
        for r in rows:
            if not r.get("variants"):
                continue
            corr = r.get("model_rank_correlation")
            lines += [f"<details><summary>{r['label']}: {len(r['variants'])} variants"
                      + (f", cost-model rank correlation {corr:.2f}" if corr is not None else "") + "</summary>", "",
                      "| variant | params | schedule | model µs | measured µs | rel. error | status |", "|---|---|---|---|---|---|---|"]
            for v in sorted(r["variants"], key=lambda v: v.get("median_us") or math.inf):
                status = v.get("skipped") or v.get("error") or ("ok" if v.get("passed") else "float check failed")
                err = v.get("rel_error")
                lines.append(f"| {v['name']} | {v['params']} | {v['schedule']} | {_fmt(v['model_us'])} | {_fmt(v.get('median_us'))} | "
                             f"{'—' if err is None else f'{err:.1e}'} | {str(status)[:80]} |")
            lines += ["", "</details>", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Bars of µs per contender per case (log scale); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: no plot")
        return False
    specs = list(dict.fromkeys(r["spec"] for r in report["cases"]))
    fig, axes = plt.subplots(len(specs), 1, figsize=(14, 4 * len(specs)), squeeze=False)
    for ax, spec in zip(axes[:, 0], specs):
        rows = [r for r in report["cases"] if r["spec"] == spec]
        cols = [c for c in COLUMNS if any(_t(r, c) is not None for r in rows)] + ["floor"]
        width = 0.8 / len(cols)
        for j, c in enumerate(cols):
            ys = [(r["floor_us"] if c == "floor" else _t(r, c)) or 0 for r in rows]
            ax.bar([i + j * width for i in range(len(rows))], ys, width, label=c)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [r["label"] for r in rows], rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("µs")
        ax.set_title(spec)
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ---------------------------------------------------------------- entry points


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--specs", nargs="*", help="only these spec families (rmsnorm_linear, attention_decode, lora_linear, gated_mlp)")
    p.add_argument("--cases", nargs="*", help="only cases whose label contains one of these strings")
    p.add_argument("--max-autotune", choices=("none", "some", "all"), default="some",
                   help="where to also time torch.compile max-autotune-no-cudagraphs (slow to tune): 'some' = QKV and rank-16 LoRA")
    p.add_argument("--contenders", nargs="*", help="only these stock contenders (default: all that apply)")
    p.add_argument("--no-variants", action="store_true", help="time the stock contenders only")
    p.add_argument("--dry-run", action="store_true", help="list the cases, contenders and first-round tuning points (with cost-model estimates); no GPU")
    p.add_argument("--out", default=os.environ.get("OUT", str(Path(__file__).resolve().parent / "results")), help="directory for JSON/markdown/plot")
    p.add_argument("--tag", default="run", help="file name tag: kernels-<tag>.json")
    p.add_argument("--reps", type=int, default=50, help="timed CUDA-graph replays per contender in the final table")
    p.add_argument("--tune-reps", type=int, default=30, help="timed CUDA-graph replays per tuning point")
    p.add_argument("--top", type=int, default=2, help="candidates whose parameters the tuner refines after the first round")
    p.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)), help="processes compiling kernels in parallel")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tune-budget-s", type=float, default=300.0, help="start no tuning round after the first, nor any of its measurements, after this many seconds (the first round and the table are always measured)")


def run(args: argparse.Namespace) -> int:
    cases = plan(args.specs, args.cases, args.max_autotune)
    if args.dry_run:
        rows = describe_plan(cases)
        for r in rows:
            print(f"{r['label']:<22} {r['spec']:<17} floor {r['floor_bytes'] / 1e6:8.2f} MB  contenders: {', '.join(r['contenders'])}")
            for v in r["variants"]:
                print(f"    {v['name']:<24} {str(v['params']):<48} model {v['model_us']:8.2f} us   {v['schedule']}")
        print(f"{len(rows)} cases, {sum(len(r['variants']) for r in rows)} first-round tuning points, "
              f"{sum(len(r['contenders']) for r in rows)} stock measurements")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench kernels: no CUDA device; use --dry-run to see the plan", file=sys.stderr)
        return 2
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 256  # one compiled module per input set must not fall back to eager
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    from mirage_serve.tune.profile import clear_input_cache
    from mirage_serve.tune.search import Measurer, Precompiler, Tuner
    from mirage_serve.tune.timing import copy_bandwidth

    start = time.monotonic()
    deadline = time.time() + args.tune_budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / f"kernels-{args.tag}.json", out / f"kernels-{args.tag}.md"
    copy_bw = copy_bandwidth()
    report: dict[str, Any] = {"environment": environment(copy_bw), "cases": []}
    results = {c.label: new_result(c, copy_bw) for c in cases}
    measurer = Measurer()  # tuning points run in their own process: one that breaks its CUDA context costs only itself
    tuners = {} if args.no_variants else {
        c.label: Tuner(c.candidates, build_spec(c.spec, c.dims, dtype=DTYPE), reps=args.tune_reps, top=args.top, deadline=deadline,
                       on_trial=_record(results[c.label], c.label), measurer=measurer)
        for c in cases if c.candidates}
    precompiler = Precompiler(args.workers)
    rounds = []
    try:
        # every round of every case compiles in one parallel batch, then is timed case by case: compilation never overlaps a measurement
        for rnd in (1, 2, 3):
            batches = {label: tu.propose() for label, tu in tuners.items()}
            t0 = time.monotonic()
            precompiler.compile([t for b in batches.values() for t in b])
            compile_s = time.monotonic() - t0
            failed = [t for b in batches.values() for t in b if not t.compile.get("ok", True)]
            t0 = time.monotonic()
            for label, batch in batches.items():
                tuners[label].measure(batch)
                clear_input_cache()
            crashed = [t.label for tu in tuners.values() for t in tu.trials if "crashed" in str(t.result.get("error", ""))]
            rounds.append({"round": rnd, "points": sum(map(len, batches.values())), "compile_s": round(compile_s, 1),
                           "measure_s": round(time.monotonic() - t0, 1), "compile_failures": len(failed), "crashed": crashed})
            print(f"[{time.monotonic() - start:6.1f}s] tuning round {rnd}: {rounds[-1]}", flush=True)
            for t in failed[:3]:
                print(f"    did not compile: {t.label}: {t.compile.get('error', '')[:300]}", flush=True)
            errs = [t for b in batches.values() for t in b if t.compile.get("ok", True) and t.result.get("error")]
            for t in errs[:3]:
                print(f"    failed: {t.label}: {str(t.result['error'])[:300]}", flush=True)
    finally:
        precompiler.close()
        measurer.close()
    report["environment"]["tuning_rounds"] = rounds
    for case in cases:
        t0 = time.monotonic()
        res = finish_case(case, results[case.label], args)
        res["wall_s"] = round(time.monotonic() - t0, 1)
        report["cases"].append(res)
        jpath.write_text(json.dumps(clean_json(report), indent=1, default=_json_default, allow_nan=False))  # partial results survive a timeout
        print(f"[{time.monotonic() - start:6.1f}s] {case.label}: ours {_fmt(_t(res, 'ours'))} ({res.get('ours', {}).get('variant')} "
              f"{res.get('ours', {}).get('params')}) "
              + " ".join(f"{c}={_fmt(_t(res, c))}" for c in COLUMNS[1:] if _t(res, c) is not None) + f" floor={_fmt(res['floor_us'])}", flush=True)
    mpath.write_text(markdown(report))
    plot(report, out / f"kernels-{args.tag}.png")
    print(markdown(report))
    return 0


def _json_default(o: Any) -> Any:
    return str(o)


def clean_json(o: Any) -> Any:
    """The report with non-finite floats as null, so the file is strict JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: clean_json(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [clean_json(v) for v in o]
    return o


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    logging.basicConfig(level=logging.INFO if os.environ.get("BENCH_VERBOSE") else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
