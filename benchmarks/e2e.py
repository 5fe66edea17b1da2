"""End-to-end decode latency: stock transformers vs mirage-serve, on one GPU, in one run.

A model of the named config's shape (default Llama-3.1-8B) gets random bf16
weights (no checkpoint; see :func:`_random_model` for the initialisation), a
random prompt of ``--prompt`` tokens, and decodes ``--new`` tokens greedily, at
each batch size, with:

* ``hf_eager`` / ``hf_sdpa``: ``model.generate`` with transformers' attention;
* ``static_graph``: mirage-serve's static-cache decode step in a CUDA graph, unpatched;
* ``patched_hf``: the patched model under ``model.generate`` (no graph);
* ``patched_graph``: the patched model, static cache, captured decode step;
* ``floor``: the weight bytes read once per token at the measured copy bandwidth.

ms/token excludes prefill (generate(new) minus generate(1), over new-1 tokens,
for transformers; the decode steps alone for the static decoder).

The model is patched with the public API, ``patch_model(model, cache,
kv_buckets=...)``, from a kernel cache built for this model's shapes
(:func:`prepare_cache`): the subgraphs that ``patch_model`` runs
(``rmsnorm_linear`` for the QKV and gate/up groups, ``attention_decode`` at the
kv_len bucket holding prompt + new positions) at each batch bucket. An entry
already in ``--cache-dir`` is used as it is; ``--search-budget S`` runs the
project's build step (``mirage-serve build-cache``'s ``build_item``: search,
verify, codegen check, GPU ranking) for the rest; what is still missing is
seeded with the hand-written fused μGraphs of ``tests/handwritten.py`` as
``benchmarks/variants.py`` instantiates them (labelled ``handwritten`` in the
JSON), each verified by ``verify_equivalent`` against its spec before it is
stored. Their codegen parameters come from a ``kernels.py`` run on an H200
(``--tuned-from``) where it measured the same shape; decode-attention
candidates are ranked on this GPU over the parameters measured at the nearest
KV length.

Greedy tokens, the unpatched static decoder (``static_graph``) being the reference:

* free-running: the share of equal tokens, the equal prefix, and at each
  sequence's first difference the reference's logit margin between the two
  tokens (the contexts are still identical there);
* teacher-forced (``generate(..., forced_tokens=reference)``): every position
  sees the reference's context, so all ``new`` positions are compared; for each
  disagreement the reference's margin, next to the median top-1/top-2 margin;
* the same teacher-forced count for transformers' sdpa forward over the
  reference sequence: two unpatched implementations, the level of bf16 rounding.

Run as ``python benchmarks/e2e.py`` or ``mirage-serve bench e2e MODEL_ID``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

CONTENDERS = ("hf_eager", "hf_sdpa", "static_graph", "patched_hf", "patched_graph")
PATCHED_SPECS = ("rmsnorm_linear", "attention_decode")  # what patch_model runs for a model without LoRA
DEFAULT_TUNED = Path(__file__).parent / "results" / "2026-12-03-h200-tuned-first.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_id", nargs="?", default="meta-llama/Llama-3.1-8B-Instruct", help="config to take the shape from (bundled id or directory)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick runs)")
    parser.add_argument("--cache-dir", default=None, help="kernel cache for the patched contenders (default: a fresh temporary one)")
    parser.add_argument("--tuned-from", default=str(DEFAULT_TUNED), help="kernels benchmark JSON with the codegen parameters of the hand-written seeds")
    parser.add_argument("--search-budget", type=float, default=0.0, help="seconds of build-cache search per missing entry before seeding (0: seed at once)")
    parser.add_argument("--init", default="gpt2", choices=("gpt2", "normal", "successor"), help="random weights: see _random_model")
    parser.add_argument("--successor-scale", type=float, default=3.0, help="embedding scale of --init successor")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="weights, activations and kernels (float32: the tuned bf16 parameters are not used; kernels run at "
                             "their exact-fp32 defaults)")
    parser.add_argument("--fp32-reference", action="store_true", help="also score every bf16 path against a float32 copy of the model")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--out", default=None, help="directory for JSON/markdown/plot (default benchmarks/results or $OUT)")
    parser.add_argument("--tag", default="e2e")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")


def _bandwidth_gbs(torch) -> float:
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 4 * n / (time.perf_counter() - t) / 1e9


def _random_model(config: dict, layers: int | None, torch, init: str = "gpt2", successor_scale: float = 3.0,
                  dtype: str = "bfloat16"):
    """The config's model on the GPU with random weights of ``dtype`` (bf16 by default).

    ``normal``: every matrix N(0, 0.02), every norm weight U(0.8, 1.2).
    ``gpt2``: the same, with the projections that write the residual stream
    (``o_proj``, ``down_proj``) scaled by 1/sqrt(2 * layers), as GPT-2 initialises
    them; the residual stream then grows less from layer to layer, and so do
    rounding differences. Larger weights make greedy decisions more fragile, not
    less (``benchmarks/e2e_init_noise.py``, on a scaled-down CPU model: 8.6% of
    positions flipped by bf16-sized noise at std 0.02, 12.5% at 0.05, 17% at 0.1,
    5.5% with the GPT-2 scaling).
    ``successor``: ``gpt2`` with the token embeddings scaled by ``successor_scale``
    and lm_head's row of token v set to the unit-norm embedding of token perm[v] (a
    fixed random permutation): every token gets a designated successor, whose logit
    stands far above the rest while the embedding's share of the last residual is
    large enough. The share of positions where the layers change the greedy choice
    is measured in each run (``layers_change_argmax``): on the 1024-wide CPU model
    of ``e2e_init_noise.py`` a scale of 3 already leaves the choice to the
    successor everywhere (32 layers: top-1/top-2 margin >= 1.08 std at 99% of
    positions), but on the Llama-3.1-8B shape (2026-12-03 H200 run) the layers still
    changed it at 100% (batch 1) and 98.6% (batch 8) of positions, so near-ties
    remained; a larger scale is untested there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version", "auto_map")}
    cfg = AutoConfig.for_model(config["model_type"], **rest)
    if layers:
        cfg.num_hidden_layers = layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    resid = (2 * cfg.num_hidden_layers) ** -0.5 if init in ("gpt2", "successor") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.8, 1.2, generator=gen)
            else:
                p.normal_(0.0, 0.02 * (resid if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0), generator=gen)
        if init == "successor":
            emb = model.model.embed_tokens.weight
            if model.lm_head.weight.data_ptr() == emb.data_ptr():
                raise ValueError("--init successor needs an lm_head that is not tied to the embeddings")
            emb.mul_(successor_scale)
            perm = torch.randperm(emb.shape[0], device="cuda", generator=gen)
            rows = emb[perm].float()
            model.lm_head.weight.copy_(rows / rows.norm(dim=-1, keepdim=True))
        rotary = type(model.model.rotary_emb)(model.config)  # inv_freq is a non-persistent buffer: rebuild it
        model.model.rotary_emb = rotary.to("cuda")
    return model.eval()


