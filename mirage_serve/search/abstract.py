"""Abstract expressions of μGraph tensors and their normal form (Mirage §5).

API (called by the enumerator and the search driver)::

    Expr                                    immutable, interned, hashable term
    Var(name) Const(v) Add(a, b) Mul(a, b) Div(a, b) Neg(a) Sub(a, b)
    Sum(n, e) Max(n, e) Exp(e) Sqrt(e) Rsqrt(e) Silu(e) Square(e) Concat(sizes, parts)
    kernel_op_expr(op, input_exprs, input_infos) -> Expr      kernel-level operator
    block_op_expr(op, input_exprs, input_infos, forloop_range) -> Expr   tile op / accumulator
    block_exprs(block, input_exprs, kernel_input_infos) -> (tile_exprs, output_exprs)
    graph_exprs(graph) -> list[Expr]        one per kernel tensor, through customized ops
    normal_form(e) -> Poly                  canonical form under the oriented axioms (cached)
    format_poly(p) -> str                   readable rendering of a normal form

Abstraction (as in the paper): an abstract expression says *what* a tensor
computes, not *where*: a tile of kernel input ``X`` is abstractly ``X``; a
matmul over an inner dim of size ``k`` is ``Sum(k, a*b)``; an accumulator over
``R`` iterations of a last dim of size ``n`` is ``Sum(R*n, ·)``. ``max_last`` is
abstractly the final maximum also inside the loop (the rescaled accumulators
make the running max equivalent to the final one), and a block output with
partial dims (grid dims that no output maps) is abstractly the same expression
with the partial reduction pending: the later kernel-level ``reduce`` over the
partial dim of size ``S`` adds ``Sum(S, ·)``, which merges with the block's inner
``Sum(R*c, ·)`` by ``Sum(a, Sum(b, x)) = Sum(a*b, x)``.

Concat is kept as a term ``Concat((n1, n2, ...), parts)`` that remembers the part
sizes along the concatenated dim. A reduction whose size is the total of a
concat's sizes distributes over the parts, which is how the fused LoRA form
``(X | X@A) @ (W ; B) = X@W + (X@A)@B`` is represented:
``Sum(n1+n2, Concat(a, b) * Concat(c, d)) = Sum(n1, a*c) + Sum(n2, b*d)``.

Normal form (see docs/abstract-expressions.md for the axioms). ``normal_form``
orients the axioms into a canonical polynomial: a sum of monomials with exact
rational coefficients; a monomial maps atoms to rational exponents. Atoms are
variables, ``exp(P)`` (at most one per monomial: exp(a)*exp(b) = exp(a+b)),
``sqrt(P)``, ``silu(P)``, ``max(P)``, ``inv(P)`` (a non-monomial denominator),
``cat(sizes, parts)`` and ``S_p`` for a prime ``p``. The last encodes the paper's
over-approximating axiom ``Sum(n, x*y) = Sum(n, x)*y`` for every ``y``: with it,
``Sum(n, x) = Sum(n, 1)*x``, and ``Sum(a, 1)*Sum(b, 1) = Sum(a*b, 1)``, so a
reduction of size ``n`` is the scalar factor ``S_n = prod S_p^e`` over the prime
factorisation of ``n``. A partial reduction (a tile's ``Sum(c, ·)`` with ``c | n``)
is then a sub-monomial of the full one, which is what pruning needs. Maxima are
size-free (``Max(a, x) ~ Max(b, x)``): a softmax is invariant under the shift it
subtracts, so identifying maxima over sub-ranges over-approximates, like the
running max above. Two expressions with equal normal forms are equivalent
under the axioms; the converse does not hold in general (e.g. a sum divided by
a different but equal sum is not cancelled), which is why the e-graph solver in
:mod:`mirage_serve.search.prune` has the last word on rejections.
"""

from __future__ import annotations

import logging
import math
from fractions import Fraction
from functools import lru_cache

from mirage_serve.mugraph.graph import BlockGraph, KernelGraph, MuGraphError, Op
from mirage_serve.mugraph.shapes import TensorInfo, block_tile_infos

