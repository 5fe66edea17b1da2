"""End-to-end decode latency: stock transformers vs mirage-serve, on one GPU, in one run.

A model of the named config's shape (default Llama-3.1-8B) gets random bf16
weights (no checkpoint), a random prompt of ``--prompt`` tokens, and decodes
``--new`` tokens greedily, at each batch size, with:

* ``hf_eager`` / ``hf_sdpa``: ``model.generate`` with transformers' attention;
* ``static_graph``: mirage-serve's static-cache decode step in a CUDA graph, unpatched;
* ``patched_hf``: the patched model under ``model.generate`` (no graph);
* ``patched_graph``: the patched model, static cache, captured decode step;
* ``floor``: the weight bytes read once per token at the measured copy bandwidth.

ms/token excludes prefill (generate(new) minus generate(1), over new-1 tokens).
Greedy tokens of every contender are compared with ``hf_sdpa``'s. Run as
``python benchmarks/e2e.py`` or ``mirage-serve bench e2e MODEL_ID``.

The patched contenders read kernels from ``--cache-dir``; ``--tuned-from
kernels-<tag>.json`` (a :mod:`kernels` run on the same GPU) first writes a cache
there with the winning RMSNorm→linear μGraph and codegen parameters of each
batch bucket the run measured at this model's shapes, each verified against its
spec (finite-field trials and a float check) before it is stored. The stock
contenders run first, on the unpatched model, for every batch size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

CONTENDERS = ("hf_eager", "hf_sdpa", "static_graph", "patched_hf", "patched_graph")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_id", nargs="?", default="meta-llama/Llama-3.1-8B-Instruct", help="config to take the shape from (bundled id or directory)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick runs)")
    parser.add_argument("--cache-dir", default=None, help="kernel cache for the patched contenders")
    parser.add_argument("--tuned-from", default=None, help="kernels benchmark JSON whose winners fill --cache-dir (a temporary one if unset)")
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


def _random_model(config: dict, layers: int | None, torch):
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version", "auto_map")}
    cfg = AutoConfig.for_model(config["model_type"], **rest)
    if layers:
        cfg.num_hidden_layers = layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.8, 1.2, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        rotary = type(model.model.rotary_emb)(model.config)  # inv_freq is a non-persistent buffer: rebuild it
        model.model.rotary_emb = rotary.to("cuda")
    return model.eval()


def _leading_equal(a, b) -> int:
    """Tokens generated identically before the first difference, the fewest over the batch (greedy
    decoding of random weights meets near-ties, so two paths agree up to a point, then diverge)."""
    diff = (a != b).int()
    first = [int(row.nonzero()[0]) if bool(row.any()) else row.numel() for row in diff]
    return min(first)


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


def build_tuned_cache(kernels_json: str, cache_dir: str, config: dict, batches: list[int], dtype: str = "bfloat16") -> list[dict]:
    """Cache entries for this model's RMSNorm→linear shapes from a kernels run's winners (see the module docstring)."""
    import importlib.util

    from mirage_serve.cache import CacheEntry, CacheKey, KernelCache, current_gpu_arch
    from mirage_serve.codegen import CodegenParams
    from mirage_serve.specs import build_spec
    from mirage_serve.verify import verify_equivalent

    spec_v = importlib.util.spec_from_file_location("mirage_bench_variants", Path(__file__).parent / "variants.py")
    V = importlib.util.module_from_spec(spec_v)
    spec_v.loader.exec_module(V)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    eps = float(config.get("rms_norm_eps", 1e-6))
    wanted = {(heads + 2 * kv_heads) * head_dim, 2 * inter}
    cache = KernelCache(cache_dir)
    report = json.loads(Path(kernels_json).read_text())
    written = []
    for case in report["cases"]:
        d, ours = case["dims"], case.get("ours", {})
        if case["spec"] != "rmsnorm_linear" or d["hidden"] != hidden or d["out"] not in wanted or d["batch"] not in batches or "median_us" not in ours:
            continue
        cand = next((c for c in V.candidates_for("rmsnorm_linear", d, dtype, eps=eps) if c.name == ours["variant"]), None)
        if cand is None:
            continue
        spec = build_spec("rmsnorm_linear", d, dtype, eps=eps)
        t0 = time.perf_counter()
        cert = verify_equivalent(cand.graph, spec, trials=2, seed=0)
        row = {"dims": d, "variant": ours["variant"], "params": ours["params"], "verdict": cert.verdict, "verify_s": round(time.perf_counter() - t0, 1)}
        if cert.verdict == "equivalent":
            params = CodegenParams(**ours["params"]).cache_params()
            key = CacheKey("rmsnorm_linear", d, dtype, gpu_arch=current_gpu_arch(), options={"eps": eps})
            cache.put(CacheEntry.create(key, cand.graph, certificate=cert, params=params, timings={"latency_us": float(ours["median_us"])}))
        written.append(row)
        print(json.dumps(row), flush=True)
    return written


def tuned_provider(cache_dir: str):
    """A kernel provider that compiles each cache entry with the codegen parameters stored in it."""
    from mirage_serve.cache import KernelCache
    from mirage_serve.codegen import CodegenParams, compile_graph
    from mirage_serve.integrations.kernels import KernelProvider

    class TunedProvider(KernelProvider):
        def _find(self, *a):
            k = super()._find(*a)
            if k is not None and k.backend == "triton":
                entry = next((e for e in self.cache.entries() if e.key.entry_id == k.entry_id), None)
                if entry is not None and entry.params:
                    k._compiled = compile_graph(k.graph, CodegenParams.from_dict(dict(entry.params)))
            return k

    return TunedProvider(KernelCache(cache_dir))


def _source_checkout_packages() -> None:
    """From a source checkout that is not installed, map models/ to mirage_serve.models as the package does."""
    import importlib.util

    import mirage_serve

    if importlib.util.find_spec("mirage_serve.models") is None:
        mirage_serve.__path__.append(str(Path(__file__).resolve().parents[1]))


def run(args: argparse.Namespace) -> int:
    import torch

    _source_checkout_packages()

    from mirage_serve.model_ids import resolve_config

    config, source = resolve_config(args.model_id)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    contenders = [c for c in args.contenders.split(",") if c]
    if args.dry_run or not torch.cuda.is_available():
        print(f"e2e plan: {args.model_id} ({source}), layers {args.layers or config.get('num_hidden_layers')}, batches {batches}, "
              f"prompt {args.prompt}, new {args.new}, contenders {contenders}")
        return 0 if args.dry_run else 2
    import transformers

    from mirage_serve.integrations.hf import patch_model

    out_dir = Path(args.out or os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    bw = _bandwidth_gbs(torch)
    import tempfile

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="mirage-e2e-cache-")
    tuned_entries = build_tuned_cache(args.tuned_from, cache_dir, config, batches) if args.tuned_from else []
    model = _random_model(config, args.layers, torch)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    tokens: dict[tuple[int, str], object] = {}
    gen = torch.Generator(device="cuda").manual_seed(1)
    report = None
    prompts = {b: torch.randint(0, model.config.vocab_size, (b, args.prompt), device="cuda", generator=gen) for b in batches}
    floor = 1e3 * weight_bytes / (bw * 1e9)
    for b in batches:
        rows.append({"batch": b, "contender": "floor", "ms_per_token": floor})
    stock = [c for c in contenders if not c.startswith("patched")]
    patched = [c for c in contenders if c.startswith("patched")]
    for phase in (stock, patched):
        if phase is patched and phase:
            report = patch_model(model, provider=tuned_provider(cache_dir))
            print(report.summary(), flush=True)
        for b in batches:
            ids = prompts[b]
            for c in phase:
                if c in ("hf_eager", "hf_sdpa"):
                    model.set_attn_implementation(c.removeprefix("hf_"))
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
                tokens[(b, c)] = out
                ref = tokens.get((b, "hf_sdpa"))
                same = None if ref is None else float((out[:, args.prompt:] == ref[:, args.prompt:]).float().mean())
                row = {"batch": b, "contender": c, "ms_per_token": ms, "x_floor": ms / floor, "tokens_equal_to_hf_sdpa": same}
                if ref is not None:
                    row["leading_tokens_equal_to_hf_sdpa"] = _leading_equal(out[:, args.prompt:], ref[:, args.prompt:])
                base = tokens.get((b, "static_graph")) if c == "patched_graph" else tokens.get((b, "hf_sdpa")) if c == "patched_hf" else None
                if base is not None:  # the same decode path unpatched: only the kernels differ
                    row["tokens_equal_to_unpatched"] = float((out[:, args.prompt:] == base[:, args.prompt:]).float().mean())
                    row["leading_tokens_equal_to_unpatched"] = _leading_equal(out[:, args.prompt:], base[:, args.prompt:])
                if capture is not None:
                    row["capture_s"] = capture
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "benchmark": "e2e",
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()},
        "model": args.model_id, "layers": model.config.num_hidden_layers, "prompt": args.prompt, "new_tokens": args.new,
        "copy_bandwidth_gbs": bw, "weight_bytes": weight_bytes, "tuned_entries": tuned_entries,
        "codegen_version": __import__("mirage_serve.codegen", fromlist=["CODEGEN_VERSION"]).CODEGEN_VERSION,
        "kernel_calls": report.kernel_calls() if report else {}, "misses": report.misses if report else {},
        "disabled": {k.entry_id: k.disabled for k in (report.provider._memo.values() if report and report.provider else []) if k is not None and k.disabled},
        "patch_summary": report.summary() if report else None,
        "rows": rows,
    }
    stem = f"{result['date']}-{args.tag}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# End-to-end decode, {result['gpu']}, {args.model_id} shape, prompt {args.prompt}, {args.new} new tokens", "",
             "| batch | contender | ms/token | × floor | tokens = hf_sdpa | leading tokens = unpatched |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['contender']} | error: {r['error'][:80]} | | | |")
        else:
            eq = r.get("tokens_equal_to_hf_sdpa")
            lead = r.get("leading_tokens_equal_to_unpatched", "")
            lines.append(f"| {r['batch']} | {r['contender']} | {r['ms_per_token']:.2f} | {r.get('x_floor', 1.0):.2f} | {'' if eq is None else f'{eq:.3f}'} | {lead} |")
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