def _time_hf(model, ids, new: int, torch) -> tuple[float, object]:
    def gen(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    t1, _ = gen(1)  # also the warm-up
    t1, _ = gen(1)
    tn, out = gen(new)
    return 1e3 * (tn - t1) / (new - 1), out


def _time_static(model, ids, new: int, torch) -> tuple[float, object, float]:
    from mirage_serve.integrations.decode import generate

    generate(model, ids, 4, cuda_graph=True)
    out, stats = generate(model, ids, new, cuda_graph=True, return_stats=True)
    return stats.ms_per_token, out, stats.capture_s


# ---- token agreement ------------------------------------------------------------------


def _margins(logits, a, b):
    """logits[..., a] - logits[..., b] (gathered per position), and the same over the logits' std there."""
    la = logits.gather(-1, a[..., None])[..., 0]
    lb = logits.gather(-1, b[..., None])[..., 0]
    return la - lb, (la - lb) / logits.std(-1)


def free_running_agreement(ref_tokens, ref_logits, tokens) -> dict:
    """Free-running greedy tokens against the reference's: equal share, equal prefix per sequence, and at each
    sequence's first difference the reference's logit margin between its token and the other (same context)."""
    eq = ref_tokens == tokens
    rows = []
    for r in range(eq.shape[0]):
        diff = (~eq[r]).nonzero()
        if not len(diff):
            rows.append({"leading_equal": int(eq.shape[1])})
            continue
        i = int(diff[0])
        m, rel = _margins(ref_logits[r, i], ref_tokens[r, i], tokens[r, i])
        rows.append({"leading_equal": i, "ref_margin": float(m), "ref_margin_over_std": float(rel)})
    return {"equal": int(eq.sum()), "of": int(eq.numel()), "equal_share": float(eq.float().mean()),
            "leading_equal_min": min(r["leading_equal"] for r in rows), "per_sequence": rows}


def forced_agreement(ref_tokens, ref_logits, choices, logits=None) -> dict:
    """Teacher-forced choices at every position against the reference tokens (same context everywhere):
    count, and for each disagreement the reference's margin between its token and the choice."""
    top2 = ref_logits.topk(2, -1).values
    gap = top2[..., 0] - top2[..., 1]
    gap_rel = gap / ref_logits.std(-1)
    eq = ref_tokens == choices
    out = {"equal": int(eq.sum()), "of": int(eq.numel()), "equal_share": float(eq.float().mean()),
           "median_top2_margin": float(gap.median()), "median_top2_margin_over_std": float(gap_rel.median()),
           "share_top2_margin_below_1pct_std": float((gap_rel < 0.01).float().mean())}
    where = (~eq).nonzero().tolist()
    diffs = []
    for r, i in where:
        m, rel = _margins(ref_logits[r, i], ref_tokens[r, i], choices[r, i])
        diffs.append({"seq": r, "pos": i, "ref_margin": float(m), "ref_margin_over_std": float(rel)})
    out["disagreements"] = diffs[:64]
    if diffs:
        out["max_ref_margin_over_std"] = max(d["ref_margin_over_std"] for d in diffs)
        # how rare such a margin is: the share of all positions whose top-1/top-2 margin is at most it
        out["share_of_positions_with_margin_at_most_that"] = float((gap_rel <= out["max_ref_margin_over_std"] + 1e-12).float().mean())
    if logits is not None:
        rel = (logits - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1)
        out["logit_rel_error_median"] = float(rel.median())
        out["logit_rel_error_max"] = float(rel.max())
    return out


def _vs_fp32(logits32, logits) -> dict:
    """Logit relative error per position against the float32 model's, and how many greedy choices agree."""
    rel = (logits.float() - logits32).norm(dim=-1) / logits32.norm(dim=-1)
    eq = logits.argmax(-1) == logits32.argmax(-1)
    return {"logit_rel_error_median": float(rel.median()), "logit_rel_error_max": float(rel.max()), "argmax_equal": int(eq.sum()), "of": int(eq.numel())}


# ---- the kernel cache -----------------------------------------------------------------


def _load_variants():
    import importlib.util

    spec_v = importlib.util.spec_from_file_location("mirage_bench_variants", Path(__file__).parent / "variants.py")
    V = importlib.util.module_from_spec(spec_v)
    spec_v.loader.exec_module(V)
    return V


def _tuned_cases(path: str | None) -> tuple[list[dict], str | None]:
    if not path or not Path(path).exists():
        return [], None
    report = json.loads(Path(path).read_text())
    return [c for c in report.get("cases", []) if "median_us" in c.get("ours", {})], report.get("gpu") or Path(path).name


def _nearest_tuned(cases: list[dict], spec: str, dims: dict) -> dict | None:
    """The measured case of ``spec`` with the same dims, or (decode attention) the same dims but the nearest kv_len."""
    same = [c for c in cases if c["spec"] == spec and {k: v for k, v in c["dims"].items() if k != "kv_len"} == {k: v for k, v in dims.items() if k != "kv_len"}]
    if "kv_len" in dims:
        same.sort(key=lambda c: abs(math.log(c["dims"]["kv_len"] / dims["kv_len"])))
    else:
        same = [c for c in same if c["dims"] == dims]
    return same[0] if same else None


def prepare_cache(cache_dir: str, config: dict, batches: list[int], kv_len: int, *, tuned_from: str | None, search_budget: float,
                  dtype: str = "bfloat16") -> list[dict]:
    """Make sure ``cache_dir`` holds a verified entry for every subgraph patch_model runs at these shapes
    (see the module docstring); one report row per subgraph, saying where its entry came from."""
    import torch

    from mirage_serve.cache import CacheEntry, CacheKey, KernelCache, current_gpu_arch
    from mirage_serve.codegen import CodegenParams
    from mirage_serve.models import get_adapter
    from mirage_serve.tune import rank_candidates
    from mirage_serve.verify import verify_equivalent

    arch = current_gpu_arch()
    cache = KernelCache(cache_dir)
    plan = get_adapter(config["model_type"]).plan(config, batches, dtype=dtype, kv_lens=(kv_len,))
    cases, tuned_label = _tuned_cases(tuned_from)
    V = _load_variants()
    rows, seen = [], set()
    for sg in plan.subgraphs:
        if sg.spec_name not in PATCHED_SPECS or sg.signature() in seen:
            continue
        seen.add(sg.signature())
        t0 = time.perf_counter()
        key = CacheKey(sg.spec_name, dict(sg.dims), sg.dtype, gpu_arch=arch, options=dict(sg.options))
        row = {"spec": sg.spec_name, "role": sg.role, "dims": dict(sg.dims), "options": dict(sg.options)}
        entry = cache.lookup(key)
        if entry is not None:
            row.update(source="cache", entry_id=entry.key.entry_id, params=dict(entry.params), verdict=entry.verdict)
            rows.append(row)
            continue
        if search_budget > 0:
            from mirage_serve.cmd_build_cache import BuildOptions, WorkItem, build_item

            res = build_item(WorkItem(sg, [sg.role], list(sg.sites)), cache, arch, BuildOptions(search_budget, 1, False))
            row["search"] = {"status": res.status, "message": res.message[:300], "seconds": round(res.seconds, 1)}
            if res.status == "built":
                row.update(source="search", entry_id=res.entry_id, verdict="equivalent", seconds=round(time.perf_counter() - t0, 1))
                rows.append(row)
                continue
        spec = sg.build_spec()
        cands = V.candidates_for(sg.spec_name, dict(sg.dims), sg.dtype, **sg.options)
        tuned = _nearest_tuned(cases, sg.spec_name, dict(sg.dims))
        tuned_params = dict(tuned["ours"]["params"]) if tuned else {}
        if sg.spec_name == "attention_decode" and torch.cuda.is_available():
            # rank the hand-written schedules at this KV length on this GPU, over the parameters measured nearest
            grid = [tuned_params, {}] if tuned_params else [{}]
            ranked = [r for r in rank_candidates([c.graph for c in cands], grid, device="cuda", spec=spec) if r.passed]
            order = [(next(c for c in cands if c.graph is r.graph), r.params, r.time_us) for r in ranked]
            params_from = f"ranked on this GPU over {{stored defaults, {tuned_label} at kv_len {tuned['dims']['kv_len']}}}" if tuned else "ranked on this GPU"
        else:
            chosen = next((c for c in cands if tuned and c.name == tuned["ours"]["variant"]), None)
            order = [(chosen, tuned_params, float(tuned["ours"]["median_us"]))] if chosen else [(c, {}, math.nan) for c in cands[:1]]
            params_from = f"{tuned_label}, variant {tuned['ours']['variant']} at these dims" if chosen else "defaults (no measured case)"
        for cand, params, us in order:
            cert = verify_equivalent(cand.graph, spec, trials=2, seed=0)
            if cert.verdict != "equivalent":
                row.setdefault("rejected", []).append({"variant": cand.name, "verdict": cert.verdict})
                continue
            params = CodegenParams.from_dict(dict(params) if isinstance(params, dict) else vars(params)).cache_params() if params else {}
            timings = {"time_us": float(us)} if math.isfinite(us) else {}
            cache.put(CacheEntry.create(key, cand.graph, certificate=cert, params=params, timings=timings))
            row.update(source="handwritten", variant=cand.name, params=params, params_from=params_from, verdict=cert.verdict,
                       time_us=us if math.isfinite(us) else None, entry_id=key.entry_id)
            break
        else:
            row.update(source="none", verdict="no candidate verified")
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _source_checkout_packages() -> None:
    """From a source checkout that is not installed, map models/ to mirage_serve.models as the package does."""
    import importlib.util

    import mirage_serve

    if importlib.util.find_spec("mirage_serve.models") is None:
        mirage_serve.__path__.append(str(Path(__file__).resolve().parents[1]))


def _kernel_table(report, specs_by_entry: dict[str, dict]) -> list[dict]:
    """Per cache entry: spec, dims, where it came from, Python-level calls (graph replays are not counted),
    the KV lengths it served under transformers' generate, and whether it was disabled."""
    out = []
    for k in report.provider.kernels():
        row = {"entry_id": k.entry_id, "spec": k.spec_name, "dims": dict(k.dims), "backend": k.backend, "params": dict(k.params),
               "calls": k.calls, "disabled": k.disabled, "source": specs_by_entry.get(k.entry_id, {}).get("source")}
        if k.calls_by_length:
            lengths = sorted(k.calls_by_length)
            row["kv_lengths_served"] = [lengths[0], lengths[-1], len(lengths)]
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    _source_checkout_packages()

    from mirage_serve.model_ids import resolve_config

    config, source = resolve_config(args.model_id)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    contenders = [c for c in args.contenders.split(",") if c]
    kv_len = args.prompt + args.new  # the static decoder's cache; transformers' cache stays below it
    if args.dry_run or not torch.cuda.is_available():
        print(f"e2e plan: {args.model_id} ({source}), layers {args.layers or config.get('num_hidden_layers')}, batches {batches}, "
              f"prompt {args.prompt}, new {args.new}, kv_len bucket {kv_len}, {args.dtype} weights, contenders {contenders}")
        return 0 if args.dry_run else 2
    import tempfile

    import transformers
    import triton

    from mirage_serve.integrations.decode import generate
    from mirage_serve.integrations.hf import patch_model

    t_start = time.perf_counter()
    out_dir = Path(args.out or os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    bw = _bandwidth_gbs(torch)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="mirage-e2e-cache-")
    patched = [c for c in contenders if c.startswith("patched")]
    cache_rows = []
    if patched:
        cache_rows = prepare_cache(cache_dir, config, batches, kv_len, tuned_from=args.tuned_from if args.dtype == "bfloat16" else None,
                                   search_budget=args.search_budget, dtype=args.dtype)
    cache_s = time.perf_counter() - t_start
    model = _random_model(config, args.layers, torch, args.init, args.successor_scale, args.dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    tokens: dict[tuple[int, str], object] = {}
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompts = {b: torch.randint(0, model.config.vocab_size, (b, args.prompt), device="cuda", generator=gen) for b in batches}
    floor = 1e3 * weight_bytes / (bw * 1e9)
    for b in batches:
        rows.append({"batch": b, "contender": "floor", "ms_per_token": floor})
    agreement: dict[str, dict] = {}
    reference: dict[int, tuple] = {}  # batch -> unpatched static decoder's (tokens, logits)
    layers_change: dict[int, float] = {}  # batch -> share of reference positions where the layers change the greedy choice
    embedding_share: dict[int, float] = {}  # batch -> median cosine of the final hidden state with the current token's embedding
    accuracy: dict[str, dict] = {}  # against the float32 model, on the reference sequence
    logits32: dict[int, object] = {}
    fp32 = None
    if args.fp32_reference and patched and args.dtype != "float32":
        import copy

        fp32 = copy.deepcopy(model).float()
        fp32.set_attn_implementation("sdpa")
    report = None
    calls_at_capture: dict[str, dict[str, int]] = {}
    stock = [c for c in contenders if not c.startswith("patched")]
    for phase in (stock, patched):
        if phase is patched and phase:
            for b in batches:  # the reference: the unpatched static decoder, and transformers' sdpa forward over its tokens
                ids = prompts[b]
                ref, ref_logits = generate(model, ids, args.new, cuda_graph=True, return_logits=True)
                reference[b] = (ref[:, args.prompt:], ref_logits)
                model.set_attn_implementation("sdpa")
                with torch.no_grad():
                    fwd = model(ref[:, :-1], output_hidden_states=True)
                    full = fwd.logits[:, args.prompt - 1:].float()
                    last = fwd.hidden_states[-1][:, args.prompt - 1:].float()  # after the final norm
                    current = model.model.embed_tokens(ref[:, args.prompt - 1:-1]).float()
                    embedding_share[b] = float(torch.nn.functional.cosine_similarity(last, current, dim=-1).median())
                    del fwd, last, current
                agreement[f"b{b}_hf_sdpa_forward_forced_vs_static"] = forced_agreement(ref[:, args.prompt:], ref_logits, full.argmax(-1), full)
                with torch.no_grad():  # the greedy choice without the layers: norm(embedding) through lm_head
                    inner = model.model
                    bare = model.lm_head(inner.norm(inner.embed_tokens(ref[:, args.prompt - 1:-1]))).argmax(-1)
                layers_change[b] = float((bare != ref[:, args.prompt:]).float().mean())
                if fp32 is not None:
                    with torch.no_grad():
                        logits32[b] = fp32(ref[:, :-1]).logits[:, args.prompt - 1:].float()
                    accuracy[f"b{b}"] = {"hf_sdpa_bf16_forward": _vs_fp32(logits32[b], full), "static_bf16_unpatched": _vs_fp32(logits32[b], ref_logits)}
                del full
            if fp32 is not None:
                del fp32
                fp32 = None
                torch.cuda.empty_cache()
            report = patch_model(model, cache_dir, kv_buckets=(kv_len,))
            print(report.summary(), flush=True)
        for b in batches:
            ids = prompts[b]
            for c in phase:
                if c in ("hf_eager", "hf_sdpa"):
                    model.set_attn_implementation(c.removeprefix("hf_"))
                before = report.kernel_calls() if report else {}
                try:
                    if c in ("hf_eager", "hf_sdpa", "patched_hf"):
                        ms, out = _time_hf(model, ids, args.new, torch)
                        capture = None
                    else:
                        ms, out, capture = _time_static(model, ids, args.new, torch)
                except Exception as e:  # record and go on: one failing contender must not hide the others
                    rows.append({"batch": b, "contender": c, "error": f"{type(e).__name__}: {e}"})
                    print(f"batch {b} {c}: {type(e).__name__}: {e}", flush=True)
                    continue
                if report is not None:
                    after = report.kernel_calls()
                    calls_at_capture[f"b{b}_{c}"] = {e: n - before.get(e, 0) for e, n in after.items() if n != before.get(e, 0)}
                tokens[(b, c)] = out
                new_tokens = out[:, args.prompt:]
                row = {"batch": b, "contender": c, "ms_per_token": ms, "x_floor": ms / floor}
                ref = tokens.get((b, "hf_sdpa"))
                if ref is not None:
                    row["tokens_equal_to_hf_sdpa"] = float((new_tokens == ref[:, args.prompt:]).float().mean())
                if capture is not None:
                    row["capture_s"] = capture
                if c == "patched_graph" and b in reference:
                    ref_tokens, ref_logits = reference[b]
                    free = free_running_agreement(ref_tokens, ref_logits, new_tokens)
                    choices, f_logits = generate(model, ids, args.new, cuda_graph=True, forced_tokens=ref_tokens, return_logits=True)
                    forced = forced_agreement(ref_tokens, ref_logits, choices[:, args.prompt:], f_logits)
                    if b in logits32:
                        accuracy[f"b{b}"]["patched_graph_bf16"] = _vs_fp32(logits32[b], f_logits)
                    agreement[f"b{b}_patched_graph_free_vs_static"] = free
                    agreement[f"b{b}_patched_graph_forced_vs_static"] = forced
                    row["free_running_equal"] = f"{free['equal']}/{free['of']}"
                    row["free_running_leading_equal_min"] = free["leading_equal_min"]
                    row["forced_equal"] = f"{forced['equal']}/{forced['of']}"
                    del f_logits
                rows.append(row)
                print(json.dumps(row), flush=True)
                partial = {"rows": rows, "cache_entries": cache_rows, "token_agreement": agreement, "misses": report.misses if report else {}}
                (out_dir / f"{datetime.date.today().isoformat()}-{args.tag}.partial.json").write_text(json.dumps(partial, indent=1))
    (out_dir / f"{datetime.date.today().isoformat()}-{args.tag}.partial.json").unlink(missing_ok=True)
    specs_by_entry = {r["entry_id"]: r for r in cache_rows if r.get("entry_id")}
    result = {
        "benchmark": "e2e",
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "triton": triton.__version__,
                     "python": platform.python_version(), "cuda": torch.version.cuda},
        "codegen_version": __import__("mirage_serve.codegen", fromlist=["CODEGEN_VERSION"]).CODEGEN_VERSION,
        "model": args.model_id, "layers": model.config.num_hidden_layers, "prompt": args.prompt, "new_tokens": args.new,
        "dtype": args.dtype, "init": args.init, "successor_scale": args.successor_scale if args.init == "successor" else None, "kv_len_bucket": kv_len,
        "copy_bandwidth_gbs": bw, "weight_bytes": weight_bytes,
        "cache_entries": cache_rows, "cache_build_s": round(cache_s, 1),
        "kernels": _kernel_table(report, specs_by_entry) if report else [],
        "kernel_calls_per_contender": calls_at_capture,
        "misses": report.misses if report else {},
        "patch_summary": report.summary() if report else None,
        "not_patched": [r.to_dict() for r in report.skipped] if report else [],
        "token_agreement": agreement,
        "layers_change_argmax": {f"b{b}": v for b, v in layers_change.items()},
        "final_hidden_cosine_with_current_embedding": {f"b{b}": v for b, v in embedding_share.items()},
        "accuracy_vs_fp32": accuracy,
        "rows": rows,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    stem = f"{result['date']}-{args.tag}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# End-to-end decode, {result['gpu']}, {args.model_id} shape, prompt {args.prompt}, {args.new} new tokens", "",
             f"torch {torch.__version__}, transformers {transformers.__version__}, triton {triton.__version__}, codegen "
             f"{result['codegen_version']}, {result['date']}; {args.dtype} weights, init {args.init}; copy bandwidth {bw:.0f} GB/s", "",
             "| batch | contender | ms/token | × floor | tokens = hf_sdpa | free-running = unpatched | teacher-forced = unpatched |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['contender']} | error: {r['error'][:80]} | | | | |")
        else:
            eq = r.get("tokens_equal_to_hf_sdpa")
            lines.append(f"| {r['batch']} | {r['contender']} | {r['ms_per_token']:.2f} | {r.get('x_floor', 1.0):.2f} | "
                         f"{'' if eq is None else f'{eq:.3f}'} | {r.get('free_running_equal', '')} | {r.get('forced_equal', '')} |")
    lines += ["", "Kernels (Python-level calls; captured replays are not counted):", ""]
    for k in result["kernels"]:
        lines.append(f"- {k['spec']} {k['dims']} ({k['source']}, params {k['params']}): {k['calls']} calls"
                     f"{', disabled: ' + k['disabled'] if k['disabled'] else ''}")
    lines += ["", "Token agreement (reference: the unpatched static decoder):", ""]
    for name, a in agreement.items():
        extra = f", max reference margin at a disagreement {a['max_ref_margin_over_std']:.4f} std" if "max_ref_margin_over_std" in a else ""
        if "per_sequence" in a:
            firsts = [(s["leading_equal"], round(s.get("ref_margin_over_std", float("nan")), 4)) for s in a["per_sequence"]]
            extra = f", (first difference, reference margin there in std) per sequence {firsts}"
        lines.append(f"- {name}: {a['equal']}/{a['of']} equal{extra}")
    if accuracy:
        lines += ["", "Against the float32 model on the reference sequence (teacher-forced, all positions): logit relative error "
                  "(median / max over positions), greedy choices equal to float32's:", "",
                  "| batch | path | logit error median | max | argmax = fp32 |", "|---|---|---|---|---|"]
        for b, paths in accuracy.items():
            for name, a in paths.items():
                lines.append(f"| {b[1:]} | {name} | {a['logit_rel_error_median']:.4f} | {a['logit_rel_error_max']:.4f} | {a['argmax_equal']}/{a['of']} |")
    if layers_change:
        lines += ["", "Share of reference positions where the layers change the greedy choice (vs norm(embedding) through lm_head): "
                  + ", ".join(f"batch {b}: {v:.3f}" for b, v in layers_change.items())
                  + "; median cosine of the final hidden state with the current token's embedding: "
                  + ", ".join(f"batch {b}: {v:.3f}" for b, v in embedding_share.items())]
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        names = [c for c in ["floor", *contenders] if any(r["contender"] == c and "ms_per_token" in r for r in rows)]
        width = 0.8 / max(len(batches), 1)
        for i, b in enumerate(batches):
            vals = [next((r["ms_per_token"] for r in rows if r["batch"] == b and r["contender"] == c and "ms_per_token" in r), 0) for c in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=f"batch {b}")
        ax.set_xticks([j + width * (len(batches) - 1) / 2 for j in range(len(names))], names, rotation=20)
        ax.set_ylabel("ms per token")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"{stem}.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    sys.exit(run(p.parse_args()))
