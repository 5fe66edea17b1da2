"""Verified kernels from the cache, ready to call from a patched model.

A :class:`KernelProvider` turns (spec, dims, dtype, options, rows) into a
:class:`CachedKernel`: the cache entry for the smallest batch bucket that holds
``rows``, compiled by codegen on a GPU with the tuning parameters stored in the
entry (defaults for entries without any), or run by the reference executor
(CPU), or by the Triton interpreter when ``MIRAGE_SERVE_CPU_BACKEND=triton``.
Inputs with fewer rows than the bucket are padded (reference) or masked (Triton).

Specs with a variable extent (decode attention's KV length, :data:`VARIABLE_EXTENTS`)
are looked up by that extent's bucket too: the smallest cached ``kv_len`` bucket
at least the current length. One compiled kernel serves every length up to its
bucket (codegen masks the rest, ``variable_dims``); the reference executor runs
the spec built at the real length, so it stays exact.

Guards: with ``MIRAGE_SERVE_CHECK=1`` the first call of each kernel in a
process is compared with the spec run in float64 on the same inputs; a
mismatch, or any exception at run time, disables the kernel with a warning and
the caller falls back to the model's own code. Nothing read from the cache is
executed: the μGraph is data, and kernel source is regenerated from it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mirage_serve.mugraph import KernelGraph
from mirage_serve.reference import execute
from mirage_serve.specs import SPECS

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
_CHECK_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}
_logged: set[str] = set()
_lock = threading.Lock()


@dataclass(frozen=True)
class VariableExtent:
    """A spec dim that is bucketed like the batch and may be shorter at run time.

    ``dims`` are the (input position, dim) pairs that carry it (codegen's
    ``variable_dims``); only dims along which the spec is uniform qualify
    (softmax over a set of keys), so positions past the length change nothing.
    """

    name: str
    dims: tuple[tuple[int, int], ...]


#: attention_decode's Q [batch*kv_heads, group, d], K and V [batch*kv_heads, kv_len, d]: K and V vary in dim 1.
VARIABLE_EXTENTS: dict[str, VariableExtent] = {"attention_decode": VariableExtent("kv_len", ((1, 1), (2, 1)))}


def log_once(key: str, msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log a message once per process per ``key`` (misses, fallbacks, disabled kernels)."""
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.log(level, msg, *args)


def _check_enabled() -> bool:
    return os.environ.get("MIRAGE_SERVE_CHECK", "0") not in ("", "0", "false", "False")


