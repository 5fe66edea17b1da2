"""``superoptimize``: enumerate, prune, instantiate, verify and rank μGraphs.

The search is breadth-first over the number of kernel operators. Each level
is cut into independent tasks (pre-defined expansions of one prefix; one
customized operator's block graphs for one set of input tensors and a chunk of
input-map choices) that run on a process pool. Structurally complete graphs
are instantiated at concrete sizes, ranked by :mod:`mirage_serve.search.cost`,
and the best few instantiations of each structure go through
``verify_equivalent``; only "equivalent" ones are returned, best first. The
exp-shifted and loop-split rewrites (:mod:`mirage_serve.search.rewrite`) of every
structure that verified are instantiated and verified the same way
(``SearchConfig.rewrites``); they stay within ``max_kernel_ops`` and
``max_customized``, and a split adds one grid dim.

Determinism: tasks and their results are processed in a fixed order and the
returned candidates are sorted by (numerically unsafe, cost, content hash), so a search that
completes within its budget returns the same candidates for the same spec and
configuration. A search cut short by ``time_budget_s`` (``stats.complete`` is
False) returns what it had verified by then, which depends on machine speed.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from mirage_serve.mugraph.graph import KernelGraph, MuGraphError
from mirage_serve.mugraph.serialize import content_hash
from mirage_serve.search.config import SearchConfig
from mirage_serve.search.cost import GraphCost, graph_cost
from mirage_serve.search.enumerate import (
    Counters,
    ExprEngine,
    KernelState,
    Vocabulary,
    complete_graph,
    customized_sources,
    expand_customized,
    expand_predefined,
    final_grid_ok,
    instantiations,
    map_choices,
    min_input_tile_bytes,
    prefix_graph,
)
from mirage_serve.search.labels import kernel_labels
from mirage_serve.search.rewrite import numerically_safe

log = logging.getLogger(__name__)


@dataclass
class Candidate:
    """A verified μGraph: the graph, its certificate and its estimated cost (seconds)."""

    graph: KernelGraph
    certificate: Any
    cost: float
    cost_detail: GraphCost | None = None
    hash: str = ""
    # False when the graph drops a max guard the spec puts on an exp (mirage_serve.search.rewrite.numerically_safe)
    numerically_safe: bool = True

    @property
    def num_kernels(self) -> int:
        return sum(op.kind != "input" for op in self.graph.ops)


@dataclass
class SearchStats:
    """Counts and timings of one search (times in seconds from its start)."""

    enumerated: int = 0
    pruned_abstract: int = 0
    pruned_other: int = 0
    block_nodes: int = 0
    structures: int = 0
    verified: int = 0  # verify_equivalent said "equivalent"
    rejected: int = 0  # verify_equivalent said "not_equivalent" or "unknown"
    time_to_first_s: float | None = None
    time_to_best_s: float | None = None
    elapsed_s: float = 0.0
    complete: bool = True  # False when a time, node or state limit cut the search short
    stopped_early: bool = False  # stopped by SearchConfig.patience_s: no better candidate for that long
    levels: int = 0  # rounds of iterative deepening run (graphs of up to this many operators)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SearchResult:
    """What :func:`superoptimize` found: verified candidates, best first, and statistics."""

    candidates: list[Candidate] = field(default_factory=list)
    stats: SearchStats = field(default_factory=SearchStats)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def rank_key(c: Candidate) -> tuple:
    """Candidates are ranked numerically safe first, then by estimated cost (then hash)."""
    return (not c.numerically_safe, c.cost, c.hash)


# --------------------------------------------------------------------------- worker side

_W: dict[str, Any] = {}


def default_engine(spec: KernelGraph, prune: bool, solver: bool = False) -> ExprEngine:
    """The abstract-expression engine of mirage_serve.search.abstract / prune;
    ``solver`` makes the e-graph confirm every normal-form rejection."""
    from mirage_serve.search import abstract
    from mirage_serve.search import prune as prune_mod

    return ExprEngine(abstract, prune_mod.SubexprOracle(spec, use_solver=solver), prune)


_VERIFIERS: dict[tuple[str, int, int], Any] = {}


def default_verifier(candidate: KernelGraph, spec: KernelGraph, *, trials: int, seed: int, float_check: bool):
    """``verify_equivalent`` through a per-process :class:`mirage_serve.verify.Verifier`,
    which computes the spec's trials once and reuses them for every candidate."""
    from mirage_serve.verify import Verifier

    key = (content_hash(spec), trials, seed)
    v = _VERIFIERS.get(key)
    if v is None:
        _VERIFIERS.clear()
        v = _VERIFIERS[key] = Verifier(spec, trials=trials, seed=seed)
    return v.verify(candidate, float_check=float_check)


