"""The pruning oracle: can a μGraph prefix still lead to a program equivalent to the spec?

API (called by the enumerator and the search driver)::

    oracle = SubexprOracle(spec, timeout_s=0.05, spec_iters=3, query_iters=1, max_nodes=20_000)
    oracle.is_possible_subexpr(e)   # bool, cached: can e occur in an expression equivalent
                                    # (under the axioms) to one of the spec's outputs?
    oracle.matches_output(e, i)     # bool, cached: is e equivalent to spec output i?
    oracle.stats                    # OracleStats: queries, cache hits, fast-path and solver
                                    # decisions, solver time, timeouts

Who decides (see docs/abstract-expressions.md):

1. *Normal-form fast path* (pure Python, microseconds): both sides are put in the
   normal form of :mod:`mirage_serve.search.abstract`. ``e`` is accepted when its
   normal form is structurally contained in the normal form of some subterm of a
   spec output (a sub-monomial up to coefficients, a sub-sum up to a common
   factor, an ``exp`` of a sub-sum, a concat whose parts are all contained). An
   acceptance is final: every step is an instance of the (over-approximating)
   axioms, so accepting never prunes a good prefix.
2. *Signature filter*: a query that mentions a kernel input or a function
   symbol (exp, sqrt, silu, max) that no spec output mentions is rejected without
   the solver: only a cancellation (x - x = 0, x/y*y = x) could erase it, and a
   prefix whose work must be cancelled later is never useful.
3. *E-graph solver* (egglog): the spec outputs are inserted once and the axioms
   saturated for ``spec_iters`` iterations (or until ``max_nodes`` e-nodes). A
   query the fast path could not accept is inserted under ``push``; the axioms
   run ``query_iters`` more iterations; ``e`` is a possible subexpression iff its
   e-class is then reachable from an output's e-class through e-node children
   (relation ``Reach``); the e-graph is popped afterwards. The solver is the
   authority for every rejection: a prefix is pruned only if the bounded
   saturation also fails to reach it. A solver call that exceeds ``timeout_s``
   accepts (never prune what could not be refuted) and is counted.

``matches_output`` is equality of normal forms or, failing that, the solver
checking ``(= e output_i)`` after the same bounded saturation.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from fractions import Fraction

from egglog.bindings import EggSmolError, EGraph

from mirage_serve.mugraph.graph import KernelGraph
from mirage_serve.search.abstract import (
    Expr,
    Mono,
    Poly,
    atom_args,
    graph_exprs,
    is_constant,
    mono_mul,
    normal_form,
    poly_mul,
)

log = logging.getLogger(__name__)

__all__ = ["OracleStats", "SubexprOracle", "egglog_term"]


@dataclass
class OracleStats:
    """Counters of a :class:`SubexprOracle` (times in seconds)."""

    queries: int = 0
    cache_hits: int = 0
    fast_accepts: int = 0
    solver_queries: int = 0
    solver_accepts: int = 0
    rejections: int = 0
    timeouts: int = 0
    signature_rejects: int = 0
    solver_time_s: float = 0.0
    fast_time_s: float = 0.0
    setup_time_s: float = 0.0
    egraph_nodes: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra


# ---------------------------------------------------------------------------------------------
# egglog encoding
# ---------------------------------------------------------------------------------------------

_DATATYPE = """
(datatype E
  (V String) (K String)
  (Add E E) (Mul E E) (Div E E)
  (Exp E) (Sqrt E) (Silu E) (Mx E)
  (Sum i64 E) (Cat i64 i64 E E))
