"""The entries shipped in ``kernel_cache/entries/``: none is corrupt, they cover every bundled
model config at the default buckets (except buckets too large to verify on the machine that
built them), and their certificates hold when the smallest of them are verified again here."""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mirage_serve import cmd_build_cache  # noqa: E402
from mirage_serve.cache import KernelCache, shipped_cache_dir  # noqa: E402
from mirage_serve.model_ids import bundled_model_ids, resolve_config  # noqa: E402
from mirage_serve.models import adapter_for_config  # noqa: E402
from mirage_serve.models.base import DEFAULT_KV_LEN_BUCKETS  # noqa: E402
from mirage_serve.verify.rows import row_split  # noqa: E402

# the memory of the machine the shipped entries were built on (2 cores, 24 GiB): buckets whose
# verification needs more were verified on fewer rows there when row-separable, else not shipped
BUILD_MACHINE_BYTES = 21 * 2**30


def _shipped() -> KernelCache:
    d = shipped_cache_dir()
    assert d is not None
    return KernelCache(d / "no-user-cache-here", readonly_dirs=(d,))


def _usable_or_skip(cache: KernelCache) -> list:
    items = [i for i in cache.scan() if i.location == "package"]
    if not items:
        pytest.skip("no entries are shipped in kernel_cache/entries/")
    ok = [i for i in items if i.state == "ok"]
    if not ok:
        pytest.skip(f"the shipped entries were built for other versions than installed here ({items[0].reason})")
    return ok


def test_no_shipped_entry_is_corrupt():
    items = [i for i in _shipped().scan() if i.location == "package"]
    bad = [(i.path.name, i.reason) for i in items if i.state not in ("ok", "stale")]
    assert not bad, bad
    assert all(i.entry is None or i.entry.key.gpu_arch == "unprofiled" or i.entry.profiled for i in items)


def test_no_shipped_attention_drops_the_max_guard():
    from mirage_serve.search.rewrite import numerically_safe
    from mirage_serve.specs import build_spec

    for item in _usable_or_skip(_shipped()):
        k = item.entry.key
        assert numerically_safe(item.entry.graph, build_spec(k.spec, k.dims_dict, k.dtype, **k.options_dict)), item.path.name


@pytest.mark.parametrize("model_id", bundled_model_ids())
def test_shipped_entries_cover_every_bundled_config(model_id):
    cache = _shipped()
    _usable_or_skip(cache)
    config, _ = resolve_config(model_id)
    plan = adapter_for_config(config).plan(config, [1, 2, 4, 8, 16, 32, 64], kv_lens=list(DEFAULT_KV_LEN_BUCKETS))
    missing = []
    for item in cmd_build_cache.dedupe(plan.subgraphs):
        key = cmd_build_cache.make_key(item.subgraph, "unprofiled")
        spec = item.subgraph.build_spec()
        # a bucket too large to evaluate there is verified on fewer rows when it is row-separable (decode attention)
        if cache.get(key) is None and (cmd_build_cache.verify_memory_bytes(spec) <= BUILD_MACHINE_BYTES or row_split(spec) is not None):
            missing.append(f"{item.describe()} {item.bucket}")
    assert not missing, f"{model_id}: {len(missing)} kernels not shipped: {missing[:5]}"


def test_the_smallest_shipped_entries_verify_again():
    cache = _shipped()
    ok = _usable_or_skip(cache)

    def size(item):
        spec = item.entry.key
        from mirage_serve.specs import build_spec

        g = build_spec(spec.spec, spec.dims_dict, spec.dtype, **spec.options_dict)
        return sum(math.prod(g.info[t].shape) for t in g.input_ids)

    smallest = {}
    for item in sorted(ok, key=size):
        smallest.setdefault(item.entry.key.spec, item)  # the smallest entry of each spec
    for item in smallest.values():
        result = cache.verify(item.entry.key, trials=2, seed=11, float_check=True)
        assert result.status == "equivalent", (item.path.name, result.reason)
