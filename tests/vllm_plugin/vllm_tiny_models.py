"""A tiny random Llama checkpoint and a kernel cache of verified entries for its shapes.

The entries are the hand-written fused μGraphs of ``tests/handwritten.py``, each
verified against its spec by :func:`mirage_serve.verify.verify_equivalent` and
stored through :meth:`KernelCache.put`, which re-checks the entry and its
certificate: the same path ``mirage-serve build-cache`` writes by.

Usage (by hand): python tests/vllm_plugin/vllm_tiny_models.py MODEL_DIR CACHE_DIR
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for handwritten

from handwritten import fused_add_rmsnorm_linear, fused_rmsnorm_linear  # noqa: E402

from mirage_serve.cache import CacheEntry, CacheKey, KernelCache  # noqa: E402
from mirage_serve.specs import build_spec  # noqa: E402
from mirage_serve.verify import verify_equivalent  # noqa: E402

# head_dim >= 32: vLLM's CPU attention needs it
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, EPS = 128, 4, 2, 32, 256, 2, 1e-5
QKV_OUT, GATE_UP_OUT = (HEADS + 2 * KV_HEADS) * HEAD_DIM, 2 * INTER
BUCKETS = (1, 2, 4, 8, 16, 32)


def save_tiny_llama(path: Path) -> Path:
    """A random 2-layer Llama (norm weights away from 1, so the norm's gain matters) saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=256, rms_norm_eps=EPS)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def put_verified(cache: KernelCache, spec_name: str, dims: dict[str, int], dtype: str, eps: float) -> None:
    """Verify the hand-written μGraph for (spec, dims) and store it; fails loudly if it is not equivalent."""
    build = {"rmsnorm_linear": fused_rmsnorm_linear, "add_rmsnorm_linear": fused_add_rmsnorm_linear}[spec_name]
    graph = build(dims["batch"], dims["hidden"], dims["out"], 2, 4, eps=eps, dtype=dtype)
    cert = verify_equivalent(graph, build_spec(spec_name, dims, dtype, eps=eps))
    if cert.verdict != "equivalent":
        raise AssertionError(f"hand-written {spec_name}{dims} is not equivalent to its spec: {cert.verdict}")
    cache.put(CacheEntry.create(CacheKey(spec_name, dims, dtype, options={"eps": eps}), graph, certificate=cert))


def fill_cache(cache_dir: Path, shapes: Iterable[tuple[str, int, int]], buckets: Sequence[int] = BUCKETS,
               dtype: str = "float32", eps: float = EPS) -> Path:
    """Entries for every (spec, hidden, out) in ``shapes`` at every batch bucket."""
    cache = KernelCache(cache_dir, readonly_dirs=())
    for spec_name, hidden, out in shapes:
        for b in buckets:
            put_verified(cache, spec_name, {"batch": b, "hidden": hidden, "out": out}, dtype, eps)
    return cache_dir


# what the tiny Llama's sites look up inside vLLM: layer 0's input norm has no residual yet
TINY_LLAMA_SHAPES = (("rmsnorm_linear", HIDDEN, QKV_OUT), ("add_rmsnorm_linear", HIDDEN, QKV_OUT),
                     ("add_rmsnorm_linear", HIDDEN, GATE_UP_OUT))


if __name__ == "__main__":
    save_tiny_llama(Path(sys.argv[1]))
    fill_cache(Path(sys.argv[2]), TINY_LLAMA_SHAPES)
