"""``mirage-serve build-cache [MODEL_ID]``: fill the kernel cache for one model.

Resolves the model's config offline (:mod:`mirage_serve.model_ids`; no argument builds
:data:`~mirage_serve.model_ids.DEFAULT_MODEL_ID`), lists its fusable subgraphs per batch
bucket with the model's adapter, merges identical ones (same spec, dims, dtype and spec
options) and then, for each: cache lookup (skipped when present unless ``--rebuild``) ->
search (which returns verified candidates; the certificate is recorded, and a candidate
without one is verified here) -> codegen support check -> ranking (GPU profile when torch
sees a GPU, else the analytical cost model, recorded as ``unprofiled``) -> cache entry.

Each entry is written as soon as it is built, so an interrupted build resumes where it
stopped. Decode attention uses the kv_len buckets of :mod:`mirage_serve.models.base`
(1024, 4096, 16384, each capped at the model's context or sliding window).

Buckets of one family (same spec, dtype, options and non-bucketed dims) share structure: the
first bucket is searched in full, and its verified structures (up to ``MAX_SEEDS`` distinct
ones, cheapest first) seed the others — each is re-instantiated at the new bucket's shapes
(fresh grids and loop ranges) and verified again against that bucket's spec. A bucket none of
them fits (a batch-1 GEMV that broadcasts one row over a weight tile does not fit batch 2) is
searched in full, and its structures then lead the family's seeds for the buckets after it. The first bucket of a new family of the same spec (RMSNorm→gate/up
after RMSNorm→QKV) is seeded the same way from the structures verified for another family, and then
from the entries of the same spec, dtype and options already in the cache (another model built into
the same cache: Qwen2.5-7B after Qwen3-8B). A
certificate is never reused across shapes; when no seed re-verifies, that bucket is searched in
full. When a search ends without a verified fused μGraph, that kernel and the other buckets and
families of its spec are reported as ``original`` (the model's own code runs there; not a
failure) without searching again.
``--no-seed`` searches every bucket.

A pipeline step whose package is missing from this build fails that subgraph with a message
naming the missing piece; nothing is written for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mirage_serve.memory import available_memory_bytes, retained_heap, trim
from mirage_serve.model_ids import DEFAULT_MODEL_ID, ModelNotFoundError, bundled_model_ids, resolve_config

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = "1,2,4,8,16,32,64"
DEFAULT_TIME_BUDGET_S = 240.0
DEFAULT_PATIENCE_S = 60.0  # a search stops this long after its last improvement (once its best is guarded)
BUCKETED_DIMS = ("batch", "kv_len")
SEARCH_ENGINE_MODULES = ("mirage_serve.search.abstract", "mirage_serve.search.prune")
MAX_SEEDS = 16  # distinct verified structures of one bucket tried at the other buckets of the same family


class NoFusedForm(Exception):
    """The search ended (complete or at its time budget) without a verified fused μGraph: the
    subgraph keeps running the model's original code. Not a failure of the build."""


class StepError(Exception):
    """One pipeline step failed for one subgraph; ``step`` names it (lookup, search, verify, codegen, tune, write)."""

    def __init__(self, step: str, message: str):
        super().__init__(message)
        self.step = step


# ---------------------------------------------------------------------------------------------
# the work list


@dataclass
class WorkItem:
    """One distinct kernel to build: a representative subgraph and every role/site it serves."""

    subgraph: Any  # mirage_serve.models.Subgraph
    roles: list[str] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "+".join(dict.fromkeys(self.roles))

    @property
    def bucket(self) -> str:
        d = self.subgraph.dims
        return f"b={d['batch']}" + (f" kv={d['kv_len']}" if "kv_len" in d else "")

    def describe(self) -> str:
        return self.subgraph.describe()


def dedupe(subgraphs: list[Any]) -> list[WorkItem]:
    """Merge subgraphs that are the same kernel (same spec, dims, dtype and options), keeping first-seen order."""
    items: dict[tuple, WorkItem] = {}
    for sg in subgraphs:
        item = items.setdefault(sg.signature(), WorkItem(sg))
        item.roles.append(sg.role)
        item.sites.extend(sg.sites)
    return list(items.values())


@dataclass
class ItemResult:
    """What happened to one work item."""

    item: WorkItem
    status: str  # planned | cached | built | original (no fused form found: the model's code runs) | failed
    verified: bool | None = None
    speedup: float | None = None  # baseline (unfused spec) time / chosen candidate time, same ranking method
    profiled: bool | None = None
    seconds: float = 0.0
    step: str | None = None  # the failing step
    message: str = ""
    entry_id: str | None = None
    candidates: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    graphs: list[Any] = field(default_factory=list, repr=False)  # verified μGraphs that may seed other buckets
    rows: dict[str, int] | None = None  # the certificate's rows: verified on a row-reduced instance

    @property
    def speedup_text(self) -> str:
        if self.status in ("planned", "failed", "original") or self.speedup is None:
            return "-"
        if not self.profiled:
            return "unprofiled"
        return f"{self.speedup:.2f}x"

    def to_dict(self) -> dict[str, Any]:
        sg = self.item.subgraph
        return {
            "subgraph": self.item.name,
            "spec": sg.spec_name,
            "dims": dict(sg.dims),
            "dtype": sg.dtype,
            "options": dict(sg.options),
            "bucket": self.item.bucket,
            "roles": list(dict.fromkeys(self.item.roles)),
            "sites": len(self.item.sites),
            "unfused": list(sg.unfused),
            "status": self.status,
            "verified": self.verified,
            "profiled": self.profiled,
            # measured on a GPU, or the cost model's estimate when "profiled" is false
            "speedup": self.speedup if self.speedup is not None and math.isfinite(self.speedup) else None,
            "seconds": round(self.seconds, 3),
            "failed_step": self.step,
            "message": self.message,
            "entry_id": self.entry_id,
            "candidates": self.candidates,
            **({"verified_rows": self.rows} if self.rows else {}),
            **({"details": self.details} if self.details else {}),
        }


# ---------------------------------------------------------------------------------------------
# the other packages, resolved lazily so a missing one fails its step, not the command


def _require(step: str, module: str, *names: str) -> list[Any]:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise StepError(step, f"{step}: {module} cannot be imported in this build ({e})") from e
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise StepError(step, f"{step}: {module} does not provide {', '.join(missing)} yet (see docs/CONTRACTS.md); "
                              f"this step cannot run in this build")
    return [getattr(mod, n) for n in names]