(relation Reach (E))
(relation Fac (i64 i64 i64))
"""

# The axioms (docs/abstract-expressions.md lists them with their justification).
_AXIOMS = """
(ruleset ax)
(rewrite (Add a b) (Add b a) :ruleset ax)
(rewrite (Mul a b) (Mul b a) :ruleset ax)
(birewrite (Add a (Add b c)) (Add (Add a b) c) :ruleset ax)
(birewrite (Mul a (Mul b c)) (Mul (Mul a b) c) :ruleset ax)
(birewrite (Mul a (Add b c)) (Add (Mul a b) (Mul a c)) :ruleset ax)
(birewrite (Div (Mul x y) z) (Mul x (Div y z)) :ruleset ax)
(birewrite (Div (Add x y) z) (Add (Div x z) (Div y z)) :ruleset ax)
(rewrite (Mul (Div x y) y) x :ruleset ax)
(rewrite (Div (Div x y) z) (Div x (Mul y z)) :ruleset ax)
(rewrite (Mul x (K "1")) x :ruleset ax)
(rewrite (Add x (K "0")) x :ruleset ax)
(rewrite (Add x (Mul (K "-1") x)) (K "0") :ruleset ax)
(rewrite (Mul (K "-1") (Mul (K "-1") x)) x :ruleset ax)
(rewrite (Sum a (Sum b x)) (Sum (* a b) x) :ruleset ax)
(rule ((= e (Sum n x)) (Fac n a b)) ((union e (Sum a (Sum b x)))) :ruleset ax)
(birewrite (Sum n (Add x y)) (Add (Sum n x) (Sum n y)) :ruleset ax)
(birewrite (Sum n (Mul x y)) (Mul (Sum n x) y) :ruleset ax)
(birewrite (Sum n (Div x y)) (Div (Sum n x) y) :ruleset ax)
(birewrite (Exp (Add x y)) (Mul (Exp x) (Exp y)) :ruleset ax)
(birewrite (Exp (Mul (K "-1") x)) (Div (K "1") (Exp x)) :ruleset ax)
(rewrite (Exp (K "0")) (K "1") :ruleset ax)
(rewrite (Mx (Mx x)) (Mx x) :ruleset ax)
(rule ((= e (Sum n (Mul (Cat a b x y) (Cat a b z w)))) (= n (+ a b)))
      ((union e (Add (Sum a (Mul x z)) (Sum b (Mul y w))))) :ruleset ax)