def _init_worker(spec, cfg, engine_factory, verifier, deadline, threads: int) -> None:
    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    _W.clear()
    _W.update(spec=spec, cfg=cfg, engine=engine_factory(spec, cfg.prune), verifier=verifier, deadline=deadline,
              vocab=Vocabulary.from_spec(spec), cache={})


def _state_info(state: KernelState):
    cache = _W["cache"]
    hit = cache.get(state.ops)
    if hit is None:
        g = prefix_graph(state.ops)
        hit = (list(g.info), _W["engine"].graph_exprs(g), kernel_labels(g, _W["vocab"].labels))
        if len(cache) > 256:
            cache.clear()
        cache[state.ops] = hit
    return hit


def _run_task(task: tuple) -> dict[str, Any]:
    """One unit of work; returns new prefixes, complete structures and counters."""
    kind = task[0]
    cfg: SearchConfig = _W["cfg"]
    counters = Counters()
    if kind == "verify":
        graph = task[1]
        try:
            cert = _W["verifier"](graph, _W["spec"], trials=cfg.trials, seed=cfg.seed, float_check=cfg.float_check)
        except Exception as e:  # a verifier failure must never let a candidate through
            log.warning("verification of a candidate failed (%s: %s); treating it as not verified", type(e).__name__, e)
            cert = None
        return {"cert": cert}
    state: KernelState = task[1]
    infos, exprs, labels = _state_info(state)
    engine, vocab = _W["engine"], _W["vocab"]
    deadline = _W["deadline"]
    n_out = len(_W["spec"].outputs)
    unfinished: list = []
    if kind == "pre":
        new = expand_predefined(state, infos, exprs, engine, vocab, counters, labels)
    else:
        _, _, sources, choices, max_outputs, node_budget = task
        new, cut = expand_customized(state, infos, exprs, sources, choices, engine, vocab, cfg, counters, deadline,
                                     node_budget, labels, max_outputs=max_outputs)
        if cut:
            unfinished.append(("blk", state, sources, cut, max_outputs))
    states, structures = [], []
    for st, ex in new:
        if deadline is not None and time.monotonic() > deadline:
            counters.truncated = True
            break
        g = complete_graph(st, ex, engine, n_out)
        if g is None:
            states.append(st)
            continue
        counters.structures += 1
        structures.append(g)
    return {"states": states, "structures": structures, "counters": counters, "unfinished": unfinished}


# --------------------------------------------------------------------------- driver side


def _check_spec(spec: KernelGraph) -> None:
    if not isinstance(spec, KernelGraph):
        raise MuGraphError(f"superoptimize needs a KernelGraph spec (e.g. mirage_serve.specs.build_spec), got {type(spec).__name__}")
    spec.validate()
    if not spec.input_ids:
        raise MuGraphError("the spec has no inputs; build it with GraphBuilder.input(...) first")
    if any(op.kind == "customized" for op in spec.ops):
        raise MuGraphError("the spec contains customized operators; give the reference program of pre-defined operators instead")


def _state_key(state: KernelState) -> tuple[str, ...]:
    g = prefix_graph(state.ops)
    consumed = set()
    for op in state.ops:
        consumed.update(op.inputs)
    dangling = [t for t, (i, _) in enumerate(g.tensor_producers) if state.ops[i].kind != "input" and t not in consumed]
    return tuple(sorted(content_hash(KernelGraph(state.ops, (t,))) for t in dangling))


class _Runner:
    """Runs tasks in order on a pool (or inline with one job)."""

    def __init__(self, spec, cfg: SearchConfig, engine_factory, verifier, deadline) -> None:
        self.jobs = max(1, min(cfg.jobs, os.cpu_count() or 1))
        args = (spec, cfg, engine_factory, verifier, deadline, 1 if self.jobs > 1 else max(1, os.cpu_count() or 1))
        if self.jobs > 1:
            self.pool = multiprocessing.get_context("fork").Pool(self.jobs, initializer=_init_worker, initargs=args)
        else:
            self.pool = None
            _init_worker(*args)

    def imap(self, tasks: list[tuple]):
        if self.pool is None:
            return map(_run_task, tasks)
        return self.pool.imap(_run_task, tasks, chunksize=1)

    def close(self, terminate: bool = False) -> None:
        if self.pool is not None:
            if terminate:
                self.pool.terminate()
            else:
                self.pool.close()
            self.pool.join()


