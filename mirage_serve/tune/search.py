"""Pick codegen parameters for μGraph candidates by profiling on the GPU.

:func:`tune` takes candidate μGraphs (schedules: grids, loop ranges, kernel
splits) and searches codegen parameters for them in two rounds:

1. every graph with each of :func:`mirage_serve.tune.space.initial_params`;
2. for the ``top`` fastest graphs, every neighbour of their best parameters
   (:func:`mirage_serve.tune.space.neighbours`), then the merge of the
   neighbours that helped.

Every point is float-checked against the spec before it is timed
(:func:`mirage_serve.tune.profile.profile_candidate`); a point whose kernels
spill registers is timed only when no spill-free point has passed. Triton compiles
each point once, in a pool of worker processes on the same GPU (:class:`Precompiler`),
before the round is timed in this process, so compilation never overlaps a measurement.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mirage_serve.mugraph.graph import KernelGraph
from mirage_serve.tune import space

log = logging.getLogger(__name__)


@dataclass
class Candidate:
    """A μGraph to tune, named, with the dims that may vary at run time (see ``compile_graph``)."""

    name: str
    graph: KernelGraph
    schedule: str = ""
    variable_dims: tuple[tuple[int, int], ...] = ()


@dataclass
class Trial:
    """One (candidate, params) point and what profiling it gave."""

    candidate: Candidate
    params: dict[str, Any]
    round: int
    result: dict[str, Any] = field(default_factory=dict)  # ProfileResult.to_dict(), or {"error": ...}
    compile: dict[str, Any] = field(default_factory=dict)  # from the precompiler: seconds, registers, spills, error

    @property
    def time_us(self) -> float:
        t = self.result.get("median_us")
        return t if self.result.get("passed") and t is not None else math.inf

    @property
    def label(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.candidate.name} [{extra}]" if extra else self.candidate.name


# ---------------------------------------------------------------- parallel compilation


def _worker_init() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "0")


def _compile_one(graph_json: str, params: dict[str, Any], variable_dims: tuple, device: str) -> dict[str, Any]:
    """In a worker: generate, compile (filling Triton's on-disk cache) and run once on random inputs."""
    import torch

    from mirage_serve.codegen import compile_graph
    from mirage_serve.mugraph.serialize import from_json
    from mirage_serve.tune.profile import make_params, random_device_inputs

    t0 = time.perf_counter()
    try:
        graph = from_json(graph_json)
        cg = compile_graph(graph, make_params(params), variable_dims)
        gen = torch.Generator(device=device).manual_seed(0)
        ins = random_device_inputs(graph, device, gen)
        cg(*ins)
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()
        stats = cg.kernel_stats()
        del ins, cg
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
        return {"ok": True, "compile_s": round(time.perf_counter() - t0, 2), "kernels": stats,
                "spills": sum(s.get("spills") or 0 for s in stats)}
    except Exception as e:  # reported to the tuner, which skips the point
        return {"ok": False, "compile_s": round(time.perf_counter() - t0, 2), "error": f"{type(e).__name__}: {str(e)[:400]}"}


class Precompiler:
    """A pool of worker processes that compile candidates in parallel on one GPU."""

    def __init__(self, workers: int, device: str = "cuda") -> None:
        self.workers = max(1, workers)
        self.device = device
        self._pool: ProcessPoolExecutor | None = None

    def _get(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"), initializer=_worker_init)
        return self._pool

    def compile(self, trials: Sequence[Trial]) -> None:
        """Fill each trial's ``compile`` field; returns when all are done."""
        from mirage_serve.mugraph.serialize import to_json

        if not trials:
            return
        if self.workers <= 1:
            for t in trials:
                t.compile = _compile_one(to_json(t.candidate.graph), t.params, t.candidate.variable_dims, self.device)
            return
        pool = self._get()
        futs = [pool.submit(_compile_one, to_json(t.candidate.graph), t.params, t.candidate.variable_dims, self.device) for t in trials]
        for t, f in zip(trials, futs, strict=True):
            try:
                t.compile = f.result()
            except Exception as e:  # a worker that died (e.g. an illegal access) loses its point only
                t.compile = {"ok": False, "error": f"worker failed: {type(e).__name__}: {str(e)[:300]}"}
                self.close()
                pool = self._get()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


# ---------------------------------------------------------------- the search


@dataclass
class TuneResult:
    trials: list[Trial]

    def ranked(self) -> list[Trial]:
        return sorted(self.trials, key=lambda t: t.time_us)

    @property
    def best(self) -> Trial | None:
        r = self.ranked()
        return r[0] if r and math.isfinite(r[0].time_us) else None


def first_round(candidates: Sequence[Candidate]) -> list[Trial]:
    """Round 1: each candidate with each of its initial parameter sets."""
    return [Trial(c, p, 1) for c in candidates for p in space.initial_params(c.graph)]


def tune(
    candidates: Sequence[Candidate],
    spec: KernelGraph,
    *,
    device: str = "cuda",
    reps: int = 50,
    top: int = 2,
    precompiler: Precompiler | None = None,
    deadline: float | None = None,
    precompiled: Sequence[Trial] | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> TuneResult:
    """Search parameters for ``candidates`` (see the module docstring); fastest passing point first.

    ``precompiled``: round-1 trials whose compilation was already done (e.g. for many
    cases at once); ``deadline`` (``time.time()``) stops starting new measurements."""
    from mirage_serve.tune.profile import profile_candidate

    pre = precompiler or Precompiler(1, device)
    seen: set[tuple] = set()
    trials: list[Trial] = []

    def key(t: Trial) -> tuple:
        return (id(t.candidate), tuple(sorted(t.params.items())))

    def measure(t: Trial) -> None:
        if deadline is not None and time.time() > deadline:
            t.result = {"skipped": "time budget"}
        else:
            r = profile_candidate(t.candidate.graph, t.params, spec=spec, device=device, reps=reps,
                                  variable_dims=t.candidate.variable_dims)
            t.result = r.to_dict()
        if on_trial is not None:
            on_trial(t)

    def run(batch: list[Trial], compiled: bool = False) -> None:
        batch = [t for t in batch if key(t) not in seen]
        for t in batch:
            seen.add(key(t))
        if not compiled:
            pre.compile(batch)
        spilled = []
        for t in batch:
            trials.append(t)
            if not t.compile.get("ok", True):
                t.result = {"error": t.compile.get("error", "did not compile")}
                if on_trial is not None:
                    on_trial(t)
            elif t.compile.get("spills"):
                spilled.append(t)  # spilled code loses to spill-free code on these memory-bound kernels: timed only without one
            else:
                measure(t)
        for t in spilled:
            if any(math.isfinite(x.time_us) and not x.compile.get("spills") for x in trials):
                t.result = {"skipped": f"spills {t.compile['spills']} bytes of registers; a spill-free point passed"}
                if on_trial is not None:
                    on_trial(t)
            else:
                measure(t)

    run(list(precompiled) if precompiled is not None else first_round(candidates), compiled=precompiled is not None)
    best_per: dict[int, Trial] = {}
    for t in trials:
        b = best_per.get(id(t.candidate))
        if math.isfinite(t.time_us) and (b is None or t.time_us < b.time_us):
            best_per[id(t.candidate)] = t
    leaders = sorted(best_per.values(), key=lambda t: t.time_us)[:top]
    round2 = [Trial(b.candidate, q, 2) for b in leaders for q in space.neighbours(b.candidate.graph, b.params)]
    run(round2)
    merged = []
    for b in leaders:
        better = [t.params for t in trials if t.round == 2 and t.candidate is b.candidate and t.time_us < b.time_us]
        if len(better) > 1:
            merged.append(Trial(b.candidate, space.merge(b.params, better), 3))
    run(merged)
    return TuneResult(trials)