log = logging.getLogger(__name__)

__all__ = [
    "Add", "Concat", "Const", "Div", "Exp", "Expr", "Max", "Mul", "Neg", "Rsqrt", "Silu", "Sqrt", "Square",
    "Sub", "Sum", "Var", "block_exprs", "block_op_expr", "format_poly", "graph_exprs", "kernel_op_expr",
    "normal_form",
]

# ---------------------------------------------------------------------------------------------
# Terms
# ---------------------------------------------------------------------------------------------

#: operator name -> arity (None: variadic). ``value`` holds the payload: a name, a constant, a size.
EXPR_OPS = {
    "var": 0, "const": 0, "add": 2, "mul": 2, "div": 2, "neg": 1, "exp": 1, "sqrt": 1, "rsqrt": 1,
    "silu": 1, "square": 1, "sum": 1, "max": 1, "concat": None,
}


class Expr:
    """An interned abstract-expression node: ``op``, ``args`` (child Exprs) and ``value``
    (variable name, constant as a :class:`Fraction`, reduction size, or concat sizes).

    Equal terms are the same object, so ``==`` and ``hash`` are O(1)."""

    __slots__ = ("op", "args", "value", "_hash", "__weakref__")
    _table: dict[tuple, Expr] = {}

    op: str
    args: tuple[Expr, ...]
    value: object

    def __new__(cls, op: str, args: tuple[Expr, ...] = (), value: object = None) -> Expr:
        key = (op, value, args)
        hit = cls._table.get(key)
        if hit is not None:
            return hit
        arity = EXPR_OPS.get(op, -1)
        if arity == -1:
            raise ValueError(f"unknown abstract operator {op!r}; known: {sorted(EXPR_OPS)}")
        if arity is not None and len(args) != arity:
            raise ValueError(f"abstract operator {op!r} takes {arity} argument(s), got {len(args)}")
        self = object.__new__(cls)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "_hash", hash(key))
        cls._table[key] = self
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Expr is immutable")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other

    def __reduce__(self):
        return (Expr, (self.op, self.args, self.value))

    def __repr__(self) -> str:
        if self.op == "var":
            return str(self.value)
        if self.op == "const":
            return str(self.value)
        if self.op in ("sum", "max"):
            return f"{self.op.capitalize()}({self.value}, {self.args[0]!r})"
        if self.op == "concat":
            return f"Concat({list(self.value)}, {', '.join(map(repr, self.args))})"
        sym = {"add": "+", "mul": "*", "div": "/"}.get(self.op)
        if sym:
            return f"({self.args[0]!r} {sym} {self.args[1]!r})"
        return f"{self.op}({self.args[0]!r})"

    def subterms(self) -> list[Expr]:
        """Every distinct subterm, children before parents (this term last)."""
        seen: dict[Expr, None] = {}

        def walk(e: Expr) -> None:
            if e in seen:
                return
            for a in e.args:
                walk(a)
            seen[e] = None

        walk(self)
        return list(seen)


def Var(name: str) -> Expr:
    """A kernel input (any tile of it is abstractly the same variable)."""
    return Expr("var", (), str(name))


def Const(value: float | int | Fraction) -> Expr:
    """A constant (eps, a scale, a reduction count), kept as an exact fraction."""
    return Expr("const", (), Fraction(value))


def Add(a: Expr, b: Expr) -> Expr:
    return Expr("add", (a, b))


def Mul(a: Expr, b: Expr) -> Expr:
    return Expr("mul", (a, b))


def Div(a: Expr, b: Expr) -> Expr:
    return Expr("div", (a, b))


def Neg(a: Expr) -> Expr:
    return Expr("neg", (a,))


def Sub(a: Expr, b: Expr) -> Expr:
    return Add(a, Neg(b))


def Exp(a: Expr) -> Expr:
    return Expr("exp", (a,))


def Sqrt(a: Expr) -> Expr:
    return Expr("sqrt", (a,))


def Rsqrt(a: Expr) -> Expr:
    return Expr("rsqrt", (a,))


