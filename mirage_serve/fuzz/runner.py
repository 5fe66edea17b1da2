"""The fuzzing loop: generate cases, run every oracle, count, minimise and save findings.

A case is one random origin and the graphs derived from it:

* ``program``: a random fused program (:mod:`mirage_serve.fuzz.programs`) lowered
  unfused (the spec), under two random tilings and rewritten at kernel level;
  all four agree in the float64 reference; the verifier must accept each
  rewrite against the spec; a mutant is judged against float64; the two block
  lowerings go through the code generator.
* ``kernel``: a random kernel graph of pre-defined operators, a rewrite and a
  mutant (reference, verifier), and the compiled graph (torch operators).
* ``block``: a random block graph without a spec: the code generator against
  the reference, and a mutant against float64.

Some code-generator runs get NaN/Inf written into their inputs (faults) or run
fewer rows than the bucket. Everything derives from ``(seed, case index)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mirage_serve.fuzz import blocks, kernels, programs
from mirage_serve.fuzz.oracles import Finding, check_codegen, check_reference_agrees, check_verifier
from mirage_serve.fuzz.shrink import minimise
from mirage_serve.mugraph.graph import KernelGraph, MuGraphError
from mirage_serve.mugraph.serialize import graph_to_obj

log = logging.getLogger(__name__)

KIND_WEIGHTS = {"program": 5, "kernel": 2, "block": 3}


@dataclass
class FuzzConfig:
    seed: int = 0
    minutes: float | None = None
    max_cases: int | None = None
    codegen: bool = True
    verifier: bool = True
    fault_rate: float = 0.25  # code-generator runs with NaN/Inf in the inputs
    rows_rate: float = 0.2  # code-generator runs with fewer rows than the bucket
    minimise_s: float = 60.0
    minimise_per_tag: int = 50  # findings minimised per (check, tag); the rest are only counted
    out_dir: Path | None = None  # minimised findings are written here as JSON
    kinds: tuple[str, ...] = ("program", "kernel", "block")


@dataclass
class FuzzReport:
    config: dict[str, Any]
    cases: Counter = field(default_factory=Counter)
    graphs: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)
    faults: int = 0
    findings: list[dict[str, Any]] = field(default_factory=list)
    explained: Counter = field(default_factory=Counter)
    elapsed_s: float = 0.0
    errors: Counter = field(default_factory=Counter)
    crashes: list[dict[str, str]] = field(default_factory=list)

    def to_obj(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "cases": dict(self.cases),
            "graphs": dict(self.graphs),
            "outcomes": {" | ".join(k) if isinstance(k, tuple) else k: v for k, v in sorted(self.outcomes.items(), key=str)},
            "faults_injected": self.faults,
            "findings": self.findings,
            "explained": dict(self.explained),
            "generator_errors": dict(self.errors),
            "crashes": self.crashes,
            "elapsed_s": round(self.elapsed_s, 1),
        }


    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> FuzzReport:
        """A report read back from :meth:`to_obj`'s JSON."""
        r = cls(obj["config"], Counter(obj["cases"]), Counter(obj["graphs"]),
                Counter({tuple(k.split(" | ")): v for k, v in obj["outcomes"].items()}), obj["faults_injected"],
                list(obj["findings"]), Counter(obj["explained"]), obj["elapsed_s"], Counter(obj["generator_errors"]), list(obj["crashes"]))
        return r


def merge_reports(reports: list[FuzzReport]) -> FuzzReport:
    """The counts of several runs added up (findings and crashes listed together)."""
    out = FuzzReport({"runs": [r.config for r in reports]})
    for r in reports:
        for mine, theirs in ((out.cases, r.cases), (out.graphs, r.graphs), (out.outcomes, r.outcomes),
                             (out.explained, r.explained), (out.errors, r.errors)):
            mine.update(theirs)
        out.faults += r.faults
        out.findings += r.findings
        out.crashes += r.crashes
        out.elapsed_s += r.elapsed_s
    return out


def case_seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"fuzz:{seed}:{index}".encode()).digest()[:6], "little")