def open_cache(cache_dir: str | None, no_package: bool = False) -> Any:
    """``KernelCache(cache_dir)``; None means the default cache ($MIRAGE_SERVE_CACHE or the platform cache dir).
    ``no_package``: without the read-only entries shipped with mirage-serve."""
    (kernel_cache,) = _require("lookup", "mirage_serve.cache", "KernelCache")
    return kernel_cache(cache_dir, readonly_dirs=() if no_package else None)


def current_arch() -> str:
    """``smXY`` of the GPU torch sees, else ``unprofiled`` (entries ranked by the cost model)."""
    (current_gpu_arch,) = _require("lookup", "mirage_serve.cache", "current_gpu_arch")
    return current_gpu_arch()


def make_key(subgraph: Any, gpu_arch: str) -> Any:
    """The cache key of a subgraph on this machine: spec, dims, dtype, spec options, GPU architecture."""
    (cache_key,) = _require("lookup", "mirage_serve.cache", "CacheKey")
    return cache_key(spec=subgraph.spec_name, dims=dict(subgraph.dims), dtype=subgraph.dtype,
                     gpu_arch=gpu_arch, options=dict(subgraph.options))


def lookup(cache: Any, key: Any) -> Any:
    """The cached entry for exactly ``key`` (this machine's GPU architecture, or ``unprofiled``), or None.

    No architecture fallback: on a GPU, an entry that was only ranked by the cost model is
    rebuilt so that it gets profiled. Entries failing the cache's checks count as absent.
    """
    try:
        return cache.get(key)
    except Exception as e:  # a locked or unreadable cache directory
        raise StepError("lookup", f"lookup: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------
# one item through the pipeline


@dataclass
class BuildOptions:
    time_budget_s: float
    jobs: int
    rebuild: bool
    patience_s: float | None = None
    trials: int = 3
    seed: int = 0
    max_candidates: int = 8  # best candidates (by the search's own cost) carried into ranking
    seeded_verified: int = 1  # verified re-instantiations wanted per seeded bucket (the cost-model best first)
    max_rows: int | None = None  # verify on at most this many rows (row-separable pairs; see mirage_serve.verify.rows)
    tune_budget_s: float = 60.0  # on a GPU: seconds of codegen-parameter search per kernel (0: default parameters)
    tune_graphs: int = 3  # the fastest ranked μGraphs whose parameters are searched
    tune_reps: int = 30  # timed replays per tuning point
    tune_pools: Any = None  # TunePools shared by every kernel of a run (None: each search starts its own)


class TunePools:
    """The compile workers and the measuring process of the codegen-parameter search, started at the
    first kernel tuned and kept for the rest of the run: each start costs seconds (the spawned
    processes import torch and Triton and open a CUDA context). At least two compile workers, so no
    point compiles and launches in the build's own process. :meth:`close` ends them; a search that
    is interrupted or fails kills them, and the next kernel starts new ones."""

    def __init__(self, jobs: int) -> None:
        self.jobs = max(2, jobs)
        self.precompiler: Any = None
        self.measurer: Any = None

    def get(self) -> tuple[Any, Any]:
        if self.precompiler is None:
            precompiler, measurer = _require("tune", "mirage_serve.tune.search", "Precompiler", "Measurer")
            self.precompiler, self.measurer = precompiler(self.jobs, device="cuda"), measurer("cuda")
        return self.precompiler, self.measurer

    def close(self, kill: bool = False) -> None:
        """End the processes (``kill``: terminate them, for a point that may never return: a
        compile's test launch or a measurement)."""
        pre, meas, self.precompiler, self.measurer = self.precompiler, self.measurer, None, None
        try:
            if meas is not None:
                meas.close(kill=kill)
        finally:
            if pre is not None:
                pre.close(kill=kill)


def _certificate_of(candidate: Any, spec: Any, opts: BuildOptions) -> Any:
    """The candidate's certificate from the search, or a fresh one from the verifier when it has none."""
    cert = getattr(candidate, "certificate", None)
    if cert is None:
        (verify_equivalent,) = _require("verify", "mirage_serve.verify", "verify_equivalent")
        cert = verify_equivalent(candidate.graph, spec, trials=opts.trials, seed=opts.seed)
    return cert


def _verdict(cert: Any) -> str | None:
    return cert.get("verdict") if isinstance(cert, dict) else getattr(cert, "verdict", None)


#: a tuned point replaces the default parameters only when it is at least this much faster (timing noise)
TUNE_MIN_GAIN = 0.02


def tune_params(ranked: list[Any], spec: Any, spec_name: str, opts: BuildOptions) -> tuple[Any | None, list[Any], dict[str, Any]]:
    """Search codegen parameters on the GPU (num_warps, num_stages, the MMA form, split launches; see
    :mod:`mirage_serve.tune.search`) for the first ``opts.tune_graphs`` of ``ranked`` (μGraphs in the order
    of their default-parameter profile or of the cost model) within ``opts.tune_budget_s`` from the start of the search; the first round
    (every graph at its default and its initial parameters) is timed in full however long it takes.
    Every point is float-checked against ``spec`` before it is timed, in a process of its own, and
    compiled in worker processes, so a point that fails or crashes costs only itself. Points are timed as the runtime compiles them (decode
    attention masked to a shorter KV length).

    Returns a ``Ranked`` (its graph the ranked graph object itself) for the fastest point: a tuned
    one when it beats the best default-parameter point of the same run by :data:`TUNE_MIN_GAIN` (or
    when no default point was timed), else that default point; None when no point passed. Beside
    it, the graphs that had a point pass, fastest first, and the search's summary (points tried and
    timed, why the others were not, and which point was kept; the Ranked's ``details["tuned"]``)."""
    candidate, tune, trial_cls, first_round, why_not_timed = _require("tune", "mirage_serve.tune.search", "Candidate", "tune", "Trial",
                                                                      "first_round", "why_not_timed")
    (ranked_cls,) = _require("tune", "mirage_serve.tune", "Ranked")
    (codegen_params,) = _require("codegen", "mirage_serve.codegen", "CodegenParams")
    from mirage_serve.integrations.kernels import VARIABLE_EXTENTS

    ext = VARIABLE_EXTENTS.get(spec_name)
    variable = ext.dims if ext is not None else ()
    cands = [candidate(f"graph{i}", r.graph, variable_dims=variable) for i, r in enumerate(ranked[: max(1, opts.tune_graphs)])]
    round1 = [trial_cls(c, {}, 1) for c in cands] + first_round(cands)
    t0 = time.perf_counter()
    pools = opts.tune_pools if opts.tune_pools is not None else TunePools(opts.jobs)
    stuck = True  # left by an exception (an interrupt while a point hangs, too): the measuring process is killed, not awaited
    try:
        pre, meas = pools.get()
        deadline = time.time() + opts.tune_budget_s
        pre.compile(round1)
        res = tune(cands, spec, device="cuda", reps=opts.tune_reps, top=2, precompiler=pre, precompiled=round1,
                   deadline=deadline, measurer=meas)
        stuck = False
    finally:
        if stuck or pools is not opts.tune_pools:
            pools.close(kill=stuck)
    best = res.best
    default = min((t for t in res.trials if not t.params and math.isfinite(t.time_us)), key=lambda t: t.time_us, default=None)
    timed = [t for t in res.trials if math.isfinite(t.time_us)]
    measured = list({id(t.candidate.graph): t.candidate.graph for t in sorted(timed, key=lambda t: t.time_us)}.values())
    info: dict[str, Any] = {"points": len(res.trials), "passed": len(timed), "graphs": len(cands), "seconds": round(time.perf_counter() - t0, 1)}
    not_timed = Counter(w for w in map(why_not_timed, res.trials) if w)
    if not_timed:
        info["not_timed"] = dict(not_timed.most_common())
    if best is None:
        log.info("tuning: no point passed (%s)", info)
        return None, [], info
    if default is None:  # the default points failed, or spilled registers and were skipped for a spill-free point
        win, info["kept"] = best, "tuned (no default-parameter point was timed: failed, or skipped for spilling registers)"
    elif best is not default and best.time_us < default.time_us * (1 - TUNE_MIN_GAIN):
        win, info["kept"] = best, "tuned"
    else:
        win, info["kept"] = default, f"default parameters (no point was {TUNE_MIN_GAIN:.0%} faster)"
    if default is not None:
        info["default_us"] = round(default.time_us, 3)
    info["params"] = params = codegen_params.from_dict(dict(win.params)).cache_params()  # the non-default knobs
    info["time_us"] = round(win.time_us, 3)
    log.info("tuned %d point(s) of %d graph(s) in %.0f s: %s", len(res.trials), len(cands), info["seconds"], info)
    return ranked_cls(win.candidate.graph, params, win.time_us, True, True, {**win.result, "tuned": info}), measured, info


def _make_entry(key: Any, ranked: Any, cert: Any, baseline: Any) -> Any:
    """A cache entry for the chosen candidate: its μGraph, codegen params, certificate and times (µs)."""
    (cache_entry,) = _require("write", "mirage_serve.cache", "CacheEntry")
    timings = {"time_us": float(ranked.time_us)}
    if baseline is not None and math.isfinite(baseline.time_us):
        timings["baseline_us"] = float(baseline.time_us)
    params = ranked.params
    if params is not None and not isinstance(params, dict):
        params = dict(vars(params)) if hasattr(params, "__dict__") else None
    params = {k: v for k, v in (params or {}).items() if isinstance(v, int | str) and not isinstance(v, bool)}
    try:
        return cache_entry.create(key, ranked.graph, certificate=cert, params=params, timings=timings)
    except Exception as e:
        raise StepError("write", f"write: the cache refused the entry: {type(e).__name__}: {e}") from e


def _plain(obj: Any) -> Any:
    """Search stats as JSON-safe data."""
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj if not isinstance(obj, float) or math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if hasattr(obj, "to_dict"):
        return _plain(obj.to_dict())
    if hasattr(obj, "__dict__"):
        return _plain(vars(obj))
    return repr(obj)


def cached_result(item: WorkItem, entry: Any, key: Any, seconds: float) -> ItemResult:
    """The report line of an entry that is already in the cache."""
    timings = dict(getattr(entry, "timings", None) or {})
    base, best = timings.get("baseline_us"), timings.get("time_us")
    return ItemResult(item, "cached", verified=entry.verdict == "equivalent", profiled=entry.profiled,
                      speedup=base / best if base and best else None, seconds=seconds, entry_id=entry.key.entry_id,
                      graphs=[entry.graph], rows=certificate_rows(entry.certificate))


def certificate_rows(cert: Any) -> dict[str, int] | None:
    """A certificate's ``rows`` (set when it was verified on a row-reduced instance), else None."""
    rows = cert.get("rows") if isinstance(cert, dict) else getattr(cert, "rows", None)
    return dict(rows) if isinstance(rows, dict) else None


def verify_memory_bytes(spec: Any, rows: int | None = None) -> int:
    """Rough peak memory of verifying against ``spec`` on CPU (on ``rows`` of its rows when given);
    see :func:`mirage_serve.verify.rows.verify_memory_bytes`."""
    from mirage_serve.verify.rows import verify_memory_bytes as estimate

    return estimate(spec, rows)


def family_of(subgraph: Any) -> tuple:
    """Subgraphs that differ only in their bucketed dims (batch, kv_len): one structure may serve them all."""
    dims = tuple(sorted((k, v) for k, v in subgraph.dims.items() if k not in BUCKETED_DIMS))
    return (subgraph.spec_name, dims, subgraph.dtype, tuple(sorted(subgraph.options.items())))


def spec_kind(spec_name: str, dtype: str, options: dict[str, Any]) -> tuple:
    """The key that groups kernels of one spec, dtype and options, whatever their dims."""
    return (spec_name, dtype, tuple(sorted(options.items())))


def spec_kind_of(subgraph: Any) -> tuple:
    """Subgraphs of one spec, dtype and options, whatever their dims: a structure found for one
    (say RMSNorm→QKV) is tried, re-instantiated and verified afresh, for another (RMSNorm→gate/up)
    before a search is started for it."""
    return spec_kind(subgraph.spec_name, subgraph.dtype, subgraph.options)


@dataclass
class Found:
    """A candidate μGraph for one bucket with its certificate (computed at that bucket's dims)."""

    graph: Any
    certificate: Any
    origin: str  # "search" or "seeded"


def spec_scalar_map(graph: Any, spec: Any, spec_name: str, options: dict[str, Any] | None = None) -> dict[float, float]:
    """The constants ``spec_name`` derives from its dims (decode attention's 1/sqrt(head_dim)) as
    ``graph``'s spec has them -> as ``spec`` has them, where they differ. ``graph``'s spec is rebuilt
    from its own input shapes; empty when that fails or nothing differs."""
    from mirage_serve.specs import build_spec, infer_dims

    try:
        shape_of = {op.attr("name"): tuple(op.attr("shape")) for op in graph.input_ops}
        shapes = [shape_of[op.attr("name")] for op in spec.input_ops]
        own = build_spec(spec_name, infer_dims(spec_name, shapes), spec.input_ops[0].attr("dtype"), **(options or {}))
    except ValueError:  # MuGraphError: not a spec this helper can rebuild from these shapes; no constants are changed
        return {}
    old = [op.attr("scalar") for op in own.ops if op.attr("scalar") is not None]
    new = [op.attr("scalar") for op in spec.ops if op.attr("scalar") is not None]
    if len(old) != len(new):
        return {}
    return {o: n for o, n in zip(old, new, strict=True) if o != n}


def with_scalars(graph: Any, mapping: dict[float, float]) -> Any:
    """``graph`` with every operator constant (kernel and block level) found in ``mapping`` replaced."""
    from dataclasses import replace as dc_replace

    from mirage_serve.mugraph.graph import KernelGraph, Op

    def fix(op: Any) -> Any:
        block = op.block
        if block is not None:
            block = dc_replace(block, ops=tuple(fix(b) for b in block.ops))
        attrs = tuple((k, mapping.get(v, v) if k == "scalar" else v) for k, v in op.attrs)
        return op if block is op.block and attrs == op.attrs else Op(op.kind, op.inputs, attrs, block)

    return KernelGraph(tuple(fix(op) for op in graph.ops), graph.outputs) if mapping else graph


def reinstantiate(graph: Any, spec: Any, config: Any, spec_name: str | None = None, options: dict[str, Any] | None = None) -> list[Any]:
    """``graph``'s structure at ``spec``'s shapes: its input operators replaced by the spec's and its
    grids and loop ranges chosen afresh (``mirage_serve.search.enumerate.instantiations``), cheapest
    first. With ``spec_name``, constants the spec derives from its dims (attention's scale) are
    carried over to the new dims too (a structure found at head dim 128 seeds head dim 96). Empty
    when the structure does not fit the new shapes. The results are unverified."""
    from mirage_serve.mugraph.graph import KernelGraph, MuGraphError

    (instantiations,) = _require("search", "mirage_serve.search.enumerate", "instantiations")
    new_inputs = {op.attr("name"): op for op in spec.input_ops}
    if sorted(new_inputs) != sorted(op.attr("name") for op in graph.input_ops):
        return []
    if spec_name is not None:
        graph = with_scalars(graph, spec_scalar_map(graph, spec, spec_name, options))
    ops = tuple(new_inputs[op.attr("name")] if op.kind == "input" else op for op in graph.ops)
    try:
        found = instantiations(KernelGraph(ops, graph.outputs), config)
    except MuGraphError:
        return []
    return [g for _, g in found[: config.instantiations_per_structure]]


def structure_key(graph: Any) -> tuple:
    """A μGraph's structure: its operators, their inputs and maps, without the grid sizes and loop
    ranges that ``reinstantiate`` chooses afresh for other shapes (input operators by name only)."""
    return tuple((op.kind, op.attr("name")) if op.kind == "input" else
                 (op.kind, op.inputs, op.attrs, (op.block.inputs, op.block.ops, op.block.outputs) if op.block else None)
                 for op in graph.ops)


def distinct_structures(graphs: list[Any], limit: int = MAX_SEEDS) -> list[Any]:
    """The first graph of each structure in ``graphs`` (kept in order), at most ``limit`` of them."""
    out, seen = [], set()
    for g in graphs:
        k = structure_key(g)
        if k not in seen:
            seen.add(k)
            out.append(g)
            if len(out) >= limit:
                break
    return out


def merged_seeds(new: list[Any], old: list[Any] | None) -> list[Any]:
    """The seeds of a family after a bucket of it was searched afresh: the new bucket's structures
    first (they fit shapes the old ones did not), then the old ones not among them."""
    return distinct_structures(list(new) + list(old or []), limit=2 * MAX_SEEDS)


def seeds_for(family_seeds: list[Any] | None, spec_seeds: list[Any] | None, cached_seeds: list[Any] | None = None) -> list[Any] | None:
    """The structures to seed a bucket with: its family's own first, then those verified for other
    families of the same spec in this run (a structure verified at batch 1 may fit batch 1 only),
    then those of the cache's entries of the same spec (another model's build); None if none."""
    out = list(family_seeds or [])
    for g in [*(spec_seeds or []), *(cached_seeds or [])]:
        if g not in out:
            out.append(g)
    return out or None


def cache_seeds(cache: Any, kind: tuple) -> list[Any]:
    """The distinct structures of the cache's usable entries (user cache, then the package's) of the
    spec kind ``kind`` (:func:`spec_kind`): a model built earlier into the same cache seeds the
    searches of the next one. Every seed is re-instantiated and verified afresh at the new shapes, so
    entries of other codegen or Triton versions (the package's, built with another Triton) seed it too;
    an entry that fails any other check is skipped here as it is everywhere."""
    try:
        entries = cache.entries(specs={kind[0]}, include_stale=True)
    except Exception as e:  # an unreadable cache directory: no seeds, the searches run in full
        log.warning("could not read the cache's entries for seeds (%s: %s)", type(e).__name__, e)
        return []
    entries = [e for e in entries if spec_kind(e.key.spec, e.key.dtype, e.key.options_dict) == kind]
    stale = [r for r in (e.key.stale_reason() for e in entries) if r]
    if stale:
        log.info("%d %s entries of the cache were built for another Triton or codegen version (%s): they are not used "
                 "as they are, but their μGraphs seed the search and are verified afresh", len(stale), kind[0], stale[0])
    return distinct_structures([e.graph for e in entries])


def seeded_candidates(seeds: list[Any], spec: Any, config: Any, opts: BuildOptions, device: str, spec_name: str | None = None,
                      options: dict[str, Any] | None = None) -> tuple[list[Found], dict[str, Any]]:
    """Verified μGraphs for ``spec`` from the structures verified at another bucket.

    The re-instantiated graphs are ranked first (cheap: the cost model, or the GPU), then verified
    in that order against this bucket's spec until ``opts.seeded_verified`` pass — verification at
    full shapes is the expensive step. A certificate is never carried over from another shape.
    """
    from mirage_serve.mugraph.serialize import content_hash

    (verify_equivalent,) = _require("verify", "mirage_serve.verify", "verify_equivalent")
    (rank_candidates,) = _require("tune", "mirage_serve.tune", "rank_candidates")
    graphs: dict[str, Any] = {}
    for seed_graph in seeds:
        for g in reinstantiate(seed_graph, spec, config, spec_name, options):
            graphs.setdefault(content_hash(g), g)
    stats = {"seeds": len(seeds), "instantiated": len(graphs), "verified": 0, "rejected": 0}
    if not graphs:
        return [], stats
    order = [r.graph for r in rank_candidates(list(graphs.values()), device="cpu", spec=spec)] if device == "cpu" else list(graphs.values())
    # guarded before unguarded (a seed that drops the spec's max guard on exp is tried last)
    (numerically_safe,) = _require("search", "mirage_serve.search.rewrite", "numerically_safe")
    order.sort(key=lambda g: not numerically_safe(g, spec))
    out: list[Found] = []
    for g in order:
        try:
            cert = verify_equivalent(g, spec, trials=opts.trials, seed=opts.seed, max_rows=opts.max_rows)
        except (MemoryError, RuntimeError) as e:  # e.g. a structure whose tiles at these shapes do not fit in memory
            log.warning("verification of a seeded candidate failed (%s: %s); not kept", type(e).__name__, str(e)[:200])
            cert = None
        if cert is not None and _verdict(cert) == "equivalent":
            out.append(Found(g, cert, "seeded"))
            if len(out) >= opts.seeded_verified:
                break
        else:
            stats["rejected"] += 1
    stats["verified"] = len(out)
    return out, stats


def searched_candidates(spec: Any, config: Any, opts: BuildOptions) -> tuple[list[Found], dict[str, Any]]:
    """Verified μGraphs for ``spec`` from a full search (its certificates, or fresh ones where absent)."""
    (superoptimize,) = _require("search", "mirage_serve.search", "superoptimize")
    # the search's worker processes build its default expression engine from these modules; a worker
    # that cannot import them fails in its pool initializer, so check here rather than hang in the pool
    for module in SEARCH_ENGINE_MODULES:
        _require("search", module)
    trim()  # the forked workers start without the memory earlier buckets left free for reuse
    result = superoptimize(spec, config)
    stats = _plain(getattr(result, "stats", None)) or {}
    candidates = list(result.candidates)[: opts.max_candidates]
    if not candidates:
        how = "searched its whole space" if stats.get("complete") else f"stopped at its {opts.time_budget_s:g}s budget"
        raise NoFusedForm(f"no verified fused μGraph (the search {how}: {stats.get('enumerated', 0)} candidates enumerated, "
                          f"{stats.get('structures', 0)} complete structures, {stats.get('rejected', 0)} rejected by the verifier); "
                          "the original code runs here; a larger --time-budget may find one")
    out = []
    for c in candidates:
        cert = _certificate_of(c, spec, opts)
        if _verdict(cert) == "equivalent":
            out.append(Found(c.graph, cert, "search"))
        else:
            log.warning("dropping a search candidate whose certificate says %r", _verdict(cert))
    if not out:
        raise StepError("verify", f"none of the {len(candidates)} search candidates has an 'equivalent' certificate")
    return out, stats


SEARCHES = "searches"  # <cache root>/searches/<entry id>.json: searches that found no fused form


def _search_record_path(cache: Any, key: Any) -> Any:
    return cache.root / SEARCHES / f"{key.entry_id}.json"


def recorded_no_fusion(cache: Any, key: Any, time_budget_s: float) -> str | None:
    """The message of an earlier search for ``key`` that found no fused form with at least this
    budget, or None. The record is data only (a JSON object with a number and a string); anything
    else is ignored with a warning, and the search runs again."""
    path = _search_record_path(cache, key)
    try:
        if path.is_symlink() or not path.is_file():
            return None
        obj = json.loads(path.read_text(encoding="utf-8"))
        budget, message = obj["time_budget_s"], obj["message"]
        if obj.get("schema") != 1 or not isinstance(budget, (int, float)) or not isinstance(message, str):
            raise ValueError("unexpected fields")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the search record %s (%s); searching again", path, e)
        return None
    return message if budget >= time_budget_s else None


def record_no_fusion(cache: Any, key: Any, time_budget_s: float, message: str) -> None:
    """Remember (atomically, under the cache lock) that a search with this budget found no fused
    form, so a second run does not repeat it; ``--rebuild`` or a larger ``--time-budget`` searches again."""
    from mirage_serve.cache.store import write_atomic

    path = _search_record_path(cache, key)
    data = json.dumps({"schema": 1, "time_budget_s": time_budget_s, "message": message}).encode("utf-8")
    try:
        with cache._locked():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path.parent, path.name, data)
    except Exception as e:  # the lock's timeout is a CacheError; a record is worth a warning, not the entry
        log.warning("could not record the search outcome in %s (%s); a second run searches again", path.parent, e)


