"""Verified cache entries for the shapes the tiny models meet (hand-written fused μGraphs)."""

from __future__ import annotations

from collections.abc import Iterable

from handwritten import fused_lora, fused_rmsnorm_linear, split_kv_attention

from mirage_serve.cache import CacheEntry, CacheKey, KernelCache
from mirage_serve.models import get_adapter
from mirage_serve.specs import build_spec
from mirage_serve.verify import verify_equivalent

BUCKETS = (1, 2, 4, 8, 16)


def put_verified(cache: KernelCache, spec_name: str, dims: dict, graph, options: dict | None = None, params: dict | None = None) -> CacheEntry:
    """Verify ``graph`` against its spec and store it (with codegen ``params``, if any)."""
    options = options or {}
    spec = build_spec(spec_name, dims, graph.info[graph.input_ids[0]].dtype, **options)
    cert = verify_equivalent(graph, spec, trials=2, seed=0)
    assert cert.verdict == "equivalent", cert.reason
    entry = CacheEntry.create(CacheKey(spec_name, dims, spec.info[spec.input_ids[0]].dtype, options=options), graph, certificate=cert,
                              params=params)
    cache.put(entry)
    return entry


def fill_cache(cache: KernelCache, model, dtype: str = "float32", *, norms: bool = True, kv_lens: Iterable[int] | None = None,
               attention_batches: Iterable[int] = (2,), lora=None) -> list[int]:
    """Entries for every norm→linear shape of the tiny model and decode attention at its kv_len buckets
    (``kv_lens`` as ``build-cache --kv-lens``, capped at the context by the adapter; default build-cache's),
    and with ``lora`` (a peft LoraConfig or adapter directory, as ``build-cache --lora-config``) every
    LoRA-augmented projection. Returns the kv_len buckets filled."""
    adapter = get_adapter(model.config.model_type)
    plan = adapter.plan(model.config, BUCKETS, dtype=dtype, lora=lora, **({} if kv_lens is None else {"kv_lens": tuple(kv_lens)}))
    done = set()
    for sg in plan.subgraphs:
        if sg.spec_name == "lora_linear" and sg.signature() not in done:
            done.add(sg.signature())
            d = sg.dims
            g = fused_lora(d["batch"], d["in"], d["out"], d["rank"], n_blocks=2, loop=4, scale=sg.options["scale"], dtype=dtype)
            put_verified(cache, "lora_linear", d, g, sg.options)
            continue
        if not norms or sg.spec_name != "rmsnorm_linear" or sg.signature() in done:
            continue
        done.add(sg.signature())
        d = sg.dims
        g = fused_rmsnorm_linear(d["batch"], d["hidden"], d["out"], n_blocks=2, loop=4, eps=sg.options["eps"], dtype=dtype)
        put_verified(cache, "rmsnorm_linear", d, g, sg.options)
    arch = plan.arch
    for b in attention_batches:
        for kv_len in plan.kv_len_buckets:
            dims = {"batch": b, "q_heads": arch.q_heads, "kv_heads": arch.kv_heads, "head_dim": arch.head_dim, "kv_len": kv_len}
            put_verified(cache, "attention_decode", dims, split_kv_attention(**dims, splits=2, loop=2, dtype=dtype))
    return plan.kv_len_buckets
