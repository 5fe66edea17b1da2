"""The on-disk kernel cache: keys, entries, integrity checks, locking.

Entries are data, never code: a μGraph (canonical JSON), tuning parameters, the
verifier's certificate and timings, checked strictly on every read. See
:mod:`mirage_serve.cache.store` for the directory layout and lookup order.
"""

from mirage_serve.cache.entry import ENTRY_FORMAT, CacheEntry, CacheError, EntryRejected, check_graph_matches_key
from mirage_serve.cache.keys import (
    FALLBACK_CODEGEN_VERSION,
    GPU_ARCH_COMPAT,
    SCHEMA_VERSION,
    UNPROFILED,
    CacheKey,
    CacheKeyError,
    current_codegen_version,
    current_gpu_arch,
    current_triton_version,
    fallback_archs,
)
from mirage_serve.cache.store import (
    ENV_VAR,
    KernelCache,
    ScanItem,
    VerifyResult,
    default_cache_dir,
    load_entry_file,
    shipped_cache_dir,
)

__all__ = [
    "ENTRY_FORMAT",
    "ENV_VAR",
    "FALLBACK_CODEGEN_VERSION",
    "GPU_ARCH_COMPAT",
    "SCHEMA_VERSION",
    "UNPROFILED",
    "CacheEntry",
    "CacheError",
    "CacheKey",
    "CacheKeyError",
    "EntryRejected",
    "KernelCache",
    "ScanItem",
    "VerifyResult",
    "check_graph_matches_key",
    "current_codegen_version",
    "current_gpu_arch",
    "current_triton_version",
    "default_cache_dir",
    "fallback_archs",
    "load_entry_file",
    "shipped_cache_dir",
]
