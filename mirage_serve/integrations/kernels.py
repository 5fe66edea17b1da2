"""Verified kernels from the cache, ready to call from a patched model.

A :class:`KernelProvider` turns (spec, dims, dtype, options, rows) into a
:class:`CachedKernel`: the cache entry for the smallest batch bucket that holds
``rows``, compiled by codegen on a GPU with the tuning parameters stored in the
entry (defaults for entries without any), or run by the reference executor (CPU),
or by the Triton interpreter when ``MIRAGE_SERVE_CPU_BACKEND=triton``. Inputs
with fewer rows than the bucket are padded (reference) or masked (Triton).

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
from collections.abc import Sequence
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
    """One verified cache entry, callable on live tensors (rows may be fewer than the bucket).

    ``params`` are the entry's codegen parameters (``CodegenParams.cache_params()``
    form; empty: the defaults)."""

    spec_name: str
    graph: KernelGraph
    spec: KernelGraph
    bucket: int
    entry_id: str
    backend: str
    disabled: str | None = None
    calls: int = 0
    params: dict[str, int | str] = field(default_factory=dict)
    _compiled: Any = field(default=None, repr=False)
    _checked: bool = False

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Run the kernel; ``None`` means "use your own code" (disabled or failed)."""
        if self.disabled:
            return None
        try:
            outs = self._run(list(inputs))
        except Exception as e:  # a kernel must never crash a generation: fall back, disable, warn
            self.disable(f"failed at run time: {type(e).__name__}: {e}")
            return None
        if not self._checked and _check_enabled():
            self._checked = True
            if not self._spot_check(list(inputs), outs):
                return None
        self.calls += 1
        return outs

    def disable(self, reason: str) -> None:
        self.disabled = reason
        log_once(f"disabled:{self.entry_id}", "mirage-serve: kernel %s (%s) disabled, falling back to the model's code: %s",
                 self.entry_id, self.spec_name, reason, level=logging.WARNING)

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

    def _run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        rows = inputs[0].shape[0]
        if self.backend == "reference":
            padded = self._padded(inputs)
            outs = execute(self.graph, padded, dtype=torch.float32 if inputs[0].dtype != torch.float64 else torch.float64)
            return [o[:rows].to(inputs[0].dtype) for o in outs]
        if self._compiled is None:
            from mirage_serve.codegen import compile_graph

            self._compiled = compile_graph(self.graph, self.codegen_params())
        return list(self._compiled(*inputs))

    def _spot_check(self, inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> bool:
        rows = inputs[0].shape[0]
        want = [w[:rows] for w in execute(self.spec, [p.detach().cpu() for p in self._padded(inputs)], dtype=torch.float64)]
        tol = _CHECK_TOL.get(inputs[0].dtype, 1e-4)
        for o, w in zip(outs, want, strict=True):
            err = float((o.detach().cpu().double() - w).norm() / w.norm().clamp_min(1e-30))
            if not err <= tol:
                self.disable(f"spot check against the float64 spec failed (relative error {err:.3g} > {tol:g})")
                return False
        return True


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad], 0)


class KernelProvider:
    """Looks kernels up in a :class:`mirage_serve.cache.KernelCache`, memoised per shape."""

    def __init__(self, cache: Any = None, *, buckets: Sequence[int] = DEFAULT_BUCKETS, device: torch.device | str | None = None) -> None:
        from mirage_serve.cache import KernelCache

        if cache is None or isinstance(cache, str | os.PathLike):
            cache = KernelCache(cache)
        self.cache = cache
        self.buckets = tuple(sorted(set(buckets)))
        self._memo: dict[tuple, CachedKernel | None] = {}
        self._misses: dict[str, str] = {}
        self.device = device

    def backend_for(self, device: torch.device) -> str:
        if device.type == "cuda":
            return "triton"
        return "triton" if os.environ.get("MIRAGE_SERVE_CPU_BACKEND") == "triton" else "reference"

    def get(self, spec_name: str, dims: dict[str, int], dtype: str, options: dict[str, Any], rows: int, device: torch.device) -> CachedKernel | None:
        """The kernel for ``rows`` rows (batch dim ``dims['batch']`` is chosen here), or None (logged once)."""
        key = (spec_name, tuple(sorted(dims.items())), dtype, tuple(sorted(options.items())), rows, device.type)
        if key in self._memo:
            return self._memo[key]
        kernel = self._find(spec_name, dims, dtype, options, rows, device)
        self._memo[key] = kernel
        return kernel

    def _find(self, spec_name, dims, dtype, options, rows, device) -> CachedKernel | None:
        from mirage_serve.cache import CacheKey, current_gpu_arch
        from mirage_serve.specs import build_spec

        arch = current_gpu_arch() if device.type == "cuda" else "unprofiled"
        what = f"{spec_name}({','.join(f'{k}={v}' for k, v in sorted(dims.items()))}, {dtype})"
        candidates = [b for b in self.buckets if b >= rows]
        if not candidates:
            self.miss(what, f"{rows} rows exceed the largest batch bucket {self.buckets[-1]}")
            return None
        for bucket in candidates:
            full = {**dims, "batch": bucket}
            entry = self.cache.lookup(CacheKey(spec_name, full, dtype, gpu_arch=arch, options=options))
            if entry is None:
                continue
            spec = build_spec(spec_name, full, dtype, **options)
            backend = self.backend_for(device)
            params = dict(entry.params)
            if backend == "triton":
                try:
                    from mirage_serve.codegen import CodegenError, CodegenParams, supports
                except ImportError:
                    self.miss(what, "this build has no Triton code generator")
                    return None
                try:
                    codegen_params = CodegenParams.from_dict(params) if params else None
                except (CodegenError, TypeError, ValueError) as e:  # parameters never change the result: the defaults are safe
                    log_once(f"params:{entry.key.entry_id}", "mirage-serve: entry %s has codegen parameters %s this build cannot use (%s); "
                             "compiling it with the defaults (re-tune it with `mirage-serve build-cache`)", entry.key.entry_id, params, e,
                             level=logging.WARNING)
                    params, codegen_params = {}, None
                ok, why = supports(entry.graph, codegen_params)
                if not ok:
                    self.miss(what, f"codegen does not support entry {entry.key.entry_id}: {why}")
                    return None
            return CachedKernel(spec_name, entry.graph, spec, bucket, entry.key.entry_id, backend, params=params)
        self.miss(what, f"no cache entry for a batch bucket >= {rows} (run `mirage-serve build-cache` for this model)")
        return None

    def miss(self, what: str, reason: str) -> None:
        self._misses[what] = reason
        log_once(f"miss:{what}:{reason}", "mirage-serve: %s runs the original code: %s", what, reason)

    @property
    def misses(self) -> dict[str, str]:
        """Every shape that fell back to the original code, with the reason."""
        return dict(self._misses)