def Silu(a: Expr) -> Expr:
    return Expr("silu", (a,))


def Square(a: Expr) -> Expr:
    return Expr("square", (a,))


def Sum(n: int, a: Expr) -> Expr:
    """A reduction (sum) over ``n`` elements."""
    if int(n) < 1:
        raise ValueError(f"Sum size must be positive, got {n}")
    return Expr("sum", (a,), int(n))


def Max(n: int, a: Expr) -> Expr:
    """A max-reduction over ``n`` elements."""
    if int(n) < 1:
        raise ValueError(f"Max size must be positive, got {n}")
    return Expr("max", (a,), int(n))


def Concat(sizes: tuple[int, ...] | list[int], parts: tuple[Expr, ...] | list[Expr]) -> Expr:
    """Concatenation along a dim; ``sizes[i]`` is part ``i``'s extent along it."""
    sizes, parts = tuple(int(s) for s in sizes), tuple(parts)
    if len(sizes) != len(parts) or not parts:
        raise ValueError(f"Concat needs one size per part, got sizes {sizes} for {len(parts)} parts")
    if len(parts) == 1:
        return parts[0]
    return Expr("concat", parts, sizes)


# ---------------------------------------------------------------------------------------------
# From μGraph operators to abstract expressions
# ---------------------------------------------------------------------------------------------

_UNARY = {"exp": Exp, "silu": Silu, "sqrt": Sqrt, "rsqrt": Rsqrt, "square": Square, "neg": Neg}


def _unary_expr(op: Op, x: Expr) -> Expr:
    fn = op.attr("fn")
    if fn in _UNARY:
        return _UNARY[fn](x)
    if fn == "recip":
        return Div(Const(1), x)
    if fn == "mul_scalar":
        return Mul(x, Const(op.attr("scalar")))
    if fn == "add_scalar":
        return Add(x, Const(op.attr("scalar")))
    raise MuGraphError(f"abstract expression: unknown unary fn {fn!r}")