def _profiled_order(rank_candidates: Any, graphs: list[Any], device: str, spec: Any) -> list[Any]:
    """``graphs`` ranked at default parameters (profiled on a GPU, else by the cost model), those that
    pass their float check, fastest first."""
    ranked = [r for r in rank_candidates(graphs, device=device, spec=spec) if r.passed and math.isfinite(r.time_us)]
    if not ranked:
        raise StepError("tune", "every candidate failed its float check while profiling")
    return ranked


def build_item(item: WorkItem, cache: Any, arch: str, opts: BuildOptions, seeds: list[Any] | None = None) -> ItemResult:
    """Run one work item through lookup -> search (or seeded re-instantiation) -> verify -> codegen -> tune -> write.

    ``seeds``: μGraphs verified for other buckets of the same family (then other families of the
    same spec); when given and one of them re-verifies at this bucket's shapes, the full search is
    skipped. Memory freed while the item is built is kept for reuse until it is done (see
    :mod:`mirage_serve.memory`).
    """
    with retained_heap():
        return _build_item(item, cache, arch, opts, seeds)


def _build_item(item: WorkItem, cache: Any, arch: str, opts: BuildOptions, seeds: list[Any] | None) -> ItemResult:
    t0 = time.perf_counter()
    sg = item.subgraph
    try:
        key = make_key(sg, arch)
        if not opts.rebuild:
            entry = lookup(cache, key)
            if entry is not None:
                return cached_result(item, entry, key, time.perf_counter() - t0)
            if not seeds:
                recorded = recorded_no_fusion(cache, key, opts.time_budget_s)
                if recorded is not None:
                    return ItemResult(item, "original", message=f"{recorded} (recorded by an earlier run; --rebuild searches again)",
                                      seconds=time.perf_counter() - t0)
        spec = sg.build_spec()
        need, have = verify_memory_bytes(spec), available_memory_bytes()
        if have is not None and need > have:  # memory an earlier bucket freed may still be held for reuse
            trim()
            have = available_memory_bytes()
        if have is not None and need > have:
            # too large to evaluate here: a row-separable spec (decode attention) is verified on fewer rows
            # (mirage_serve.verify.rows), using at most half the memory available, with structures verified
            # for other buckets; nothing unverified is cached
            from mirage_serve.verify.rows import row_split, rows_within_memory

            split = row_split(spec)
            max_rows = (rows_within_memory(spec, have) or 0) if split is not None else 0
            if split is None or max_rows < split.group or not seeds:
                why = ("its inputs are not row-separable" if split is None else
                       "no other bucket of it was verified first" if not seeds else "one row group alone does not fit")
                # not recorded as "no fused form", so a build on a larger machine searches and verifies it
                return ItemResult(item, "original", seconds=time.perf_counter() - t0,
                                  message=f"not verified here: verifying at these shapes needs about {need / 2**30:.0f} GiB of "
                                          f"memory and {have / 2**30:.0f} GiB is available, and {why}; the original code runs "
                                          "for this bucket; build it on a larger machine or leave it out (--batch-sizes / --kv-lens)")
            opts = dataclasses.replace(opts, max_rows=max_rows)
            log.info("%s: verifying on at most %d of %d rows (row-separable; %.0f GiB needed at full size, %.0f GiB available)",
                     item.describe(), max_rows, split.rows, need / 2**30, have / 2**30)
        (search_config,) = _require("search", "mirage_serve.search", "SearchConfig")
        config = search_config(time_budget_s=opts.time_budget_s, patience_s=opts.patience_s, jobs=opts.jobs, trials=opts.trials,
                               seed=opts.seed, progress=False)

        # candidates: seeded from another bucket's verified structures when possible, else searched
        found: list[Found] = []
        details: dict[str, Any] = {}
        (numerically_safe,) = _require("search", "mirage_serve.search.rewrite", "numerically_safe")
        if seeds:
            found, details["seeded"] = seeded_candidates(seeds, spec, config, opts, "cuda" if arch != "unprofiled" else "cpu",
                                                         sg.spec_name, dict(sg.options))
            if found and not any(numerically_safe(f.graph, spec) for f in found):
                log.info("%s: only seeds without the spec's max guard on exp verified; searching", item.describe())
                found = []
        if not found and opts.max_rows is not None:
            return ItemResult(item, "original", seconds=time.perf_counter() - t0,
                              message=f"not verified here: no structure verified for another bucket re-verified on "
                                      f"{opts.max_rows} rows, and a search at full size does not fit in memory; the original "
                                      "code runs for this bucket; build it on a larger machine")
        if not found:
            found, details["search"] = searched_candidates(spec, config, opts)

        # codegen: only μGraphs the Triton generator can compile are worth caching
        (supports,) = _require("codegen", "mirage_serve.codegen", "supports")
        compilable = [f for f in found if supports(f.graph)]
        if not compilable:
            raise StepError("codegen", f"codegen supports none of the {len(found)} verified candidates")
        # a candidate that drops a max guard the spec puts on an exp (an unshifted softmax) is equal to the
        # spec in exact arithmetic but overflows in floating point once a score exceeds ~88: never cached
        safe = [f for f in compilable if numerically_safe(f.graph, spec)]
        if not safe:
            return ItemResult(item, "original", seconds=time.perf_counter() - t0,
                              message=f"every one of the {len(compilable)} verified candidates drops the spec's max guard on exp "
                                      "(exp of unshifted scores overflows in floating point), so none is cached; the original "
                                      "code runs here; a larger --time-budget may find a guarded one")
        if len(safe) < len(compilable):
            log.info("%s: %d of %d candidates drop the spec's max guard on exp; ranking the %d guarded ones",
                     item.name, len(compilable) - len(safe), len(compilable), len(safe))
            compilable = safe

        # tune: GPU profile when available, else the analytical cost model (unprofiled); on a GPU the
        # codegen-parameter search follows. When it takes every candidate, it measures each at its
        # default parameters itself (compiled in parallel, timed in its own process), so the
        # candidates are only put in cost-model order first; the in-process profile ranks them when
        # there are more, and whenever the parameter search has no result.
        (rank_candidates,) = _require("tune", "mirage_serve.tune", "rank_candidates")
        device = "cuda" if arch != "unprofiled" else "cpu"
        graphs = [f.graph for f in compilable]
        tuning = device == "cuda" and opts.tune_budget_s > 0
        ranked = None if tuning and len(graphs) <= max(1, opts.tune_graphs) else _profiled_order(rank_candidates, graphs, device, spec)
        best, measured = None, []
        if tuning:
            try:
                tuned, measured, info = tune_params(ranked or rank_candidates(graphs, device="cpu", spec=spec), spec, sg.spec_name, opts)
            except Exception as e:  # tuning is optional: the profiled default-parameter winner still stands
                log.warning("%s: the parameter search failed (%s: %s); keeping default parameters", item.describe(), type(e).__name__, e)
                tuned, details["tuned"] = None, {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if tuned is not None:
                best, details["tuned"] = tuned, info
            elif "tuned" not in details:
                details["tuned"] = {**info, "kept": "default parameters of the ranking (no point passed in the parameter search)"}
        if ranked is None:
            ranked = _profiled_order(rank_candidates, graphs, device, spec) if best is None else []
        best = best or ranked[0]
        chosen = next(f for f in compilable if f.graph is best.graph)
        baseline = rank_candidates([spec], device=device, spec=spec)[0]
        speedup = baseline.time_us / best.time_us if math.isfinite(baseline.time_us) and best.time_us > 0 else None

        # write
        entry = _make_entry(key, best, chosen.certificate, baseline)
        try:
            cache.put(entry)
        except Exception as e:
            raise StepError("write", f"write: {type(e).__name__}: {e}") from e
        details["origin"] = chosen.origin
        return ItemResult(item, "built", verified=True, speedup=speedup, profiled=best.profiled,
                          seconds=time.perf_counter() - t0, entry_id=entry.key.entry_id, candidates=len(compilable),
                          details=details, graphs=distinct_structures([best.graph] + ([r.graph for r in ranked] if ranked else measured)),
                          rows=certificate_rows(chosen.certificate))
    except NoFusedForm as e:
        record_no_fusion(cache, key, opts.time_budget_s, str(e))
        return ItemResult(item, "original", message=str(e), seconds=time.perf_counter() - t0)
    except StepError as e:
        return ItemResult(item, "failed", step=e.step, message=str(e), seconds=time.perf_counter() - t0)
    except Exception as e:  # one subgraph's bug must not lose the others' entries
        log.exception("%s failed", sg.describe())
        return ItemResult(item, "failed", step="internal", message=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# the command


def _needs_build(cache: Any, item: WorkItem, arch: str, rebuild: bool) -> bool:
    """Whether ``build_item`` will build ``item`` rather than find it cached (a lookup error: it will report it)."""
    if rebuild:
        return True
    try:
        return lookup(cache, make_key(item.subgraph, arch)) is None
    except StepError:
        return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_id", nargs="?", default=DEFAULT_MODEL_ID,
                        help=f"a directory with config.json, a Hugging Face id in the local HF cache, or a bundled id "
                             f"(default: {DEFAULT_MODEL_ID}; bundled: {', '.join(bundled_model_ids())})")
    parser.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help=f"decode batch buckets (default {DEFAULT_BATCH_SIZES})")
    parser.add_argument("--kv-lens", default=None, help="decode-attention kv_len buckets (default 1024,4096,16384, capped at the model's context)")
    parser.add_argument("--cache-dir", default=None, help="kernel cache directory (default: $MIRAGE_SERVE_CACHE or the platform cache dir)")
    parser.add_argument("--no-package", action="store_true",
                        help="ignore the read-only entries shipped with mirage-serve (build every kernel into the cache dir)")
    parser.add_argument("--dry-run", action="store_true", help="list the subgraphs and buckets that would be built, build nothing")
    parser.add_argument("--rebuild", action="store_true", help="rebuild entries that are already cached")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes of the search for each subgraph (default 2)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel degree: heads and intermediate are divided by it")
    parser.add_argument("--lora-config", default=None, help="peft adapter_config.json (or its directory): adds lora_linear per target module")
    parser.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S, help=f"search seconds per subgraph (default {DEFAULT_TIME_BUDGET_S:g})")
    parser.add_argument("--patience", type=float, default=DEFAULT_PATIENCE_S,
                        help=f"stop a subgraph's search this many seconds after its best verified candidate last improved "
                             f"(default {DEFAULT_PATIENCE_S:g}; 0: always search the whole --time-budget)")
    parser.add_argument("--tune-budget", type=float, default=BuildOptions.tune_budget_s,
                        help=f"on a GPU: seconds per kernel to search codegen parameters (warps, pipeline stages, MMA form) for "
                             f"the fastest verified μGraphs; a first round that times each at its default and initial parameters "
                             f"always runs in full, later rounds stop at the budget; every point float-checked (default {BuildOptions.tune_budget_s:g}; 0: default "
                             f"parameters, no search). Without a GPU the cost model ranks at default parameters")
    parser.add_argument("--no-seed", action="store_true",
                        help="search every bucket from scratch instead of first re-verifying the structures found at its family's first bucket")
    parser.add_argument("--only", default=None, help="comma-separated roles or spec names to build (e.g. attention_decode,attn_norm_qkv); default all")
    parser.add_argument("--dtype", default=None, help="override the config's torch_dtype (bfloat16, float16, float32)")
    parser.add_argument("--json", action="store_true", help="print a JSON report instead of the table")


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _verified_text(r: ItemResult) -> str:
    return {True: "yes*" if r.rows else "yes", False: "NO", None: "-"}[r.verified]