def superoptimize(spec: KernelGraph, config: SearchConfig | None = None, *, engine_factory=None, verifier=None) -> SearchResult:
    """Search for verified μGraphs computing the same function as ``spec``.

    ``engine_factory(spec, prune) -> ExprEngine`` and ``verifier(candidate,
    spec, trials=, seed=, float_check=) -> Certificate`` default to the
    project's abstract expressions and ``verify_equivalent``. Returns the
    candidates whose certificate verdict is "equivalent", cheapest first."""
    cfg = config or SearchConfig()
    _check_spec(spec)
    engine_factory = engine_factory or functools.partial(default_engine, solver=cfg.solver)
    verifier = verifier or default_verifier
    start = time.monotonic()
    deadline = start + cfg.time_budget_s if cfg.time_budget_s else None
    stats = SearchStats()
    counters = Counters()
    found: dict[str, Candidate] = {}
    seen_structures: set[str] = set()
    best_hash: str | None = None

    def over() -> bool:
        now = time.monotonic()
        if deadline is not None and now > deadline:
            return True
        best_at = stats.time_to_best_s
        if cfg.patience_s is not None and best_at is not None and now - start - best_at > max(cfg.patience_s, best_at) \
                and any(c.numerically_safe for c in found.values()):  # rank_key puts safe candidates first
            stats.stopped_early = True
            return True
        return False

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    if cfg.split_outputs:
        best_hash = _search_split(spec, cfg, engine_factory, verifier, start, deadline, stats, counters, found)
    vocab = Vocabulary.from_spec(spec)
    runner = _Runner(spec, cfg, engine_factory, verifier, deadline)
    terminated = False
    try:
        # Rounds of iterative deepening over the number of kernel operators: round d
        # searches graphs of exactly d operators, so single-kernel fusions come first.
        # Prefixes of the non-final levels are kept across rounds (level l of round d
        # is the same for every d > l); in a round's final level every customized
        # operator must produce the spec's outputs (see _plan_level).
        start_state = KernelState(tuple(op for op in spec.ops if op.kind == "input"))
        open_states: list[list[KernelState]] = [[start_state]]  # open_states[l]: prefixes of l operators
        for depth in range(1, cfg.max_kernel_ops + 1):
            if terminated or over():
                break
            while len(open_states) < depth:  # non-final level len(open_states) for this round
                level = len(open_states)
                states, terminated, best_hash = _run_level(open_states[-1], level, False, spec, cfg, runner, vocab, counters,
                                                           stats, found, seen_structures, start, over, tqdm, best_hash)
                open_states.append(states)
                if terminated:
                    break
            if terminated:
                break
            stats.levels = depth
            _, terminated, best_hash = _run_level(open_states[depth - 1], depth, True, spec, cfg, runner, vocab, counters,
                                                  stats, found, seen_structures, start, over, tqdm, best_hash)
            log.info("round %d (graphs of %d operators): %d structures so far, %d verified", depth, depth,
                     len(seen_structures), len(found))
    finally:
        runner.close(terminate=terminated)
    cands = sorted(found.values(), key=rank_key)[: cfg.max_candidates]
    stats.enumerated, stats.pruned_abstract, stats.pruned_other = counters.enumerated, counters.pruned_abstract, counters.pruned_other
    stats.block_nodes, stats.structures = counters.block_nodes, counters.structures
    stats.complete = not counters.truncated and not terminated
    stats.elapsed_s = time.monotonic() - start
    log.info("search done: %d verified candidates in %.1fs (first at %s, best at %s; %d enumerated, %d pruned by abstract "
             "expressions, %d by other rules)", len(cands), stats.elapsed_s, _secs(stats.time_to_first_s),
             _secs(stats.time_to_best_s), stats.enumerated, stats.pruned_abstract, stats.pruned_other)
    return SearchResult(cands, stats)


def _secs(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}s"