(ruleset reach)
(rule ((Reach (Add a b))) ((Reach a) (Reach b)) :ruleset reach)
(rule ((Reach (Mul a b))) ((Reach a) (Reach b)) :ruleset reach)
(rule ((Reach (Div a b))) ((Reach a) (Reach b)) :ruleset reach)
(rule ((Reach (Exp a))) ((Reach a)) :ruleset reach)
(rule ((Reach (Sqrt a))) ((Reach a)) :ruleset reach)
(rule ((Reach (Silu a))) ((Reach a)) :ruleset reach)
(rule ((Reach (Mx a))) ((Reach a)) :ruleset reach)
(rule ((Reach (Sum n a))) ((Reach a)) :ruleset reach)
(rule ((Reach (Cat n m a b))) ((Reach a) (Reach b)) :ruleset reach)
"""

_STEP = "(run-schedule (seq (run ax) (saturate (run reach))))"


def _const(value: Fraction) -> str:
    return f'(K "{value}")'


def egglog_term(e: Expr, memo: dict[Expr, str] | None = None) -> str:
    """``e`` as an egglog term over the datatype ``E`` (Sub, Neg, Rsqrt, Square desugared)."""
    memo = {} if memo is None else memo
    for t in e.subterms():
        if t in memo:
            continue
        a = [memo[x] for x in t.args]
        op = t.op
        if op == "var":
            s = f"(V {json.dumps(t.value)})"
        elif op == "const":
            s = _const(t.value)
        elif op in ("add", "mul", "div"):
            s = f"({op.capitalize()} {a[0]} {a[1]})"
        elif op == "neg":
            s = f'(Mul (K "-1") {a[0]})'
        elif op == "square":
            s = f"(Mul {a[0]} {a[0]})"
        elif op in ("exp", "sqrt", "silu"):
            s = f"({op.capitalize()} {a[0]})"
        elif op == "rsqrt":
            s = f'(Div (K "1") (Sqrt {a[0]}))'
        elif op == "sum":
            s = f"(Sum {t.value} {a[0]})"
        elif op == "max":
            s = f"(Mx {a[0]})"  # size-free maxima (softmax shift invariance)
        elif op == "concat":
            sizes = list(t.value)
            s, rest = a[-1], sizes[-1]
            for size, part in zip(reversed(sizes[:-1]), reversed(a[:-1]), strict=True):
                s, rest = f"(Cat {size} {rest} {part} {s})", rest + size
        else:
            raise ValueError(f"no egglog encoding for abstract operator {op!r}")
        memo[t] = s
    return memo[e]


_SIGNATURE_OPS = {"exp": "exp", "sqrt": "sqrt", "rsqrt": "sqrt", "silu": "silu", "max": "max"}


def _signature(e: Expr) -> set:
    """The kernel inputs and non-arithmetic function symbols ``e`` mentions."""
    out: set = set()
    for t in e.subterms():
        if t.op == "var":
            out.add(("var", t.value))
        elif t.op in _SIGNATURE_OPS:
            out.add(_SIGNATURE_OPS[t.op])
    return out


def _sizes_of(e: Expr) -> set[int]:
    return {t.value for t in e.subterms() if t.op == "sum"}


def _divisor_facts(sizes: set[int]) -> str:
    facts = []
    for n in sorted(sizes):
        for a in range(2, n):
            if n % a == 0:
                facts.append(f"(Fac {n} {a} {n // a})")
    return "\n".join(facts)


# ---------------------------------------------------------------------------------------------
# The normal-form fast path
# ---------------------------------------------------------------------------------------------


def _sign(x: Fraction) -> int:
    return (x > 0) - (x < 0)


def _exp_contained(q: Poly, p: Poly) -> bool:
    """exp(q) occurs in exp(p) = exp(q) * exp(p - q): q is a sub-sum of p, coefficients exact."""
    pd = dict(p)
    return all(pd.get(m) == c for m, c in q)


def _mono_contained(q: Mono, m: Mono, sign: int) -> bool:
    """q occurs in m (or in its denominator, ``sign = -1``), regrouping factors:
    every exponent of q has the sign of m's and no larger magnitude."""
    md = dict(m)
    for atom, e in q:
        if atom[0] == "exp":
            other = next((a for a in md if a[0] == "exp"), None)
            if other is None:
                return False
            qa = atom[1] if sign > 0 else frozenset((mm, -c) for mm, c in atom[1])
            if not _exp_contained(qa, other[1]):
                return False
            continue
        em = md.get(atom)
        if em is None:
            return False
        e = e * sign
        if _sign(e) != _sign(em) or abs(e) > abs(em):
            return False
    return True


def _mono_div(m: Mono, q: Mono) -> Mono:
    """m / q with exponents subtracted (exp arguments too)."""
    inv = []
    for atom, e in q:
        if atom[0] == "exp":
            inv.append((("exp", frozenset((mm, -c) for mm, c in atom[1])), Fraction(1)))
        else:
            inv.append((atom, -e))
    return mono_mul(m, frozenset(inv))


