"""Probabilistic equivalence of two μGraphs by random testing over Z_p x Z_q.

Both programs run under :class:`~mirage_serve.verify.field.FieldAlgebra` (the
same interpreter as the float reference, :func:`mirage_serve.reference.run_graph`)
on the same uniformly random inputs in Z_p x Z_q; every output element is
compared. Each trial draws a different safe prime p = 2q + 1 (2^19 <= p < 2^20,
1938 of them), a fresh ω of order q, fresh inputs, fresh random functions and
fresh images of float constants.

What the model interprets exactly: +, -, *, matmul, sums, mean (times the
inverse of the integer count), division (times the modular inverse), ``exp``
(ω^(x mod q), so exp(a+b) = exp(a)exp(b) and exp(a-b) = exp(a)/exp(b)).

What it does not, and how each is handled soundly:

* ``sqrt``, ``silu``: uninterpreted functions, i.e. truly random functions drawn
  per trial (lookup tables indexed by the p-residue, nonzero outputs) that both
  programs share. ``rsqrt(y) = 1/sqrt(y)``, ``rms_last = sqrt(mean_sq)``,
  ``recip(y) = 1/y``, ``square(y) = y*y``. Programs equal only through facts about
  these functions (sqrt(y)^2 = y, silu(x) = x·sigmoid(x)) are reported
  not_equivalent: incomplete, never a false "equivalent".
* Float constants (eps, ``mul_scalar``/``add_scalar``, attention scales): mapped
  to field elements keyed by their exact float value, so equal constants on both
  sides are equal elements and a changed eps is a different element. Small
  dyadic rationals and reciprocals of small integers map to their exact image
  (see :meth:`TrialContext.constant`); any other value to a random element.
* ``max`` (reductions and the running max of ``max_last``): every call returns
  fresh uniformly random values. A correct softmax does not depend on the max
  (the subtraction cancels in the normalisation; online rescaling telescopes),
  so random maxima test exactly that. A spec evaluated with two independent max
  draws that gives different outputs depends on the max: verdict "unknown". A
  candidate that disagrees with the (max-independent) spec is run again with
  other max draws; if its output moves, it depends on the max and the verdict is
  "unknown" (it might compute max(x) twice and rely on the two being equal,
  which the model cannot see); if it does not move, "not_equivalent".
* Division by a value that is 0 mod p: the trial is redrawn (counted in
  ``redraws``); never a silent division by zero. A denominator that is 0 mod q
  only leaves that value's exponent residue undefined.
* ``exp`` of a value whose exponent residue is undefined (exp of exp, exp of a
  quotient whose denominator was 0 mod q): verdict "unknown".
* When neither graph contains ``exp`` (nor a rescaling accumulator), exponent
  residues are never read, so the q-components are not computed at all.

False-positive bound (Schwartz–Zippel): if two programs differ as functions in
this model, some output element is a nonzero rational function of the random
inputs, the random-function values, the constants and the maxima, of total degree
at most d (its exponent arguments, over Z_q, also of degree at most d); a single
trial then passes with probability at most d/q (+ d/p for the p-component and
for collisions of random-function arguments, which is smaller). For the programs
here (matmul chains of depth <= 3 inside normalisations and a division) d <= 64;
with q >= 262193 a trial passes wrongly with probability <= 64/262193 < 2.5e-4,
and the default three independent trials (distinct primes) with probability
< 1.5e-11. The max-dependence test costs one more such draw. Passing trials never
prove more than that; a failing trial is a certain difference in the model.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from mirage_serve.mugraph.graph import KernelGraph, MuGraphError
from mirage_serve.reference import run_graph
from mirage_serve.verify.field import (
    FieldAlgebra,
    FieldValue,
    TrialContext,
    Undecidable,
    ZeroDenominator,
    derive_seed,
    safe_primes,
)

log = logging.getLogger(__name__)

DEFAULT_TRIALS = 3
MAX_REDRAWS = 8  # per trial
INPUT_CACHE_BYTES = 768 << 20  # per cached trial: reuse drawn inputs for the candidates up to this size


@dataclass
class FieldResult:
    """Outcome of finite-field testing: verdict, why, and what was drawn."""

    verdict: str  # equivalent | not_equivalent | unknown
    reason: str
    primes: list[int] = field(default_factory=list)
    omegas: list[int] = field(default_factory=list)
    trials: int = 0  # trials completed
    redraws: int = 0
    max_calls: int = 0  # max draws the candidate consumed in its last run
    elapsed_s: float = 0.0


def signature_mismatch(candidate: KernelGraph, spec: KernelGraph) -> str | None:
    """Why two graphs cannot compute the same function (inputs or outputs differ
    in number, shape or dtype), or None when their signatures agree."""
    ci, si = candidate.info, spec.info
    c_in = [(ci[t].shape, ci[t].dtype) for t in candidate.input_ids]
    s_in = [(si[t].shape, si[t].dtype) for t in spec.input_ids]
    if len(c_in) != len(s_in):
        return f"candidate takes {len(c_in)} inputs, the spec {len(s_in)}"
    for j, (a, b) in enumerate(zip(c_in, s_in)):
        if a != b:
            return f"input {j} is {a[1]}{list(a[0])} in the candidate but {b[1]}{list(b[0])} in the spec"
    c_out = [(ci[t].shape, ci[t].dtype) for t in candidate.outputs]
    s_out = [(si[t].shape, si[t].dtype) for t in spec.outputs]
    if len(c_out) != len(s_out):
        return f"candidate has {len(c_out)} outputs, the spec {len(s_out)}"
    for j, (a, b) in enumerate(zip(c_out, s_out)):
        if a != b:
            return f"output {j} is {a[1]}{list(a[0])} in the candidate but {b[1]}{list(b[0])} in the spec"
    return None


def uses_exp(graph: KernelGraph) -> bool:
    """Whether any operator of the graph (at either level) exponentiates."""
    for op in graph.ops:
        if op.kind == "unary" and op.attr("fn") == "exp":
            return True
        if op.block is not None:
            for bop in op.block.ops:
                if bop.kind == "unary" and bop.attr("fn") == "exp":
                    return True
                if bop.kind == "accum" and str(bop.attr("fn")).startswith("rescaled"):
                    return True
    return False


def _draw_inputs(graph: KernelGraph, ctx: TrialContext) -> list[FieldValue]:
    vals = []
    for j, t in enumerate(graph.input_ids):
        shape = graph.info[t].shape
        gp = torch.Generator().manual_seed(derive_seed(ctx.seed, "input", j, "p"))
        p = torch.randint(0, ctx.p, shape, generator=gp, dtype=torch.float64)
        q = None
        if ctx.track_q:
            gq = torch.Generator().manual_seed(derive_seed(ctx.seed, "input", j, "q"))
            q = torch.randint(0, ctx.q, shape, generator=gq, dtype=torch.float64)
        vals.append(FieldValue(p, q, "not tracked"))
    return vals


def _run(graph: KernelGraph, inputs: list[FieldValue], ctx: TrialContext, label: str) -> tuple[list[torch.Tensor], int]:
    alg = FieldAlgebra(ctx, derive_seed(ctx.seed, "max", label))
    outs = run_graph(graph, inputs, alg)
    return [o.p.expand(o.shape) for o in outs], alg.max_calls


def _first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> str | None:
    for j, (x, y) in enumerate(zip(a, b)):
        ne = x != y
        n = int(ne.sum())
        if n:
            idx = [int(i) for i in torch.nonzero(ne)[0]]
            return f"output {j} differs at {n} of {ne.numel()} elements (first at index {idx})"
    return None


@dataclass
class _SpecRun:
    ctx: TrialContext
    outputs: list[torch.Tensor] | None  # None: redraw needed
    problem: str | None = None  # set: the spec is undecidable here
    inputs: list[FieldValue] | None = None  # kept when small enough (INPUT_CACHE_BYTES)


class FieldVerifier:
    """Finite-field tester for candidates against one spec. Spec evaluations are
    cached per (trial, redraw), so checking many candidates (``verify --all``)
    evaluates the spec once; results are deterministic for a given seed."""

    def __init__(self, spec: KernelGraph, *, trials: int = DEFAULT_TRIALS, seed: int = 0, max_redraws: int = MAX_REDRAWS) -> None:
        if trials < 1:
            raise ValueError(f"trials={trials}: at least one trial is needed")
        pool = safe_primes()
        if trials > len(pool):
            raise ValueError(f"trials={trials}: there are only {len(pool)} safe primes in range")
        self.spec = spec.validate()
        self.trials = trials
        self.seed = seed
        self.max_redraws = max_redraws
        self.primes = random.Random(derive_seed(seed, "primes")).sample(pool, trials)
        self._spec_exp = uses_exp(spec)
        self._cache: OrderedDict[tuple[int, int, bool], _SpecRun] = OrderedDict()

    def _spec_run(self, trial: int, attempt: int, track_q: bool) -> tuple[_SpecRun, list[FieldValue] | None]:
        """The spec's run for this draw and its inputs: those the run keeps, or those just drawn for
        it (not kept when large, but the candidate of this same trial reuses them instead of drawing
        them again), or None when a cached run did not keep them."""
        key = (trial, attempt, track_q)
        if key in self._cache:
            self._cache.move_to_end(key)
            run = self._cache[key]
            return run, run.inputs
        ctx = TrialContext.draw(self.primes[trial], derive_seed(self.seed, "trial", trial, attempt), track_q)
        inputs = _draw_inputs(self.spec, ctx)
        try:
            outs, calls = _run(self.spec, inputs, ctx, "spec-a")
            run = _SpecRun(ctx, outs)
            if calls:
                other, _ = _run(self.spec, inputs, ctx, "spec-b")
                diff = _first_difference(outs, other)
                if diff:
                    run.problem = f"the spec's output depends on the values max returns ({diff} between two max draws)"
        except ZeroDenominator:
            run = _SpecRun(ctx, None)
        except Undecidable as e:
            run = _SpecRun(ctx, None, f"the spec is outside the finite-field model: {e}")
        nbytes = sum(x.p.numel() * (2 if x.q is not None else 1) * 8 for x in inputs)
        if nbytes <= INPUT_CACHE_BYTES:
            run.inputs = inputs
        self._cache[key] = run
        while len(self._cache) > self.trials + 2:
            self._cache.popitem(last=False)
        return run, inputs

    def check(self, candidate: KernelGraph) -> FieldResult:
        """Test ``candidate`` against the spec; never "equivalent" for an undecidable pair."""
        t0 = time.perf_counter()
        res = FieldResult("equivalent", "", trials=0)

        def done(verdict: str, reason: str) -> FieldResult:
            res.verdict, res.reason = verdict, reason
            res.elapsed_s = time.perf_counter() - t0
            log.info("finite-field check: %s (%s) after %d trial(s), %.2fs", verdict, reason, res.trials, res.elapsed_s)
            return res

        try:
            candidate.validate()
        except MuGraphError as e:
            return done("not_equivalent", f"candidate is not a valid μGraph: {e}")
        mismatch = signature_mismatch(candidate, self.spec)
        if mismatch:
            return done("not_equivalent", mismatch)
        track_q = self._spec_exp or uses_exp(candidate)
        for trial in range(self.trials):
            for attempt in range(self.max_redraws + 1):
                inputs = outs = again = None  # the last trial's tensors are not held while this one draws
                srun, drawn = self._spec_run(trial, attempt, track_q)
                if srun.problem:
                    return done("unknown", srun.problem)
                if srun.outputs is None:
                    res.redraws += 1
                    continue
                ctx = srun.ctx
                inputs = drawn if drawn is not None else _draw_inputs(candidate, ctx)
                del drawn
                try:
                    outs, calls = _run(candidate, inputs, ctx, "cand-a")
                    res.max_calls = calls
                    diff = _first_difference(outs, srun.outputs)
                    if diff and calls:
                        again, _ = _run(candidate, inputs, ctx, "cand-b")
                        if _first_difference(outs, again):
                            return done(
                                "unknown",
                                "the candidate disagrees with the spec and its output depends on the values max returns "
                                f"(the spec's does not); the finite-field model cannot decide this pair ({diff}, trial {trial + 1}, p={ctx.p})",
                            )
                except ZeroDenominator:
                    res.redraws += 1
                    continue
                except Undecidable as e:
                    return done("unknown", f"the candidate is outside the finite-field model: {e}")
                res.primes.append(ctx.p)
                res.omegas.append(ctx.omega)
                res.trials += 1
                if diff:
                    return done("not_equivalent", f"{diff} in trial {trial + 1} (p={ctx.p}, ω={ctx.omega})")
                break
            else:
                return done("unknown", f"trial {trial + 1}: {self.max_redraws + 1} draws in a row divided by zero mod p; retry with another seed")
        return done("equivalent", f"all outputs agree in {res.trials} independent trial(s) over Z_p x Z_q")


def field_check(candidate: KernelGraph, spec: KernelGraph, *, trials: int = DEFAULT_TRIALS, seed: int = 0) -> FieldResult:
    """One-off finite-field test of ``candidate`` against ``spec`` (see module docstring)."""
    return FieldVerifier(spec, trials=trials, seed=seed).check(candidate)