@dataclass
class CachedKernel:
    """One verified cache entry, callable on live tensors (rows, and a variable extent, may be below the bucket).

    ``params`` are the entry's codegen parameters (``CodegenParams.cache_params()``
    form; empty: the defaults). ``extent`` names the spec dim that may be shorter
    than in the graph, ``dims``/``dtype``/``options`` rebuild the spec at the
    actual length (reference backend, spot check).
    """

    spec_name: str
    graph: KernelGraph
    spec: KernelGraph
    bucket: int
    entry_id: str
    backend: str
    disabled: str | None = None
    calls: int = 0
    params: dict[str, int | str] = field(default_factory=dict)
    extent: VariableExtent | None = None
    dims: dict[str, int] = field(default_factory=dict)
    dtype: str = "float32"
    options: dict[str, Any] = field(default_factory=dict)
    calls_by_length: dict[int, int] = field(default_factory=dict)
    _compiled: Any = field(default=None, repr=False)
    _checked: bool = False
    _specs: dict[int, KernelGraph] = field(default_factory=dict, repr=False)

    def __call__(self, inputs: Sequence[torch.Tensor], lengths: torch.Tensor | None = None) -> list[torch.Tensor] | None:
        """Run the kernel; ``None`` means "use your own code" (disabled or failed).

        ``lengths`` (variable-extent kernels only): a one-element int32 tensor on the
        inputs' device, the valid prefix of the extent (the rest of K/V is ignored),
        so a captured CUDA graph can serve a KV cache that grows in place."""
        if self.disabled:
            return None
        inputs = list(inputs)
        try:
            outs = self._run(inputs, lengths) if lengths is not None else self._run(inputs)
        except Exception as e:  # a kernel must never crash a generation: fall back, disable, warn
            self.disable(f"failed at run time: {type(e).__name__}: {e}")
            return None
        if not self._checked and _check_enabled():
            self._checked = True
            if not self._spot_check(inputs, outs, lengths):
                return None
        self.calls += 1
        if self.extent is not None and lengths is None:
            n = self.length_of(inputs)
            self.calls_by_length[n] = self.calls_by_length.get(n, 0) + 1
        return outs

    def disable(self, reason: str) -> None:
        self.disabled = reason
        log_once(f"disabled:{self.entry_id}", "mirage-serve: kernel %s (%s) disabled, falling back to the model's code: %s",
                 self.entry_id, self.spec_name, reason, level=logging.WARNING)

    @property
    def extent_bucket(self) -> int | None:
        """The largest length of the variable extent (its size in the graph), or None."""
        return None if self.extent is None else self.dims[self.extent.name]

    def length_of(self, inputs: Sequence[torch.Tensor]) -> int:
        """The variable extent's length in these inputs (the first dim that carries it)."""
        pos, d = self.extent.dims[0]
        return int(inputs[pos].shape[d])

    def codegen_params(self) -> Any:
        """The entry's ``CodegenParams`` (None: the defaults)."""
        if not self.params:
            return None
        from mirage_serve.codegen import CodegenParams

        return CodegenParams.from_dict(dict(self.params))

    def _padded(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Inputs padded with zero rows up to the bucket's shapes (dim 0 of the row inputs)."""
        full = self.spec.info[self.spec.input_ids[0]].shape[0]
        rows = set(SPECS[self.spec_name].row_inputs)
        return [_pad_rows(x, full) if i in rows else x for i, x in enumerate(inputs)]

    def _spec_at(self, length: int) -> KernelGraph:
        """The spec with the variable extent at ``length`` (the bucket's own spec at the bucket)."""
        if length == self.extent_bucket:
            return self.spec
        spec = self._specs.get(length)
        if spec is None:
            from mirage_serve.specs import build_spec

            if len(self._specs) >= 64:
                self._specs.clear()
            spec = self._specs[length] = build_spec(self.spec_name, {**self.dims, self.extent.name: length}, self.dtype, **self.options)
        return spec

    def _exact_problem(self, inputs: list[torch.Tensor], lengths: torch.Tensor | None) -> tuple[KernelGraph, list[torch.Tensor], bool]:
        """(graph, inputs padded to its rows, whether it is the cached μGraph) computing this call on the reference.

        At the bucket's extent that is the cached μGraph; at a shorter length (or a
        valid prefix given by ``lengths``) the spec built at that length, on the
        inputs cut to it: exact, where padding a softmax's keys would not be."""
        if self.extent is None:
            return self.graph, self._padded(inputs), True
        n = self.length_of(inputs)
        if lengths is not None:
            n = max(1, min(n, int(lengths.reshape(-1)[0])))
            carriers = dict(self.extent.dims)  # input position -> dim
            inputs = [x.narrow(carriers[i], 0, n) if i in carriers else x for i, x in enumerate(inputs)]
        if n == self.extent_bucket:
            return self.graph, self._padded(inputs), True
        return self._spec_at(n), self._padded(inputs), False

    def _run(self, inputs: list[torch.Tensor], lengths: torch.Tensor | None = None) -> list[torch.Tensor]:
        rows = inputs[0].shape[0]
        if self.backend == "reference":
            graph, padded, _ = self._exact_problem(inputs, lengths)
            outs = execute(graph, padded, dtype=torch.float32 if inputs[0].dtype != torch.float64 else torch.float64)
            return [o[:rows].to(inputs[0].dtype) for o in outs]
        if self._compiled is None:
            from mirage_serve.codegen import compile_graph

            self._compiled = compile_graph(self.graph, self.codegen_params(), self.extent.dims if self.extent else ())
        if not self._compiled.variable_batch and rows != self._compiled.bucket:  # rows not independent: run the bucket
            outs = self._compiled(*self._padded(inputs), **({"lengths": lengths} if lengths is not None else {}))
            return [o[:rows] for o in outs]
        return list(self._compiled(*inputs, **({"lengths": lengths} if lengths is not None else {})))

    def _spot_check(self, inputs: list[torch.Tensor], outs: list[torch.Tensor], lengths: torch.Tensor | None = None) -> bool:
        rows = inputs[0].shape[0]
        graph, padded, cached = self._exact_problem([x.detach().cpu() for x in inputs], None if lengths is None else lengths.cpu())
        spec = self.spec if cached else graph  # against the spec, never the μGraph under test
        want = [w[:rows] for w in execute(spec, padded, dtype=torch.float64)]
        tol = _CHECK_TOL.get(inputs[0].dtype, 1e-4)
        for o, w in zip(outs, want, strict=True):
            o = o.detach().cpu().double()
            # NaN/Inf from NaN/Inf inputs must sit where the reference has them; the rest is compared by norm
            inf = torch.isinf(w)
            if not (torch.equal(torch.isnan(o), torch.isnan(w)) and torch.equal(torch.isinf(o), inf) and torch.equal(o[inf], w[inf])):
                self.disable("spot check against the float64 spec failed (NaN/Inf where the spec has none, or the reverse)")
                return False
            fin = torch.isfinite(w)
            err = float((o[fin] - w[fin]).norm() / w[fin].norm().clamp_min(1e-30))
            if not err <= tol:
                self.disable(f"spot check against the float64 spec failed (relative error {err:.3g} > {tol:g})")
                return False
        return True


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad], 0)


