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


_CONTEXT_BROKEN = False  # in a worker: a point broke this process's CUDA context (e.g. an illegal access)


def _context_broken(device: str) -> bool:
    import torch

    if not str(device).startswith("cuda"):
        return False
    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # an illegal access poisons the context for good
        return True


def _compile_one(graph_json: str, params: dict[str, Any], variable_dims: tuple, device: str) -> dict[str, Any]:
    """In a worker: generate, compile (filling Triton's on-disk cache) and run once on random inputs.

    A point that breaks the worker's CUDA context reports its error; the worker then exits at its
    next point, so that point is not blamed (the pool is replaced and it is compiled again)."""
    global _CONTEXT_BROKEN
    import torch

    from mirage_serve.codegen import compile_graph
    from mirage_serve.mugraph.serialize import from_json
    from mirage_serve.tune.profile import make_params, random_device_inputs

    if _CONTEXT_BROKEN:
        os._exit(3)
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
        _CONTEXT_BROKEN = _context_broken(device)
        return {"ok": False, "compile_s": round(time.perf_counter() - t0, 2), "error": f"{type(e).__name__}: {str(e)[:400]}"}


def _measure_one(graph_json: str, params: dict[str, Any], variable_dims: tuple, spec_json: str | None, device: str, reps: int) -> dict[str, Any]:
    """In the measuring process: profile one point; exit the process if the CUDA context broke."""
    import torch

    from mirage_serve.mugraph.serialize import from_json
    from mirage_serve.tune.profile import profile_candidate

    r = profile_candidate(from_json(graph_json), params, spec=from_json(spec_json) if spec_json else None, device=device, reps=reps,
                          variable_dims=variable_dims).to_dict()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the process lives on for later points (and kernels): hold no memory between them
    except Exception:  # an illegal access poisons the context for good: give the process back
        os._exit(3)
    return r


def _shut_down(pool: ProcessPoolExecutor | None, kill: bool) -> None:
    """Shut ``pool`` down, cancelling what it has not started (``kill``: terminate its processes
    first, for work that may never return)."""
    if pool is not None:
        if kill:
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
        pool.shutdown(wait=True, cancel_futures=True)


class Measurer:
    """Profiles points in one separate process, so a kernel that breaks its CUDA context costs
    only that point: the process is replaced and the point recorded as crashing."""

    def __init__(self, device: str = "cuda", timeout_s: float | None = 300.0) -> None:
        self.device = device
        self.timeout_s = timeout_s  # a point still running after this long (a kernel that never ends) is killed
        self._pool: ProcessPoolExecutor | None = None

    def measure(self, trial: Trial, spec: KernelGraph | None, reps: int) -> dict[str, Any]:
        from concurrent.futures import TimeoutError as FutureTimeout

        from mirage_serve.mugraph.serialize import to_json

        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_worker_init)
        fut = self._pool.submit(_measure_one, to_json(trial.candidate.graph), trial.params, trial.candidate.variable_dims,
                                to_json(spec) if spec is not None else None, self.device, reps)
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            self.close(kill=True)
            return {"passed": False, "error": f"still running after {self.timeout_s:g} s; the measuring process was killed and the point is excluded"}
        except Exception as e:  # the process died: this point broke its CUDA context (or crashed it otherwise)
            self.close()
            return {"passed": False, "error": f"crashed the measuring process ({type(e).__name__}); the point is excluded"}

    def close(self, kill: bool = False) -> None:
        """Shut the measuring process down (``kill``: terminate it first, for a point that does not return)."""
        _shut_down(self._pool, kill)
        self._pool = None


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

    #: times a point is submitted again after the pool broke under it before it counts as failed
    RETRIES = 8

    def compile(self, trials: Sequence[Trial]) -> None:
        """Fill each trial's ``compile`` field; returns when all are done.

        When a worker dies (a point before broke its CUDA context, or it crashed), the pool is
        replaced and the points it took down are compiled again, up to :data:`RETRIES` times."""
        from mirage_serve.mugraph.serialize import to_json

        if not trials:
            return
        if self.workers <= 1:
            for t in trials:
                t.compile = _compile_one(to_json(t.candidate.graph), t.params, t.candidate.variable_dims, self.device)
            return
        pending, tries = list(trials), {id(t): 0 for t in trials}
        while pending:
            pool = self._get()
            futs = [(t, pool.submit(_compile_one, to_json(t.candidate.graph), t.params, t.candidate.variable_dims, self.device)) for t in pending]
            pending, broken = [], False
            for t, f in futs:
                try:
                    t.compile = f.result()
                except Exception as e:  # the pool broke: this point is compiled again in a new one
                    broken = True
                    tries[id(t)] += 1
                    if tries[id(t)] > self.RETRIES:
                        t.compile = {"ok": False, "error": f"worker failed {tries[id(t)]} times: {type(e).__name__}: {str(e)[:300]}"}
                    else:
                        pending.append(t)
            if broken:
                log.info("compile pool broke; %d point(s) compiled again in a new pool", len(pending))
                self.close()

    def close(self, kill: bool = False) -> None:
        """Shut the workers down (``kill``: terminate them first, for a compile whose test launch does not return)."""
        _shut_down(self._pool, kill)
        self._pool = None


# ---------------------------------------------------------------- the search


def why_not_timed(t: Trial) -> str | None:
    """A short reason why a trial has no time (None when it has one), to count across a search."""
    if math.isfinite(t.time_us):
        return None
    r = t.result
    if "skipped" in r:
        return "skipped: spills registers" if str(r["skipped"]).startswith("spills") else f"skipped: {r['skipped']}"
    if not t.compile.get("ok", True):
        return "did not compile: " + str(t.compile.get("error", "?")).split(":", 1)[0][:60]
    err = r.get("error")
    if err:
        return "measuring: " + str(err).split("(", 1)[0].split(";", 1)[0].split(":", 1)[0].strip()[:60]
    return "failed its float check" if r.get("passed") is False else "not measured"


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
    return [Trial(c, p, 1) for c in candidates for p in space.initial_params(c.graph, c.variable_dims)]