class _SpecIndex:
    """The normal forms of every subterm of the spec's outputs (and of every
    polynomial inside their atoms), indexed for containment queries."""

    def __init__(self, outputs: list[Expr]) -> None:
        self.polys: set[Poly] = set()
        for out in outputs:
            for t in out.subterms():
                self._add_poly(normal_form(t))
        self.monos: set[Mono] = {m for p in self.polys for m, _ in p}
        self.multi = [(dict(p), frozenset(m for m, _ in p)) for p in self.polys if len(p) > 1]
        # coefficient magnitudes a lone monomial may carry: those of the spec's
        # monomials, their products in pairs (constants regroup under
        # associativity) and inverses; the axioms have no constant folding, so
        # e.g. X + X (coefficient 2) cannot occur in a spec without a 2 in it
        base = {abs(c) for p in self.polys for _, c in p} | {Fraction(1)}
        pairs = {a * b for a in base for b in base} | base
        self.coefs: set[Fraction] = pairs | {1 / c for c in pairs if c}
        self._mono_cache: dict[Mono, bool] = {}
        self._poly_cache: dict[Poly, bool] = {}
        self.atom_kinds = {atom for m in self.monos for atom, _ in m}

    def _add_poly(self, p: Poly) -> None:
        if p in self.polys:
            return
        self.polys.add(p)
        for m, _ in p:
            for atom, _ in m:
                for sub in atom_args(atom):
                    self._add_poly(sub)

    def contains_mono(self, q: Mono) -> bool:
        hit = self._mono_cache.get(q)
        if hit is None:
            hit = self._mono_cache[q] = self._contains_mono(q)
        return hit

    def _contains_mono(self, q: Mono) -> bool:
        if not q:
            return True
        if any(atom[0] == "cat" for atom, _ in q):
            return self._contains_with_cats(frozenset({(q, Fraction(1))}))
        return any(_mono_contained(q, m, s) for m in self.monos for s in (1, -1))

    def _contains_with_cats(self, p: Poly) -> bool:
        # a concat is contained when every part, in the same product, is (its reductions
        # along the concat dim distribute over the parts)
        for q, _ in p:
            cats = [atom for atom, _ in q if atom[0] == "cat"]
            if not cats:
                if not self.contains_poly(frozenset({(q, Fraction(1))})):
                    return False
                continue
            cat = cats[0]
            rest = frozenset((a, e) for a, e in q if a != cat)
            for part in cat[2]:
                if not self._contains_with_cats(poly_mul(frozenset({(rest, Fraction(1))}), part)):
                    return False
        return True

    def contains_poly(self, q: Poly) -> bool:
        hit = self._poly_cache.get(q)
        if hit is None:
            hit = self._poly_cache[q] = self._contains_poly(q)
        return hit

    def _contains_poly(self, q: Poly) -> bool:
        if is_constant(q):
            return True
        if len(q) == 1:
            (m, c), = q
            return abs(c) in self.coefs and self.contains_mono(m)
        if any(atom[0] == "cat" for m, _ in q for atom, _ in m):
            return self._contains_with_cats(q)
        qitems = sorted(q, key=repr)
        first, c0 = qitems[0]
        for pd, pm in self.multi:
            if len(pm) < len(qitems):
                continue
            for m in pm:
                f = _mono_div(m, first)
                k = pd[m] / c0  # the common factor's coefficient: every ratio must agree
                if all(pd.get(mono_mul(f, qm)) == k * c for qm, c in qitems[1:]):
                    return True
        return False


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------