def format_results(results: list[ItemResult]) -> str:
    rows = [[r.item.name, r.item.describe(), r.item.bucket, r.status + (f" ({r.step})" if r.step else ""),
             _verified_text(r), r.speedup_text, "-" if r.status == "planned" else f"{r.seconds:.1f}s"] for r in results]
    text = _table(rows, ["subgraph", "kernel", "bucket", "status", "verified", "speed-up", "time"])
    reduced = [r for r in results if r.rows and r.verified]
    if reduced:
        text += ("\n\n* verified on fewer rows than the bucket has (its rows are independent problems, and both graphs "
                 "compute every row group alike; mirage_serve/verify/rows.py):\n"
                 + "\n".join(f"  {r.item.describe()}: {r.rows['verified_rows']} of {r.rows['rows']} rows" for r in reduced))
    original = [r for r in results if r.status == "original"]
    if original:
        text += "\n\nno fused form (the original code runs):\n" + "\n".join(f"  {r.item.describe()}: {r.message}" for r in original)
    failures = [r for r in results if r.status == "failed"]
    if failures:
        text += "\n\nfailures:\n" + "\n".join(f"  {r.item.describe()}: {r.message}" for r in failures)
    return text


def run(args: argparse.Namespace) -> int:
    from mirage_serve.models import AdapterError, adapter_for_config
    from mirage_serve.models.base import DEFAULT_KV_LEN_BUCKETS, parse_sizes

    t_start = time.perf_counter()
    try:
        config, source = resolve_config(args.model_id)
        batch_sizes = parse_sizes(args.batch_sizes)
        kv_lens = parse_sizes(args.kv_lens) if args.kv_lens else list(DEFAULT_KV_LEN_BUCKETS)
        adapter = adapter_for_config(config)
        plan = adapter.plan(config, batch_sizes, tensor_parallel=args.tensor_parallel, lora=args.lora_config,
                            kv_lens=kv_lens, dtype=args.dtype)
    except (ModelNotFoundError, AdapterError, ValueError) as e:
        print(f"mirage-serve build-cache: {e}", file=sys.stderr)
        return 2
    if args.jobs < 1 or args.time_budget <= 0 or args.patience < 0:
        print("mirage-serve build-cache: --jobs must be >= 1, --time-budget > 0 and --patience >= 0", file=sys.stderr)
        return 2
    subgraphs = plan.subgraphs
    if args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        known = {sg.role for sg in subgraphs} | {sg.spec_name for sg in subgraphs}
        unknown = wanted - known
        if unknown:
            print(f"mirage-serve build-cache: --only {','.join(sorted(unknown))} matches no subgraph of this model; "
                  f"choose from {', '.join(sorted(known))}", file=sys.stderr)
            return 2
        subgraphs = [sg for sg in subgraphs if sg.role in wanted or sg.spec_name in wanted]
    items = dedupe(subgraphs)
    log.info("%s (%s, from %s): %d subgraphs, %d distinct kernels", args.model_id, plan.model_type, source, len(subgraphs), len(items))
    header = {
        "model_id": args.model_id,
        "config_source": source,
        "model_type": plan.model_type,
        "dtype": plan.arch.dtype,
        "tensor_parallel": args.tensor_parallel,
        "batch_sizes": batch_sizes,
        "kv_len_buckets": plan.kv_len_buckets,
        "subgraphs": len(subgraphs),
        "distinct_kernels": len(items),
        "excluded": [{"role": e.role, "reason": e.reason} for e in plan.excluded],
        "notes": plan.notes,
    }

    cache = None
    cache_error = None
    arch = "unprofiled"
    try:
        cache = open_cache(args.cache_dir, args.no_package)
        arch = current_arch()
        header["cache_dir"] = str(cache.root)
        header["gpu_arch"] = arch
    except StepError as e:
        cache_error = str(e)

    results: list[ItemResult] = []
    if args.dry_run:
        for item in items:
            r = ItemResult(item, "planned", message="would build")
            if cache is not None:
                try:
                    if not args.rebuild and lookup(cache, make_key(item.subgraph, arch)) is not None:
                        r = ItemResult(item, "cached", message="already in the cache")
                except StepError as e:
                    r.message = str(e)
            else:
                r.message = f"cache not checked ({cache_error})"
            results.append(r)
    else:
        # on a GPU several verified seeds are worth profiling; on CPU the cost model's best is the one kept anyway
        opts = BuildOptions(time_budget_s=args.time_budget, jobs=args.jobs, rebuild=args.rebuild, patience_s=args.patience or None,
                            seeded_verified=3 if arch != "unprofiled" else 1, tune_budget_s=max(0.0, args.tune_budget))
        if arch != "unprofiled" and opts.tune_budget_s > 0:
            opts.tune_pools = TunePools(args.jobs)
        seeds: dict[tuple, list[Any]] = {}  # family -> structures verified at its first bucket
        spec_seeds: dict[tuple, list[Any]] = {}  # (spec, dtype, options) -> structures verified in any family
        unfusable: dict[tuple, str] = {}  # (spec, dtype, options) -> the kernel whose search found no fused form
        cached: dict[tuple, list[Any]] = {}  # (spec, dtype, options) -> structures of entries already in the cache
        from tqdm import tqdm

        bar = tqdm(items, desc="build-cache", unit="kernel", disable=None, file=sys.stderr)
        try:
            for item in bar:
                bar.set_postfix_str(item.describe()[:60])
                if cache is None:
                    results.append(ItemResult(item, "failed", step="lookup", message=cache_error or "no cache"))
                    continue
                family = family_of(item.subgraph)
                kind = spec_kind_of(item.subgraph)
                if not args.no_seed and kind not in cached and kind not in spec_seeds and _needs_build(cache, item, arch, args.rebuild):
                    # the first bucket of this spec to build: the cache's entries of the same spec (read
                    # only now, so a run that finds everything cached reads no other entry) may seed it
                    cached[kind] = cache_seeds(cache, kind)
                    if cached[kind]:
                        log.info("%s: %d structures of the cache's entries seed it", item.describe(), len(cached[kind]))
                if not args.no_seed and kind in unfusable and kind not in spec_seeds and not cached.get(kind):
                    results.append(ItemResult(item, "original", message=f"not searched: the search found no fused form for "
                                                                         f"{unfusable[kind]} (--no-seed searches every bucket)"))
                    continue
                r = build_item(item, cache, arch, opts, seeds=None if args.no_seed else seeds_for(seeds.get(family), spec_seeds.get(kind), cached.get(kind)))
                results.append(r)
                if r.graphs and (family not in seeds or r.details.get("origin") == "search"):
                    # a bucket its family's seeds did not fit was searched: its structures seed the rest too
                    seeds[family] = merged_seeds(r.graphs, seeds.get(family))
                if r.graphs and kind not in spec_seeds:
                    spec_seeds[kind] = r.graphs
                if r.status == "original" and kind not in spec_seeds:
                    unfusable[kind] = f"{item.describe()} {item.bucket}"
                log.info("%s %s: %s in %.1fs%s", item.describe(), item.bucket, r.status, r.seconds, f" ({r.message})" if r.message else "")
        except KeyboardInterrupt:
            log.warning("interrupted: entries built so far are in the cache; run the same command again to resume")
        finally:
            bar.close()
            if opts.tune_pools is not None:
                opts.tune_pools.close()

    total = time.perf_counter() - t_start
    counts = {s: sum(r.status == s for r in results) for s in ("planned", "cached", "built", "original", "failed")}
    if args.json:
        print(json.dumps({**header, "dry_run": bool(args.dry_run), "wall_s": round(total, 3), "counts": counts,
                          "results": [r.to_dict() for r in results]}, indent=2))
    else:
        print(f"{args.model_id}: {plan.model_type}, {plan.arch.dtype}, config from {source}")
        print(f"{len(subgraphs)} subgraphs -> {len(items)} distinct kernels; batch buckets {batch_sizes}; kv_len buckets {plan.kv_len_buckets}"
              + (f"; tensor parallel {args.tensor_parallel}" if args.tensor_parallel > 1 else ""))
        for e in plan.excluded:
            print(f"excluded {e.role}: {e.reason}")
        for n in plan.notes:
            print(f"note: {n}")
        if cache_error:
            print(f"cache: {cache_error}")
        print()
        print(format_results(results))
        print()
        print(", ".join(f"{v} {k}" for k, v in counts.items() if v) + f" in {total:.1f}s")
    if args.dry_run:
        return 0
    return 0 if counts["failed"] == 0 and len(results) == len(items) else 1