class Tuner:
    """The search for one spec's candidates, round by round (see the module docstring).

    :meth:`propose` gives the next round's trials (empty when the search is done);
    compile them (:meth:`Precompiler.compile`, possibly together with other tuners'
    trials), then :meth:`measure` them. Separating the two lets a caller compile the
    rounds of many specs in one parallel batch."""

    def __init__(self, candidates: Sequence[Candidate], spec: KernelGraph | None, *, device: str = "cuda", reps: int = 50,
                 top: int = 2, deadline: float | None = None, on_trial: Callable[[Trial], None] | None = None,
                 measurer: Measurer | None = None) -> None:
        self.candidates = list(candidates)
        self.measurer = measurer
        self.spec, self.device, self.reps, self.top, self.deadline, self.on_trial = spec, device, reps, top, deadline, on_trial
        self.trials: list[Trial] = []
        self.round = 0
        self._seen: set[tuple] = set()
        self._leaders: list[Trial] = []

    def _new(self, trials: list[Trial]) -> list[Trial]:
        out = []
        for t in trials:
            k = (id(t.candidate), tuple(sorted(t.params.items())))
            if k not in self._seen:
                self._seen.add(k)
                out.append(t)
        return out

    def propose(self) -> list[Trial]:
        """The next round's trials: 1 = initial params of every candidate; 2 = neighbours of the
        ``top`` best candidates' best points; 3 = merges of the neighbours that helped. Past the
        deadline no round after the first is proposed."""
        self.round += 1
        if self.round > 1 and self._past_deadline():
            return []
        if self.round == 1:
            return self._new(first_round(self.candidates))
        if self.round == 2:
            best_per: dict[int, Trial] = {}
            for t in self.trials:
                b = best_per.get(id(t.candidate))
                if math.isfinite(t.time_us) and (b is None or t.time_us < b.time_us):
                    best_per[id(t.candidate)] = t
            self._leaders = sorted(best_per.values(), key=lambda t: t.time_us)[: self.top]
            return self._new([Trial(b.candidate, q, 2) for b in self._leaders for q in space.neighbours(b.candidate.graph, b.params, b.candidate.variable_dims)])
        if self.round == 3:
            merged = []
            for b in self._leaders:
                better = [t.params for t in self.trials if t.round == 2 and t.candidate is b.candidate and t.time_us < b.time_us]
                if len(better) > 1:
                    merged.append(Trial(b.candidate, space.merge(b.params, better), 3))
            return self._new(merged)
        return []

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def _measure_one(self, t: Trial) -> None:
        from mirage_serve.tune import profile

        if t.round > 1 and self._past_deadline():  # the first round, every candidate's starting point, is always measured
            t.result = {"skipped": "time budget"}
        elif self.measurer is not None:
            t.result = self.measurer.measure(t, self.spec, self.reps)
        else:
            r = profile.profile_candidate(t.candidate.graph, t.params, spec=self.spec, device=self.device, reps=self.reps,
                                          variable_dims=t.candidate.variable_dims)
            t.result = r.to_dict()
        if self.on_trial is not None:
            self.on_trial(t)

    def measure(self, batch: Sequence[Trial]) -> None:
        """Float-check and time compiled trials; a spilling one only while no spill-free point has passed."""
        spilled = []
        for t in batch:
            self.trials.append(t)
            if not t.compile.get("ok", True):
                t.result = {"error": t.compile.get("error", "did not compile")}
                if self.on_trial is not None:
                    self.on_trial(t)
            elif t.compile.get("spills"):
                spilled.append(t)  # spilled code loses to spill-free code on these memory-bound kernels
            else:
                self._measure_one(t)
        for t in spilled:
            if any(math.isfinite(x.time_us) and not x.compile.get("spills") for x in self.trials):
                t.result = {"skipped": f"spills {t.compile['spills']} bytes of registers; a spill-free point passed"}
                if self.on_trial is not None:
                    self.on_trial(t)
            else:
                self._measure_one(t)

    def result(self) -> TuneResult:
        return TuneResult(self.trials)


def tune(
    candidates: Sequence[Candidate],
    spec: KernelGraph | None,
    *,
    device: str = "cuda",
    reps: int = 50,
    top: int = 2,
    precompiler: Precompiler | None = None,
    deadline: float | None = None,
    precompiled: Sequence[Trial] | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    measurer: Measurer | None = None,
) -> TuneResult:
    """Search parameters for ``candidates`` (see the module docstring); fastest passing point first.

    ``precompiled``: round-1 trials whose compilation was already done; ``deadline``
    (``time.time()``) stops the search after its first round: every candidate's starting point is
    measured however long compiling took, later rounds' points are not started past it.
    ``measurer``: profile in its own process (a point that breaks its CUDA context costs only itself);
    by default points are profiled in this process."""
    pre = precompiler or Precompiler(1, device)
    tuner = Tuner(candidates, spec, device=device, reps=reps, top=top, deadline=deadline, on_trial=on_trial, measurer=measurer)
    if precompiled is not None:
        tuner.round = 1
        batch = tuner._new(list(precompiled))
    else:
        batch = tuner.propose()
        pre.compile(batch)
    while batch:
        tuner.measure(batch)
        batch = tuner.propose()
        pre.compile(batch)
    return tuner.result()