SPLIT_HEAD_SHARE = 0.2  # of the time left: the head's search (when it is more than one pre-defined operator)
SPLIT_TAIL_SHARE = 0.5  # of the time left after the head: the tail's search
REWRITE_SOURCES = 3  # verified structures per wave whose rewrites are verified (the cheapest)
SPLIT_CANDIDATES = 3  # best head and tail candidates stitched together (pairs verified: at most 3 x 3)


def _kernel_ops(graph: KernelGraph) -> int:
    return sum(op.kind != "input" for op in graph.ops)


def _search_split(spec, cfg, engine_factory, verifier, start, deadline, stats, counters, found) -> str | None:
    """Search the head and the tail of the spec's output split (mirage_serve.search.split),
    stitch their best candidates and verify every stitched graph against the whole spec.
    Returns the hash of the best candidate found (None when there is no split or none verified)."""
    from mirage_serve.search.split import output_split, stitch

    split = output_split(spec)
    if split is None:
        return None

    def share(frac: float) -> float | None:
        return None if deadline is None else max(1e-3, frac * (deadline - time.monotonic()))

    def sub_search(sub: KernelGraph, frac: float, max_ops: int) -> list[KernelGraph]:
        if max_ops < 1:
            return []
        if deadline is not None and time.monotonic() >= deadline:
            counters.truncated = True
            return []
        sub_cfg = cfg.replace(time_budget_s=share(frac), max_kernel_ops=max_ops)
        res = superoptimize(sub, sub_cfg, engine_factory=engine_factory, verifier=verifier)
        s = res.stats
        counters.enumerated += s.enumerated
        counters.pruned_abstract += s.pruned_abstract
        counters.pruned_other += s.pruned_other
        counters.block_nodes += s.block_nodes
        counters.structures += s.structures
        counters.truncated |= not s.complete
        return [c.graph for c in res.candidates[:SPLIT_CANDIDATES]]

    # a stitched graph has the head's kernel operators plus the tail's: together within max_kernel_ops
    body = [op for op in split.head.ops if op.kind != "input"]
    if len(body) == 1:
        heads = [split.head]  # one pre-defined operator: its plain form is the graph
    else:
        heads = sub_search(split.head, SPLIT_HEAD_SHARE, cfg.max_kernel_ops - 1) or [split.head]
    tail_ops = cfg.max_kernel_ops - min(_kernel_ops(h) for h in heads)
    tails = sub_search(split.tail, SPLIT_TAIL_SHARE, tail_ops)
    log.info("output split at output %d: %d head and %d tail candidates to stitch", split.output_index, len(heads), len(tails))
    best_hash = None
    for h in heads:
        for t in tails:
            if _kernel_ops(h) + _kernel_ops(t) > cfg.max_kernel_ops:
                continue
            g = stitch(spec, split, h, t)
            key = content_hash(g)
            if key in found:
                continue
            try:
                cert = verifier(g, spec, trials=cfg.trials, seed=cfg.seed, float_check=cfg.float_check)
            except Exception as e:  # a verifier failure must never let a candidate through
                log.warning("verification of a stitched candidate failed (%s: %s); not kept", type(e).__name__, e)
                cert = None
            if getattr(cert, "verdict", None) != "equivalent":
                stats.rejected += 1
                continue
            stats.verified += 1
            now = time.monotonic() - start
            if stats.time_to_first_s is None:
                stats.time_to_first_s = now
            cost = graph_cost(g, cfg.target)
            found[key] = Candidate(g, cert, cost.seconds, cost, key, numerically_safe(g, spec))
            cur = min(found.values(), key=rank_key).hash
            if cur != best_hash:
                best_hash = cur
                stats.time_to_best_s = now
    return best_hash


