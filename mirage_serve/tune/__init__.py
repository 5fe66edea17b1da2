"""Rank μGraph candidates: GPU profiling when a GPU is there, the analytical cost model otherwise."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mirage_serve.mugraph.graph import KernelGraph
from mirage_serve.tune.cost_model import GPU_MODELS, H200, CostEstimate, GPUModel, estimate, floor_bytes

log = logging.getLogger(__name__)

__all__ = ["GPU_MODELS", "H200", "CostEstimate", "GPUModel", "Ranked", "estimate", "floor_bytes", "rank_candidates"]


@dataclass
class Ranked:
    """One (μGraph, params) candidate with its time: measured (``profiled``) or estimated."""

    graph: KernelGraph
    params: Any
    time_us: float
    profiled: bool
    passed: bool = True  # float check (always True for unprofiled estimates, which check nothing)
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from mirage_serve.mugraph.serialize import content_hash

        p = self.params
        if p is not None and not isinstance(p, dict):
            p = dict(vars(p)) if hasattr(p, "__dict__") else repr(p)
        return {
            "graph_hash": content_hash(self.graph),
            "params": p,
            "time_us": self.time_us if math.isfinite(self.time_us) else None,
            "profiled": self.profiled,
            "passed": self.passed,
            "details": self.details,
        }


def _want_gpu(device: Any) -> bool:
    if device is None:
        try:
            import torch

            return torch.cuda.is_available()
        except ImportError:
            return False
    return str(device).startswith("cuda")


def rank_candidates(
    graphs: Sequence[KernelGraph],
    params_grid: Sequence[Any] | None = None,
    device: Any = None,
    *,
    spec: KernelGraph | None = None,
    gpu_model: GPUModel = H200,
    reps: int = 50,
) -> list[Ranked]:
    """Rank every graph under every params in ``params_grid``, fastest first.

    ``device``: None picks the GPU when torch sees one and the cost model
    otherwise; ``"cpu"`` forces the model; ``"cuda[:i]"`` forces profiling.
    Profiled candidates are float-checked against ``spec`` (or themselves) and
    those that fail sort last with ``passed=False``."""
    grid = list(params_grid) if params_grid else [None]
    out: list[Ranked] = []
    if _want_gpu(device):
        from mirage_serve.tune.profile import profile_candidate

        dev = device or "cuda"
        for g in graphs:
            for p in grid:
                r = profile_candidate(g, p, spec=spec, device=dev, reps=reps)
                out.append(Ranked(g, p, r.median_us if r.passed else math.inf, True, r.passed, r.to_dict()))
    else:
        for g in graphs:
            for p in grid:
                e = estimate(g, p, gpu_model)
                out.append(Ranked(g, p, e.time_s * 1e6, False, True, {"model": gpu_model.name, **e.to_dict()}))
    out.sort(key=lambda r: (not r.passed, r.time_us))
    log.info("ranked %d candidates (%s)", len(out), "profiled" if out and out[0].profiled else "cost model")
    return out