class Fuzzer:
    def __init__(self, config: FuzzConfig) -> None:
        self.cfg = config
        cfg_obj = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(config).items()}
        self.report = FuzzReport(cfg_obj)
        self._minimised: Counter = Counter()
        self._signatures: dict[str, dict[str, Any]] = {}

    # -- bookkeeping ----------------------------------------------------------------
    def _finding(self, f: Finding, still_fails, case: str, joint_only: bool = False) -> None:
        """Count, minimise (unless ``joint_only``: pairs that must stay lowerings or rewrites of one
        program, where shrinking shapes would also change the size-derived constants), dedupe, save."""
        r = self.report
        if f.explained:
            r.explained[f"{f.check}: {f.explained}"] += 1
            return
        key = (f.check, f.tag)
        graphs = f.graphs
        if self._minimised[key] < self.cfg.minimise_per_tag and not joint_only:
            self._minimised[key] += 1
            try:
                graphs = minimise(f.graphs, still_fails, budget_s=self.cfg.minimise_s, joint_only=joint_only)
            except Exception as e:  # noqa: BLE001 - keep the unminimised finding
                log.warning("minimising %s failed: %s", key, e)
        sig = _signature(f, graphs)
        entry = self._signatures.get(sig)
        if entry is not None:
            entry["count"] += 1
            return
        detail = f.detail
        try:
            again = still_fails(graphs, detail=True)
            if isinstance(again, str):
                detail = again
        except Exception:  # noqa: BLE001
            pass
        entry = {"check": f.check, "tag": f.tag, "detail": detail, "case": case, "count": 1, "signature": sig,
                 "known_cause": known_cause(f.check, f.tag, graphs),
                 "data": f.data, "graphs": {n: graph_to_obj(g) for n, g in graphs.items()}}
        self._signatures[sig] = entry
        r.findings.append(entry)
        log.warning("finding %s/%s in %s: %s", f.check, f.tag, case, detail)
        if self.cfg.out_dir is not None:
            self.cfg.out_dir.mkdir(parents=True, exist_ok=True)
            name = f"{f.check}-{f.tag}-{sig[:10]}.json"
            (self.cfg.out_dir / name).write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")

    def _codegen(self, g: KernelGraph, seed: int, rng: random.Random, label: str, case: str) -> None:
        faults = 1 + rng.randrange(2) if rng.random() < self.cfg.fault_rate else 0
        rows = rng.randint(1, 3) if rng.random() < self.cfg.rows_rate else None
        res = check_codegen(g, seed, faults=faults, rows=rows)
        self.report.faults += faults
        kind = "codegen+faults" if faults else "codegen"
        self.report.outcomes[(kind, res.outcome, res.tag)] += 1
        if res.rows is not None and res.outcome == "pass":
            self.report.outcomes[("codegen", "pass", f"{res.rows} rows of a larger bucket")] += 1
        if res.finding is not None:

            def still(gs, detail=False, _tag=res.tag, _s=seed, _f=faults, _r=rows):
                rr = check_codegen(gs["graph"], _s, faults=_f, rows=_r)
                if detail:
                    return rr.finding.detail if rr.finding else False
                return rr.outcome == "finding" and rr.tag == _tag

            res.finding.data.update({"label": label})
            self._finding(res.finding, still, case)

    def _verify(self, cand: KernelGraph, spec: KernelGraph, seed: int, expect: str | None, what: str, label: str, case: str) -> None:
        res = check_verifier(cand, spec, seed, expect=expect, what=what)
        kind = "verifier:rewrite" if expect == "same" else "verifier:mutant"
        self.report.outcomes[(kind, f"truth {res.truth}", f"verdict {res.verdict}", res.outcome, res.tag)] += 1
        if res.finding is not None:

            def still(gs, detail=False, _tag=res.tag, _s=seed, _e=expect, _w=what):
                rr = check_verifier(gs["candidate"], gs["spec"], _s, expect=_e, what=_w)
                if detail:
                    return rr.finding.detail if rr.finding else False
                return rr.finding is not None and rr.tag == _tag and not rr.finding.explained

            res.finding.data.update({"label": label, "what": what})
            # a pair that should be equal but differs stays "different" whenever one side alone shrinks
            self._finding(res.finding, still, case, joint_only=res.tag == "rewrite-not-equivalent")

    def _reference(self, graphs: dict[str, KernelGraph], seed: int, case: str) -> None:
        f = check_reference_agrees(graphs, seed)
        self.report.outcomes[("reference", "agree" if f is None else ("explained" if f.explained else "finding"), "" if f is None else f.tag)] += 1
        if f is not None:
            names = list(f.graphs)

            def still(gs, detail=False, _tag=f.tag, _s=seed):
                ff = check_reference_agrees(gs, _s)
                if detail:
                    return ff.detail if ff else False
                return ff is not None and ff.tag == _tag

            f.graphs = {n: f.graphs[n] for n in names}
            self._finding(f, still, case, joint_only=True)  # the two lowerings must stay lowerings of one program

    def _mutant(self, base: KernelGraph, spec: KernelGraph, rng: random.Random, seed: int, origin: str, case: str) -> None:
        """A mutant of ``base`` (if the mutator finds one) judged against ``spec`` by float64."""
        m = kernels.mutate(base, rng)
        if m is not None:
            self.report.graphs["mutant"] += 1
            self._verify(m[0], spec, seed, None, f"{origin} mutant: {m[1]}", "mutant", case)

    # -- cases ----------------------------------------------------------------------
    def case(self, index: int) -> None:
        seed = case_seed(self.cfg.seed, index)
        rng = random.Random(seed)
        kind = rng.choices(list(self.cfg.kinds), [KIND_WEIGHTS[k] for k in self.cfg.kinds])[0]
        name = f"seed {self.cfg.seed} case {index} ({kind})"
        self.report.cases[kind] += 1
        try:
            getattr(self, f"_case_{kind}")(rng, seed, name)
        except (MuGraphError, programs.Reject) as e:
            self.report.errors[f"{kind}: {type(e).__name__}"] += 1
            log.debug("case %s: generator gave up: %s", name, e)
        except Exception as e:  # noqa: BLE001 - the run goes on; the failure is reported with its traceback
            self.report.errors[f"{kind}: unexpected {type(e).__name__}"] += 1
            if len(self.report.crashes) < 20:
                self.report.crashes.append({"case": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            log.warning("case %s raised %s: %s", name, type(e).__name__, e)

    def _case_program(self, rng: random.Random, seed: int, name: str) -> None:
        prog = programs.random_program(rng)
        spec = programs.lower_spec(prog)
        tilings = [programs.random_tiling(prog, rng) for _ in range(2)]
        lowered = [programs.lower_block(prog, t) for t in tilings]
        spec_rw, applied = kernels.rewrite(spec, rng, rng.randint(1, 2))
        g = self.report.graphs
        g["program: unfused spec"] += 1
        g["program: block lowering"] += len(lowered)
        g["program: kernel-level rewrite"] += 1
        self._reference({"spec": spec, "tiling-a": lowered[0], "tiling-b": lowered[1], "rewrite": spec_rw}, seed, name)
        if self.cfg.verifier:
            self._verify(lowered[0], spec, seed, "same", f"{prog.skeleton} lowered with {tilings[0].describe()}", "tiling-a", name)
            self._verify(spec_rw, spec, seed, "same", f"{prog.skeleton} spec rewritten ({', '.join(applied)})", "rewrite", name)
            self._mutant(rng.choice((lowered[1], lowered[0], spec)), spec, rng, seed, prog.skeleton, name)
        if self.cfg.codegen:
            for j, lg in enumerate(lowered):
                self._codegen(lg, seed + j, rng, f"tiling-{'ab'[j]}", name)

    def _case_kernel(self, rng: random.Random, seed: int, name: str) -> None:
        graph = kernels.random_kernel_graph(rng)
        rw, applied = kernels.rewrite(graph, rng, rng.randint(1, 3))
        g = self.report.graphs
        g["kernel graph"] += 1
        g["kernel graph: rewrite"] += 1
        self._reference({"graph": graph, "rewrite": rw}, seed, name)
        if self.cfg.verifier:
            self._verify(rw, graph, seed, "same", f"kernel graph rewritten ({', '.join(applied)})", "rewrite", name)
            self._mutant(graph, graph, rng, seed, "kernel graph", name)
        if self.cfg.codegen:
            self._codegen(graph, seed, rng, "graph", name)

    def _case_block(self, rng: random.Random, seed: int, name: str) -> None:
        graph = blocks.random_block_graph(rng)
        self.report.graphs["free block graph"] += 1
        if self.cfg.verifier:
            self._mutant(graph, graph, rng, seed, "block graph", name)
        if self.cfg.codegen:
            self._codegen(graph, seed, rng, "graph", name)

    # -- loop -----------------------------------------------------------------------
    def run(self) -> FuzzReport:
        t0 = time.monotonic()
        deadline = t0 + self.cfg.minutes * 60 if self.cfg.minutes else None
        i = 0
        while (self.cfg.max_cases is None or i < self.cfg.max_cases) and (deadline is None or time.monotonic() < deadline):
            self.case(i)
            i += 1
            if i % 100 == 0:
                log.info("%d cases, %d graphs, %d findings, %.0fs", i, sum(self.report.graphs.values()), len(self.report.findings), time.monotonic() - t0)
        self.report.elapsed_s = time.monotonic() - t0
        return self.report


# Root causes diagnosed but not yet fixed, as (check, tag, cause, predicate on the graphs):
# findings that match are grouped under the cause (still findings; each needs a strict-xfail
# regression, see tests/fuzz/test_fuzz_regressions.py). Empty: every cause found so far is
# fixed, so a finding of any kind is new.
KNOWN_CAUSES: list[tuple[str, str, str, Any]] = []


def known_cause(check: str, tag: str, graphs: dict[str, KernelGraph]) -> str | None:
    """The diagnosed open cause (:data:`KNOWN_CAUSES`) a finding belongs to, or None."""
    for c, t, cause, pred in KNOWN_CAUSES:
        if c == check and t == tag and pred(graphs):
            return cause
    return None


def _signature(f: Finding, graphs: dict[str, KernelGraph]) -> str:
    """Findings with the same check, tag and operator kinds (after minimising) are one,
    and so are findings of one known cause."""
    cause = known_cause(f.check, f.tag, graphs)
    if cause is not None:
        return hashlib.sha256(json.dumps([f.check, f.tag, cause]).encode()).hexdigest()[:16]
    kinds = set()
    for g in graphs.values():
        for op in g.ops:
            if op.kind == "input":
                continue
            kinds.add(op.describe().split("(")[0] + ":" + str(op.attr("fn", "")))
            if op.block is not None:
                kinds.update("b:" + o.kind + ":" + str(o.attr("fn", "")) for o in op.block.ops)
    return hashlib.sha256(json.dumps([f.check, f.tag, sorted(kinds)]).encode()).hexdigest()[:16]


def run_fuzz(config: FuzzConfig) -> FuzzReport:
    """Run the fuzzer (see the module docstring); returns the counts and findings."""
    return Fuzzer(config).run()


def format_report(report: FuzzReport) -> str:
    """The summary as Markdown tables: cases and graphs, outcomes per check, findings."""
    lines = [f"{sum(report.cases.values())} cases, {sum(report.graphs.values())} graphs, {report.faults} NaN/Inf faults injected, "
             f"{report.elapsed_s / 60:.1f} min", "", "| cases by kind | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(report.cases.items())]
    lines += ["", "| graphs by origin | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(report.graphs.items())]
    lines += ["", "| check | outcome | count |", "|---|---|---|"]
    for k, v in sorted(report.outcomes.items(), key=lambda kv: (str(kv[0][0]), -kv[1])):
        check, rest = k[0], [x for x in k[1:] if x]
        lines.append(f"| {check} | {' / '.join(rest)} | {v} |")
    if report.explained:
        lines += ["", "| explained deviation | count |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in report.explained.most_common()]
    lines += ["", f"{len(report.findings)} distinct finding(s)"]
    for f in report.findings:
        cause = f" [known cause: {f['known_cause']}]" if f.get("known_cause") else ""
        lines.append(f"- {f['check']}/{f['tag']} x{f['count']} ({f['case']}): {f['detail']}{cause}")
    if report.errors:
        lines += ["", "generator gave up or raised: " + ", ".join(f"{k} x{v}" for k, v in report.errors.items())]
    for c in report.crashes:
        lines.append(f"- {c['case']}: {c['error']}")
    return "\n".join(lines)