def _run_level(states, level, final, spec, cfg, runner, vocab, counters, stats, found, seen_structures, start, over,
               tqdm, best_hash):
    """Expand every prefix by one operator; verify the complete structures found.
    Returns (prefixes for the next level, terminated, hash of the best candidate).

    Map choices are enumerated in rounds of growing node budgets (iterative
    broadening): round 0 gives each choice ``cfg.first_block_nodes`` block-graph
    prefixes, each later round four times as many (at most ``cfg.max_block_nodes``)
    to the choices the previous round cut short, so a choice whose operator space
    is small is searched in full before a large one is, whatever their order."""
    n_out = len(spec.outputs)
    tasks = _plan_level(states, cfg, counters, over, vocab, final, n_out, _spec_vars(spec))
    next_states: list[KernelState] = []
    next_keys: set[tuple[str, ...]] = set()
    terminated = False
    node_budget = min(cfg.first_block_nodes, cfg.max_block_nodes)
    round_no = 0
    while tasks:
        tasks = [t + (node_budget,) if t[0] == "blk" else t for t in tasks]
        bar = tqdm(total=len(tasks), desc=f"search level {level}{' (final)' if final else ''}"
                   + (f", round {round_no} ({node_budget} nodes per choice)" if round_no else ""),
                   disable=not cfg.progress or tqdm is None, leave=False) if tqdm else None
        unfinished: list[tuple] = []
        wave = max(2, 2 * runner.jobs)  # small waves: structures are verified soon after they are found
        for w0 in range(0, len(tasks), wave):
            structures: list[KernelGraph] = []
            for res in runner.imap(tasks[w0 : w0 + wave]):
                counters.add(res["counters"])
                unfinished.extend(res.get("unfinished", ()))
                for g in res["structures"]:
                    h = content_hash(g)
                    if h not in seen_structures:
                        seen_structures.add(h)
                        structures.append(g)
                if not final:
                    for st in res["states"]:
                        if len(next_states) >= cfg.max_states:
                            counters.truncated = True
                            break
                        k = _state_key(st)
                        if k not in next_keys:
                            next_keys.add(k)
                            next_states.append(st)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(enum=counters.enumerated, pruned=counters.pruned_abstract + counters.pruned_other,
                                    structures=len(seen_structures), verified=len(found))
                if over():
                    break
            # verify what this wave completed before enumerating further: early first results
            best_hash = _verify_structures(structures, spec, cfg, runner, stats, found, counters, start, over, best_hash,
                                           seen_structures)
            if over():
                counters.truncated = True
                terminated = True
                break
        if bar is not None:
            bar.close()
        if terminated or not unfinished:
            break
        if node_budget >= cfg.max_block_nodes:
            counters.truncated = True  # choices the largest budget could not finish
            log.info("level %d: %d map choices not finished within %d block nodes each", level,
                     sum(len(t[3]) for t in unfinished), node_budget)
            break
        node_budget = min(4 * node_budget, cfg.max_block_nodes)
        round_no += 1
        tasks = _split_choice_tasks(unfinished, cfg)
    log.info("level %d%s: %d rounds, %d structures so far, %d prefixes kept, %d verified", level, " (final)" if final else "",
             round_no + 1, len(seen_structures), len(next_states), len(found))
    return next_states, terminated, best_hash