class SubexprOracle:
    """Answers pruning queries about abstract expressions against one spec.

    ``spec``: the reference kernel graph; its outputs' abstract expressions are the
    targets. ``timeout_s`` bounds one solver query (wall clock; exceeding it accepts).
    ``spec_iters``/``max_nodes`` bound the initial saturation, ``query_iters`` the
    saturation after inserting a query. ``use_solver=False`` keeps only the
    normal-form path (rejections are then not checked by the solver)."""

    def __init__(self, spec: KernelGraph, *, timeout_s: float = 0.05, spec_iters: int = 3, query_iters: int = 1,
                 max_nodes: int = 20_000, use_solver: bool = True) -> None:
        t0 = time.perf_counter()
        exprs = graph_exprs(spec)
        self.outputs: list[Expr] = [exprs[t] for t in spec.outputs]
        self.output_nfs: list[Poly] = [normal_form(e) for e in self.outputs]
        self.timeout_s, self.query_iters = timeout_s, query_iters
        self.use_solver = use_solver
        self.stats = OracleStats()
        self._signature = set().union(*(_signature(e) for e in self.outputs))
        self._index = _SpecIndex(self.outputs)
        self._sub_cache: dict[Expr, bool] = {}
        self._sub_nf_cache: dict[Poly, bool] = {}
        self._match_cache: dict[tuple[Expr, int], bool] = {}
        self._memo: dict[Expr, str] = {}
        self._sizes: set[int] = set()
        self._egraph: EGraph | None = None
        if use_solver:
            self._init_solver(spec_iters, max_nodes)
        self.stats.setup_time_s = time.perf_counter() - t0
        log.debug("SubexprOracle ready: %d outputs, %d spec polynomials, %d e-nodes, %.3fs",
                  len(self.outputs), len(self._index.polys), self.stats.egraph_nodes, self.stats.setup_time_s)

    # -- solver -----------------------------------------------------------------------------

    def _run(self, text: str):
        assert self._egraph is not None
        return self._egraph.run_program(*self._egraph.parse_program(text))

    def _egraph_size(self) -> int:
        out = self._run("(print-size)")
        return sum(n for _, n in out[0].sizes) if out and hasattr(out[0], "sizes") else 0

    def _init_solver(self, spec_iters: int, max_nodes: int) -> None:
        self._egraph = EGraph()
        for e in self.outputs:
            self._sizes |= _sizes_of(e)
        lets = "\n".join(f"(let $out{i} {egglog_term(e, self._memo)})\n(Reach $out{i})" for i, e in enumerate(self.outputs))
        self._run(_DATATYPE + _AXIOMS + _divisor_facts(self._sizes) + "\n" + lets)
        for _ in range(spec_iters):
            self._run(_STEP)
            self.stats.egraph_nodes = self._egraph_size()
            if self.stats.egraph_nodes > max_nodes:
                log.info("spec e-graph stopped at %d e-nodes (max_nodes=%d)", self.stats.egraph_nodes, max_nodes)
                break

    def _solver_check(self, e: Expr, goal: str) -> bool:
        """Insert ``e`` as ``$q`` under push, saturate a little, check ``goal``; pop."""
        t0 = time.perf_counter()
        self.stats.solver_queries += 1
        new_sizes = _sizes_of(e) - self._sizes
        self._run("(push)")
        try:
            self._run(f"{_divisor_facts(new_sizes)}\n(let $q {egglog_term(e, self._memo)})")
            for _ in range(self.query_iters + 1):
                try:
                    self._run(f"(check {goal})")
                    return True
                except EggSmolError:
                    pass
                if time.perf_counter() - t0 > self.timeout_s:
                    self.stats.timeouts += 1
                    log.debug("solver query timed out after %.3fs; accepting %r", time.perf_counter() - t0, e)
                    return True
                self._run(_STEP)
            return False
        finally:
            self._run("(pop)")
            self.stats.solver_time_s += time.perf_counter() - t0

    # -- queries ----------------------------------------------------------------------------

    def is_possible_subexpr(self, e: Expr) -> bool:
        """True if ``e`` can occur in an expression equivalent to one of the spec's outputs."""
        self.stats.queries += 1
        hit = self._sub_cache.get(e)
        if hit is not None:
            self.stats.cache_hits += 1
            return hit
        t0 = time.perf_counter()
        nf = normal_form(e)
        ok = self._sub_nf_cache.get(nf)
        if ok is None:
            ok = self._index.contains_poly(nf)
            self.stats.fast_time_s += time.perf_counter() - t0
            if ok:
                self.stats.fast_accepts += 1
            elif not _signature(e) <= self._signature:
                self.stats.signature_rejects += 1
            elif self.use_solver:
                ok = self._solver_check(e, "(Reach $q)")
                self.stats.solver_accepts += ok
            self._sub_nf_cache[nf] = ok
        else:
            self.stats.cache_hits += 1
        if not ok:
            self.stats.rejections += 1
        self._sub_cache[e] = ok
        return ok

    def matches_output(self, e: Expr, index: int) -> bool:
        """True if ``e`` is equivalent to spec output ``index`` under the axioms."""
        if not 0 <= index < len(self.outputs):
            raise IndexError(f"spec has {len(self.outputs)} output(s); output {index} does not exist")
        self.stats.queries += 1
        key = (e, index)
        hit = self._match_cache.get(key)
        if hit is not None:
            self.stats.cache_hits += 1
            return hit
        ok = normal_form(e) == self.output_nfs[index]
        if ok:
            self.stats.fast_accepts += 1
        elif self.use_solver:
            ok = self._solver_check(e, f"(= $q $out{index})")
            self.stats.solver_accepts += ok
        self._match_cache[key] = ok
        return ok

    def matching_outputs(self, e: Expr) -> list[int]:
        """Indices of the spec outputs ``e`` is equivalent to."""
        return [i for i in range(len(self.outputs)) if self.matches_output(e, i)]