def kernel_op_expr(op: Op, input_exprs: list[Expr], input_infos: list[TensorInfo]) -> Expr:
    """Abstract expression of a (single-output) operator that is not ``input``,
    ``customized`` or ``accum``; shared by kernel and block level."""
    k = op.kind
    xs = input_exprs
    if k == "matmul":
        inner = input_infos[0].shape[-1]
        return Sum(inner, Mul(xs[0], xs[1]))
    if k == "unary":
        return _unary_expr(op, xs[0])
    if k == "binary":
        fn = op.attr("fn")
        if fn == "add":
            return Add(xs[0], xs[1])
        if fn == "sub":
            return Sub(xs[0], xs[1])
        if fn == "mul":
            return Mul(xs[0], xs[1])
        if fn == "div":
            return Div(xs[0], xs[1])
        raise MuGraphError(f"abstract expression: unknown binary fn {fn!r}")
    if k == "reduce":
        shape = input_infos[0].shape
        n = shape[op.attr("dim", -1) % len(shape)]
        return Sum(n, xs[0]) if op.attr("fn") == "sum" else Max(n, xs[0])
    if k == "rms_norm":
        n = input_infos[0].shape[-1]
        ms = Div(Sum(n, Square(xs[0])), Const(n))
        y = Mul(xs[0], Rsqrt(Add(ms, Const(op.attr("eps", 0.0)))))
        return Mul(y, xs[1]) if len(xs) > 1 else y
    if k == "concat":
        rank = len(input_infos[0].shape)
        d = op.attr("dim", 0) % rank
        return Concat([info.shape[d] for info in input_infos], xs)
    if k == "sum_to":
        n = input_infos[0].shape[-1]
        return Sum(n // op.attr("size"), xs[0])
    raise MuGraphError(f"abstract expression: operator kind {k!r} has no single abstract expression here")


def block_op_expr(op: Op, input_exprs: list[Expr], input_infos: list[TensorInfo], forloop_range: int) -> Expr:
    """Abstract expression of a block-level operator: a tile op or a for-loop accumulator."""
    if op.kind != "accum":
        return kernel_op_expr(op, input_exprs, input_infos)
    fn, x, r = op.attr("fn"), input_exprs[0], forloop_range
    n = input_infos[0].shape[-1]
    if fn in ("sum", "rescaled_sum"):
        return Sum(r, x)
    if fn in ("sum_last", "rescaled_sum_last"):
        return Sum(r * n, x)
    if fn == "sum_to":
        return Sum(r * (n // op.attr("size")), x)
    if fn in ("mean_sq_last", "rms_last"):
        ms = Div(Sum(r * n, Square(x)), Const(r * n))
        return ms if fn == "mean_sq_last" else Sqrt(ms)
    if fn == "max_last":
        return Max(r * n, x)
    raise MuGraphError(f"abstract expression: unknown accumulator {fn!r}")


def block_exprs(block: BlockGraph, input_exprs: list[Expr], kernel_input_infos: list[TensorInfo]) -> tuple[list[Expr], list[Expr]]:
    """Expressions of every tile of ``block`` and of the kernel tensors it writes.

    ``input_exprs[i]`` / ``kernel_input_infos[i]`` describe the customized operator's
    ``i``-th input. A block output is its tile's expression (partial outputs keep
    the partial reduction pending; see the module docstring)."""
    tiles = block_tile_infos(block, kernel_input_infos)
    exprs: list[Expr] = [input_exprs[bi.source] for bi in block.inputs]
    for op in block.ops:
        exprs.append(block_op_expr(op, [exprs[t] for t in op.inputs], [tiles[t] for t in op.inputs], block.forloop_range))
    return exprs, [exprs[bo.tensor] for bo in block.outputs]


def graph_exprs(graph: KernelGraph) -> list[Expr]:
    """The abstract expression of every tensor of ``graph`` (tensor ids index the list)."""
    info = graph.info
    exprs: list[Expr] = []
    for op in graph.ops:
        if op.kind == "input":
            exprs.append(Var(op.attr("name")))
        elif op.kind == "customized":
            _, outs = block_exprs(op.block, [exprs[t] for t in op.inputs], [info[t] for t in op.inputs])
            exprs.extend(outs)
        else:
            exprs.append(kernel_op_expr(op, [exprs[t] for t in op.inputs], [info[t] for t in op.inputs]))
    return exprs


# ---------------------------------------------------------------------------------------------
# Normal form
# ---------------------------------------------------------------------------------------------
# Poly = frozenset[(Mono, Fraction)]   (coefficients non-zero, monomials distinct)
# Mono = frozenset[(Atom, Fraction)]   (exponents non-zero; at most one exp atom, exponent 1)
# Atom = ("var", name) | ("S", prime) | ("exp", Poly) | ("sqrt", Poly) | ("silu", Poly)
#        | ("max", Poly) | ("inv", Poly) | ("cat", sizes, (Poly, ...))

Mono = frozenset
Poly = frozenset
ONE_MONO: Mono = frozenset()
ZERO: Poly = frozenset()
ONE: Poly = frozenset({(ONE_MONO, Fraction(1))})


def poly_const(c: Fraction | int) -> Poly:
    c = Fraction(c)
    return frozenset({(ONE_MONO, c)}) if c else ZERO


def poly_atom(atom: tuple, exponent: Fraction | int = 1) -> Poly:
    return frozenset({(frozenset({(atom, Fraction(exponent))}), Fraction(1))})


def _poly_from(d: dict) -> Poly:
    return frozenset((m, c) for m, c in d.items() if c != 0)


def poly_add(p: Poly, q: Poly) -> Poly:
    if not p:
        return q
    if not q:
        return p
    d = dict(p)
    for m, c in q:
        d[m] = d.get(m, 0) + c
    return _poly_from(d)


def poly_scale(p: Poly, c: Fraction) -> Poly:
    return ZERO if c == 0 else frozenset((m, k * c) for m, k in p)


def mono_mul(a: Mono, b: Mono) -> Mono:
    """Product of two monomials; exp atoms combine: exp(a)*exp(b) = exp(a+b)."""
    if not a:
        return b
    if not b:
        return a
    d: dict = {}
    exp_arg = ZERO
    for m in (a, b):
        for atom, e in m:
            if atom[0] == "exp":
                exp_arg = poly_add(exp_arg, poly_scale(atom[1], e))
            else:
                d[atom] = d.get(atom, 0) + e
    items = [(at, e) for at, e in d.items() if e != 0]
    if exp_arg:
        items.append((("exp", exp_arg), Fraction(1)))
    return frozenset(items)


def mono_pow(m: Mono, k: Fraction) -> Mono:
    items = []
    for atom, e in m:
        if atom[0] == "exp":
            items.append((("exp", poly_scale(atom[1], k)), Fraction(1)))
        else:
            items.append((atom, e * k))
    return frozenset(items)


def poly_mul(p: Poly, q: Poly) -> Poly:
    if not p or not q:
        return ZERO
    # x/y * y = x for a non-monomial y: cancel an inv(y) factor before distributing
    for a, b in ((p, q), (q, p)):
        if len(b) > 1 and len(a) == 1:
            (m, c), = a
            inv = ("inv", b)
            e = dict(m).get(inv)
            if e is not None and e > 0:
                rest = dict(m)
                if e == 1:
                    del rest[inv]
                else:
                    rest[inv] = e - 1
                return frozenset({(frozenset(rest.items()), c)})
    d: dict = {}
    for m1, c1 in p:
        for m2, c2 in q:
            m = mono_mul(m1, m2)
            d[m] = d.get(m, 0) + c1 * c2
    return _poly_from(d)


def poly_pow(p: Poly, k: int) -> Poly:
    out = ONE
    for _ in range(k):
        out = poly_mul(out, p)
    return out


def poly_inv(p: Poly) -> Poly:
    """1/p: exact for a monomial (negated exponents), an ``inv`` atom otherwise."""
    if not p:
        # division by an abstract zero: keep it as an opaque atom rather than fail
        return poly_atom(("inv", ZERO))
    if len(p) > 1:
        return poly_atom(("inv", p))
    (m, c), = p
    out = poly_const(1 / c)
    rest = []
    for atom, e in m:
        if atom[0] == "inv" and e > 0 and e.denominator == 1:
            out = poly_mul(out, poly_pow(atom[1], int(e)))
        else:
            rest.append((atom, e))
    return poly_mul(out, frozenset({(mono_pow(frozenset(rest), Fraction(-1)), Fraction(1))}))


@lru_cache(maxsize=4096)
def prime_factors(n: int) -> tuple[tuple[int, int], ...]:
    """``n``'s prime factorisation as ((p, e), ...)."""
    out, p = [], 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n //= p
            e += 1
        if e:
            out.append((p, e))
        p += 1
    if n > 1:
        out.append((n, 1))
    return tuple(out)


def size_mono(n: int) -> Mono:
    """The scalar ``S_n`` a reduction of size ``n`` contributes (see the module docstring)."""
    return frozenset((("S", p), Fraction(e)) for p, e in prime_factors(n))


def poly_sum(n: int, p: Poly) -> Poly:
    """Sum(n, p): distributes over +, splits concats whose sizes total ``n``, and
    contributes the factor S_n."""
    d: dict = {}
    sn = size_mono(n)
    for m, c in p:
        cats = [(atom, e) for atom, e in m if atom[0] == "cat" and sum(atom[1]) == n and e == 1]
        if cats and len({atom[1] for atom, _ in cats}) == 1:
            sizes = cats[0][0][1]
            rest = frozenset((atom, e) for atom, e in m if (atom, e) not in cats)
            for i, size in enumerate(sizes):
                term = frozenset({(rest, c)})
                for atom, _ in cats:
                    term = poly_mul(term, atom[2][i])
                for m2, c2 in poly_sum(size, term):
                    d[m2] = d.get(m2, 0) + c2
            continue
        m2 = mono_mul(m, sn)
        d[m2] = d.get(m2, 0) + c
    return _poly_from(d)


def poly_max(p: Poly) -> Poly:
    """Size-free max; Max(Max(x)) = Max(x)."""
    if len(p) == 1:
        (m, c), = p
        if c == 1 and len(m) == 1:
            (atom, e), = m
            if atom[0] == "max" and e == 1:
                return p
    return poly_atom(("max", p))


def poly_exp(p: Poly) -> Poly:
    return ONE if not p else poly_atom(("exp", p))


_NF_CACHE: dict[Expr, Poly] = {}


def normal_form(e: Expr) -> Poly:
    """The canonical polynomial of ``e`` (cached per interned term)."""
    hit = _NF_CACHE.get(e)
    if hit is not None:
        return hit
    # post-order over the subterms not yet cached only (a new term is usually one
    # operator on cached ones)
    stack = [(e, False)]
    while stack:
        t, ready = stack.pop()
        if t in _NF_CACHE:
            continue
        if ready:
            _NF_CACHE[t] = _nf_node(t, [_NF_CACHE[a] for a in t.args])
            continue
        stack.append((t, True))
        stack.extend((a, False) for a in t.args if a not in _NF_CACHE)
    return _NF_CACHE[e]


def _nf_node(e: Expr, a: list[Poly]) -> Poly:
    op = e.op
    if op == "var":
        return poly_atom(("var", e.value))
    if op == "const":
        return poly_const(e.value)
    if op == "add":
        return poly_add(a[0], a[1])
    if op == "mul":
        return poly_mul(a[0], a[1])
    if op == "div":
        return poly_mul(a[0], poly_inv(a[1]))
    if op == "neg":
        return poly_scale(a[0], Fraction(-1))
    if op == "square":
        return poly_mul(a[0], a[0])
    if op == "exp":
        return poly_exp(a[0])
    if op == "sqrt":
        return poly_atom(("sqrt", a[0])) if a[0] else ZERO
    if op == "rsqrt":
        return poly_inv(poly_atom(("sqrt", a[0])))
    if op == "silu":
        return poly_atom(("silu", a[0])) if a[0] else ZERO
    if op == "sum":
        return poly_sum(e.value, a[0])
    if op == "max":
        return poly_max(a[0])
    if op == "concat":
        return poly_atom(("cat", e.value, tuple(a)))
    raise ValueError(f"no normal form for operator {op!r}")


def format_poly(p: Poly) -> str:
    """A deterministic, readable rendering of a normal form."""
    if not p:
        return "0"
    terms = []
    for m, c in p:
        factors = sorted(_format_atom(at) + ("" if e == 1 else f"^{e}") for at, e in m)
        if not factors:
            terms.append(str(c))
        else:
            terms.append(("" if c == 1 else f"{c}*") + "*".join(factors))
    return " + ".join(sorted(terms))


def _format_atom(atom: tuple) -> str:
    kind = atom[0]
    if kind == "var":
        return atom[1]
    if kind == "S":
        return f"S{atom[1]}"
    if kind == "cat":
        return f"cat{list(atom[1])}(" + ", ".join(format_poly(p) for p in atom[2]) + ")"
    return f"{kind}({format_poly(atom[1])})"


def is_constant(p: Poly) -> bool:
    """True for a polynomial without atoms (a number)."""
    return all(not m for m, _ in p)


def atoms_of(p: Poly):
    """Every atom of ``p``, recursively through atom arguments."""
    for m, _ in p:
        for atom, _ in m:
            yield atom
            for sub in atom_args(atom):
                yield from atoms_of(sub)


def atom_args(atom: tuple) -> tuple[Poly, ...]:
    """The polynomial arguments of an atom."""
    kind = atom[0]
    if kind in ("var", "S"):
        return ()
    if kind == "cat":
        return atom[2]
    return (atom[1],)


def size_of_mono(m: Mono) -> int:
    """The reduction size ``n`` of the ``S_n`` factor in ``m`` (1 if none; for reporting)."""
    out = Fraction(1)
    for atom, e in m:
        if atom[0] == "S":
            out *= Fraction(atom[1]) ** e
    return int(out) if out.denominator == 1 else math.nan