def _default_kv_buckets() -> tuple[int, ...]:
    from mirage_serve.models.base import DEFAULT_KV_LEN_BUCKETS

    return tuple(DEFAULT_KV_LEN_BUCKETS)


class KernelProvider:
    """Looks kernels up in a :class:`mirage_serve.cache.KernelCache`, memoised per shape.

    ``buckets`` are the batch buckets tried, ``kv_buckets`` the buckets of a variable
    extent (decode attention's ``kv_len``). :func:`~mirage_serve.integrations.hf.patch_model`
    adds a model's own, capped at its context as ``build-cache`` caps them; with none
    given or added, the adapters' ``DEFAULT_KV_LEN_BUCKETS``.
    """

    #: Requests remembered before the memo starts over (a decode step asks for a new kv_len).
    MAX_MEMO = 1 << 16

    def __init__(self, cache: Any = None, *, buckets: Sequence[int] = DEFAULT_BUCKETS, kv_buckets: Iterable[int] | None = None,
                 device: torch.device | str | None = None) -> None:
        from mirage_serve.cache import KernelCache

        if cache is None or isinstance(cache, str | os.PathLike):
            cache = KernelCache(cache)
        self.cache = cache
        self.buckets = tuple(sorted(set(buckets)))
        self._memo: dict[tuple, CachedKernel | None] = {}
        self.kv_buckets: tuple[int, ...] = ()  # empty: build-cache's defaults
        self.add_kv_buckets(kv_buckets or ())
        self._loaded: dict[tuple, tuple[CachedKernel | None, str | None]] = {}
        self._misses: dict[str, str] = {}
        self.device = device

    def add_kv_buckets(self, buckets: Iterable[int]) -> None:
        """Also probe these buckets of variable extents (e.g. a model's kv_len buckets)."""
        self.kv_buckets = tuple(sorted({*self.kv_buckets, *(int(b) for b in buckets)}))
        self._memo.clear()

    def backend_for(self, device: torch.device) -> str:
        if device.type == "cuda":
            return "triton"
        return "triton" if os.environ.get("MIRAGE_SERVE_CPU_BACKEND") == "triton" else "reference"

    def kernels(self) -> list[CachedKernel]:
        """Every kernel loaded so far (each cache entry once)."""
        return [k for k, _ in self._loaded.values() if k is not None]

    def get(self, spec_name: str, dims: dict[str, int], dtype: str, options: dict[str, Any], rows: int, device: torch.device) -> CachedKernel | None:
        """The kernel for ``rows`` rows (batch dim ``dims['batch']`` is chosen here), or None (logged once).

        For a spec with a variable extent, ``dims`` holds its current length
        (``kv_len``): the kernel is the one of the smallest cached bucket >= it."""
        key = (spec_name, tuple(sorted(dims.items())), dtype, tuple(sorted(options.items())), rows, device.type)
        if key in self._memo:
            return self._memo[key]
        kernel = self._find(spec_name, dims, dtype, options, rows, device)
        if len(self._memo) >= self.MAX_MEMO:
            self._memo.clear()
        self._memo[key] = kernel
        return kernel

    def _find(self, spec_name, dims, dtype, options, rows, device) -> CachedKernel | None:
        from mirage_serve.cache import current_gpu_arch

        arch = current_gpu_arch() if device.type == "cuda" else "unprofiled"
        extent = VARIABLE_EXTENTS.get(spec_name)
        fixed = {k: v for k, v in dims.items() if extent is None or k != extent.name}
        what = f"{spec_name}({','.join(f'{k}={v}' for k, v in sorted(fixed.items()))}, {dtype})"
        candidates = [b for b in self.buckets if b >= rows]
        if not candidates:
            self.miss(what, f"{rows} rows exceed the largest batch bucket {self.buckets[-1]}")
            return None
        lengths: list[int | None] = [None]
        kv_buckets = self.kv_buckets or _default_kv_buckets()
        if extent is not None:
            lengths = [b for b in kv_buckets if b >= dims[extent.name]]
            if not lengths:
                self.miss(what, f"{extent.name} beyond the largest {extent.name} bucket {kv_buckets[-1]}")
                return None
        for bucket in candidates:
            for length in lengths:
                full = {**fixed, "batch": bucket, **({} if length is None else {extent.name: length})}
                kernel, why = self._load(spec_name, full, dtype, options, device, arch, extent)
                if why:
                    self.miss(what, why)
                    return None
                if kernel is not None:
                    return kernel
        also = f" and a {extent.name} bucket >= the length (buckets {list(kv_buckets)})" if extent else ""
        self.miss(what, f"no cache entry for a batch bucket >= {rows}{also} (run `mirage-serve build-cache` for this model)")
        return None

    def _load(self, spec_name, full, dtype, options, device, arch, extent) -> tuple[CachedKernel | None, str | None]:
        """The kernel of the entry for exactly these dims (memoised), or (None, None) if there is none,
        or (None, why) when the entry exists but cannot be used here."""
        key = (spec_name, tuple(sorted(full.items())), dtype, tuple(sorted(options.items())), device.type)
        if key not in self._loaded:
            self._loaded[key] = self._load_entry(spec_name, full, dtype, options, device, arch, extent)
        return self._loaded[key]

    def _load_entry(self, spec_name, full, dtype, options, device, arch, extent) -> tuple[CachedKernel | None, str | None]:
        from mirage_serve.cache import CacheKey
        from mirage_serve.specs import build_spec

        entry = self.cache.lookup(CacheKey(spec_name, full, dtype, gpu_arch=arch, options=options))
        if entry is None:
            return None, None
        spec = build_spec(spec_name, full, dtype, **options)
        backend = self.backend_for(device)
        params = dict(entry.params)
        if backend == "triton":
            try:
                from mirage_serve.codegen import CodegenError, CodegenParams, supports
            except ImportError:
                return None, "this build has no Triton code generator"
            try:
                codegen_params = CodegenParams.from_dict(params) if params else None
            except (CodegenError, TypeError, ValueError) as e:  # parameters never change the result: the defaults are safe
                log_once(f"params:{entry.key.entry_id}", "mirage-serve: entry %s has codegen parameters %s this build cannot use (%s); "
                         "compiling it with the defaults (re-tune it with `mirage-serve build-cache`)", entry.key.entry_id, params, e,
                         level=logging.WARNING)
                params, codegen_params = {}, None
            ok, why = supports(entry.graph, codegen_params, extent.dims if extent else ())
            if not ok:
                return None, f"codegen does not support entry {entry.key.entry_id}: {why}"
        kernel = CachedKernel(spec_name, entry.graph, spec, full["batch"], entry.key.entry_id, backend, params=params, extent=extent,
                              dims=dict(full), dtype=dtype, options=dict(options))
        return kernel, None

    def miss(self, what: str, reason: str) -> None:
        self._misses[what] = reason
        log_once(f"miss:{what}:{reason}", "mirage-serve: %s runs the original code: %s", what, reason)

    @property
    def misses(self) -> dict[str, str]:
        """Every shape that fell back to the original code, with the reason."""
        return dict(self._misses)