def _split_choice_tasks(tasks: list[tuple], cfg: SearchConfig) -> list[tuple]:
    """Tasks of at most a few map choices each, so both workers stay busy."""
    total = sum(len(t[3]) for t in tasks)
    per = max(1, -(-total // (8 * max(1, cfg.jobs))))
    out = []
    for kind, st, sources, choices, max_outputs in tasks:
        for i in range(0, len(choices), per):
            out.append((kind, st, sources, choices[i : i + per], max_outputs))
    return out


def _spec_vars(spec: KernelGraph) -> frozenset[str]:
    """Names of the kernel inputs the spec's outputs depend on."""
    from mirage_serve.search.abstract import graph_exprs

    exprs = graph_exprs(spec)
    return frozenset().union(*(_vars_of(exprs[t]) for t in spec.outputs))


def _vars_of(expr) -> frozenset[str]:
    return frozenset(t.value for t in expr.subterms() if t.op == "var")


def _plan_level(states: list[KernelState], cfg: SearchConfig, counters: Counters, over, vocab: Vocabulary,
                final: bool = False, n_out: int = 1, spec_vars: frozenset[str] = frozenset()) -> list[tuple]:
    """Tasks expanding each prefix by one operator. In a final level the new
    customized operator's outputs must be the spec's outputs: at most ``n_out`` of
    them, reading tensors that together depend on every input the spec's outputs
    depend on (an output cannot depend on an input its operator never reads)."""
    from mirage_serve.search.abstract import graph_exprs

    tasks: list[tuple] = []
    blk: list[tuple] = []
    for st in states:
        if over():
            counters.truncated = True
            break
        tasks.append(("pre", st))
        if st.num_customized >= cfg.max_customized:
            continue
        g = prefix_graph(st.ops)
        infos = list(g.info)
        labels = kernel_labels(g, vocab.labels)
        exprs = graph_exprs(g) if final else None
        for sources in customized_sources(st, infos, cfg.max_block_inputs):
            if final and not spec_vars <= frozenset().union(*(_vars_of(exprs[s]) for s in sources)):
                counters.pruned_abstract += 1
                continue
            src_infos = [infos[s] for s in sources]
            src_labels = [labels[s] for s in sources]
            choices = map_choices(src_infos, cfg.max_grid_dims, counters, src_labels, vocab.labels)
            fitting = [c for c in choices if min_input_tile_bytes(c, src_infos, cfg) <= cfg.target.smem_per_block]
            if final and vocab.labels is not None:
                fitting = [c for c in fitting if final_grid_ok(c, src_labels, vocab.labels)]
            counters.pruned_other += len(choices) - len(fitting)
            if not fitting:
                continue
            max_outputs = min(cfg.max_block_outputs, n_out) if final else cfg.max_block_outputs
            blk.append(("blk", st, sources, fitting, max_outputs))
    return tasks + _split_choice_tasks(blk, cfg)


def _verify_structures(structures, spec, cfg, runner, stats, found, counters, start, over, best_hash,
                       seen_structures=None, rewrite=True):
    """Instantiate each structure, verify its best few instantiations (cheapest
    structures first) and record the equivalent ones. With ``cfg.rewrites``, the
    rewrites (mirage_serve.search.rewrite) of every structure that verified are
    then instantiated and verified the same way."""
    todo: list[tuple[float, str, KernelGraph, KernelGraph]] = []
    for g in structures:
        inst = instantiations(g, cfg, counters)
        kept = 0
        for cost_s, ig in inst:
            h = content_hash(ig)
            if h in found or any(h == t[1] for t in todo):
                continue
            todo.append((cost_s, h, ig, g))
            kept += 1
            if kept >= cfg.instantiations_per_structure:
                break
    todo.sort(key=lambda t: (t[0], t[1]))
    if not todo or over():
        if todo:
            counters.truncated = True
        return best_hash
    verified_structures: list[tuple[float, KernelGraph]] = []
    for (cost_s, h, ig, g), res in zip(todo, runner.imap([("verify", t[2]) for t in todo]), strict=False):
        cert = res["cert"]
        if getattr(cert, "verdict", None) == "equivalent":
            stats.verified += 1
            now = time.monotonic() - start
            if stats.time_to_first_s is None:
                stats.time_to_first_s = now
            found[h] = Candidate(ig, cert, cost_s, graph_cost(ig, cfg.target), h, numerically_safe(ig, spec))
            cur_best = min(found.values(), key=rank_key).hash
            if cur_best != best_hash:
                best_hash = cur_best
                stats.time_to_best_s = now
            if not any(g is v for _, v in verified_structures):
                verified_structures.append((cost_s, g))
        else:
            stats.rejected += 1
            log.debug("rejected (%s): %s", getattr(cert, "verdict", cert), h[:12])
        if over():
            counters.truncated = True
            break
    if rewrite and cfg.rewrites and verified_structures and not over():
        # the cheapest few: each rewrite costs its own instantiations' verification
        sources = [g for _, g in sorted(verified_structures, key=lambda t: t[0])[:REWRITE_SOURCES]]
        derived = _rewritten_structures(sources, cfg, seen_structures)
        if derived:
            log.info("verifying %d rewritten structure(s) of %d verified one(s)", len(derived), len(verified_structures))
            best_hash = _verify_structures(derived, spec, cfg, runner, stats, found, counters, start, over, best_hash,
                                           seen_structures, rewrite=False)
    return best_hash


def _rewritten_structures(structures, cfg: SearchConfig, seen_structures) -> list[KernelGraph]:
    """New structures from mirage_serve.search.rewrite.variants within the kernel limits."""
    from mirage_serve.search.rewrite import variants

    out = []
    for g in structures:
        for v in variants(g):
            n_ops = sum(op.kind != "input" for op in v.ops)
            n_cust = sum(op.kind == "customized" for op in v.ops)
            if n_ops > cfg.max_kernel_ops or n_cust > cfg.max_customized:
                continue
            h = content_hash(v)
            if seen_structures is not None:
                if h in seen_structures:
                    continue
                seen_structures.add(h)
            elif any(content_hash(u) == h for u in out):
                continue
            out.append(v)
    return out
