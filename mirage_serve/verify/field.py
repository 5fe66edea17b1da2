"""Modular arithmetic for the finite-field verifier: values in Z_p x Z_q.

A value is a pair of residue tensors ``(x mod p, x mod q)`` where ``p = 2q + 1``
is a safe prime below 2^20 and ``q`` is prime. The p-component carries the
value; the q-component carries it as an *exponent*: ``exp(x) = ω^(x mod q) mod p``
with ``ω`` of order ``q`` in Z_p^*, so ``exp(a + b) = exp(a)·exp(b)`` holds
exactly. After ``exp`` the q-component is undefined (Z_p has no exponent map
back into Z_q); such a value reaching another ``exp`` makes the run undecidable
(:class:`Undecidable`).

Residues are stored as float64 tensors holding exact integers: products of two
residues are below 2^40 and reduced at once, and a matmul multiplies in float64
with the inner dimension chunked to at most 8192, so every partial sum stays
below 2^53 and is exact; chunks are reduced in int64 and summed.

Operations outside the algebra (see :mod:`mirage_serve.verify.finite_field` for
why this is sound) are supplied per trial by a :class:`TrialContext`:
``sqrt`` and ``silu`` are random functions (lookup tables indexed by the
p-residue, nonzero outputs), ``rsqrt(y) = 1/sqrt(y)``, ``recip`` and ``div`` use
modular inverses, float constants map to field elements keyed by their exact
value, and every ``max`` returns fresh uniformly random values.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from mirage_serve.mugraph.graph import MuGraphError

log = logging.getLogger(__name__)

PRIME_LOW = 1 << 19
PRIME_HIGH = 1 << 20
MATMUL_CHUNK = 8192  # 8192 * (2^20)^2 < 2^53: a chunk's float64 dot products are exact
SMALL_INT = 1 << 16  # |integer numerators| of float constants mapped exactly


class Undecidable(Exception):
    """The finite-field model cannot decide this pair (e.g. exp of an exp)."""


class ZeroDenominator(Exception):
    """A division hit a zero p-residue: the trial's random draw must be redrawn."""


@lru_cache(maxsize=1)
def safe_primes() -> tuple[int, ...]:
    """All safe primes p = 2q + 1 (q prime) with 2^19 <= p < 2^20, ascending."""
    n = PRIME_HIGH
    sieve = torch.ones(n, dtype=torch.bool)
    sieve[:2] = False
    for i in range(2, math.isqrt(n) + 1):
        if sieve[i]:
            sieve[i * i :: i] = False
    cand = torch.arange(PRIME_LOW | 1, n, 2)
    ok = sieve[cand] & sieve[(cand - 1) // 2]
    return tuple(int(p) for p in cand[ok].tolist())


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts (stable across runs and platforms)."""
    h = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mulmod(a: torch.Tensor, b: torch.Tensor, m: int) -> torch.Tensor:
    # a, b < 2^20: the product is an exact float64 integer below 2^40
    return _reduce_big(a * b, m)


def _reduce_big(t: torch.Tensor, m: int) -> torch.Tensor:
    """Reduce exact float64 integers below 2^53 (sums of residues) mod m, in place: callers pass
    a tensor they just computed, so no second tensor of its size is allocated (for K/V-sized
    values, fresh memory costs more than the arithmetic).

    torch's float remainder is computed with fmod, which IEEE 754 makes exact;
    tests/test_verify_field.py pins this for values up to 2^53."""
    return t.remainder_(m)


def powmod(base: torch.Tensor, e: int, m: int) -> torch.Tensor:
    """base^e mod m element-wise (base residues in float64)."""
    result = torch.ones_like(base)
    b = base.clone()
    while e:
        if e & 1:
            result = _mulmod(result, b, m)
        e >>= 1
        if e:
            b = _mulmod(b, b, m)
    return result


def matmul_mod(a: torch.Tensor, b: torch.Tensor, m: int) -> torch.Tensor:
    """(a @ b) mod m for residue tensors, exact: float64 products, the inner
    dimension chunked so that every partial sum stays below 2^53."""
    k = a.shape[-1]
    if k <= MATMUL_CHUNK:
        return _reduce_big(torch.matmul(a, b), m)
    acc = None
    for s in range(0, k, MATMUL_CHUNK):
        part = _reduce_big(torch.matmul(a[..., s : s + MATMUL_CHUNK], b[..., s : s + MATMUL_CHUNK, :]), m)
        acc = part if acc is None else acc.add_(part)
    return _reduce_big(acc, m)


@dataclass
class FieldValue:
    """A tensor of Z_p x Z_q residues. ``q is None``: the q-component is not
    tracked (no exp anywhere) or undefined, with ``why`` saying which."""

    p: torch.Tensor
    q: torch.Tensor | None
    why: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.p.shape)


@dataclass
class TrialContext:
    """Everything both programs of one trial share: the primes, ω, the random
    functions and the images of float constants. All of it derives from ``seed``,
    independent of the order in which the programs ask for it."""

    p: int
    q: int
    omega: int
    seed: int
    track_q: bool = True
    _tables: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict, repr=False)
    _consts: dict[float, tuple[int, int]] = field(default_factory=dict, repr=False)
    _exp_table: torch.Tensor | None = field(default=None, repr=False)

    @staticmethod
    def draw(p: int, seed: int, track_q: bool = True) -> TrialContext:
        """A context for prime ``p`` with ω of order q drawn from ``seed``."""
        q = (p - 1) // 2
        g = _gen(derive_seed(seed, "omega"))
        while True:
            h = int(torch.randint(2, p - 1, (1,), generator=g))
            omega = pow(h, 2, p)  # squares have order dividing q; q prime, so 1 or q
            if omega != 1:
                return TrialContext(p, q, omega, seed, track_q)

    def exp_table(self) -> torch.Tensor:
        """ω^k mod p for k = 0 .. q-1."""
        if self._exp_table is None:
            t = torch.empty(self.q, dtype=torch.float64)
            # ω^k by doubling blocks: t[n:2n] = t[:n] * ω^n
            t[0] = 1.0
            n, wn = 1, self.omega
            while n < self.q:
                m = min(n, self.q - n)
                t[n : n + m] = _mulmod(t[:m], torch.tensor(float(wn), dtype=torch.float64), self.p)
                n += m
                wn = pow(self.omega, n, self.p)
            self._exp_table = t
        return self._exp_table

    def table(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The random function ``name``: nonzero outputs (Z_p, Z_q) per p-residue input."""
        if name not in self._tables:
            g = _gen(derive_seed(self.seed, "oracle", name))
            tp = torch.randint(1, self.p, (self.p,), generator=g, dtype=torch.float64)
            tq = torch.randint(1, self.q, (self.p,), generator=g, dtype=torch.float64) if self.track_q else None
            self._tables[name] = (tp, tq)
        return self._tables[name]

    def constant(self, v: float) -> tuple[int, int]:
        """Field image (mod p, mod q) of a float constant.

        Small dyadic rationals a·2^k (odd |a| < 2^16, |k| <= 30: 0, ±1, 2, 0.5,
        1/4096, 2^24, ...) and reciprocals 1/n of integers n < 2^16 map to their exact
        image, so ``x*1 = x``, ``x+0 = x``, ``x*2 = x+x`` and ``sum * (1/n) = mean``
        hold; every other value maps to a random element keyed by its exact bits."""
        v = float(v)
        if not math.isfinite(v):
            raise MuGraphError(f"float constant {v!r} is not finite; a μGraph's scalars and eps must be finite numbers")
        if v in self._consts:
            return self._consts[v]
        exact = _exact_rational(v)
        if exact is not None:
            num, den = exact
            out = ((num * pow(den, -1, self.p)) % self.p, (num * pow(den, -1, self.q)) % self.q)
        else:
            bits = struct.pack("<d", v).hex()
            h = derive_seed(self.seed, "const", bits)
            out = (h % self.p, (h >> 24) % self.q)
        self._consts[v] = out
        return out


def _exact_rational(v: float) -> tuple[int, int] | None:
    """(numerator, denominator) for v = a·2^k with odd |a| < 2^16 and |k| <= 30, or
    v = 1/n for an integer 1 <= |n| < 2^16; None for every other float."""
    if v == 0.0:
        return 0, 1
    a, den = v.as_integer_ratio()  # lowest terms, den a power of two
    k = -(den.bit_length() - 1)
    while a % 2 == 0:
        a //= 2
        k += 1
    if abs(a) < SMALL_INT and abs(k) <= 30:
        return (a << k, 1) if k >= 0 else (a, 1 << -k)
    n = round(1.0 / v)
    if 1 <= abs(n) < SMALL_INT and 1.0 / n == v:
        return (1, n) if n > 0 else (-1, -n)
    return None


class FieldAlgebra:
    """The algebra :func:`mirage_serve.reference.run_graph` runs under for one
    program in one trial. ``max_seed`` drives the fresh values every max returns;
    ``max_calls`` counts them (0: the program's output cannot depend on max)."""

    def __init__(self, ctx: TrialContext, max_seed: int) -> None:
        self.ctx = ctx
        self._max_gen = _gen(max_seed)
        self.max_calls = 0

    # -- helpers ---------------------------------------------------------
    def _q_of(self, *xs: FieldValue) -> tuple[list[torch.Tensor] | None, str | None]:
        if not self.ctx.track_q:
            return None, "not tracked"
        for x in xs:
            if x.q is None:
                return None, x.why
        return [x.q for x in xs], None  # type: ignore[misc]

    def _inverse(self, x: FieldValue) -> FieldValue:
        if bool((x.p == 0).any()):
            raise ZeroDenominator("division by a zero residue mod p")
        ip = powmod(x.p, self.ctx.p - 2, self.ctx.p)
        qs, why = self._q_of(x)
        if qs is None:
            return FieldValue(ip, None, why)
        if bool((qs[0] == 0).any()):
            return FieldValue(ip, None, "a denominator was zero mod q")
        return FieldValue(ip, powmod(qs[0], self.ctx.q - 2, self.ctx.q))

    def _const(self, v: float) -> FieldValue:
        cp, cq = self.ctx.constant(v)
        tp = torch.tensor(float(cp), dtype=torch.float64)
        return FieldValue(tp, torch.tensor(float(cq), dtype=torch.float64) if self.ctx.track_q else None, "not tracked")

    def _oracle(self, name: str, x: FieldValue) -> FieldValue:
        tp, tq = self.ctx.table(name)
        idx = x.p.to(torch.int64)
        return FieldValue(tp[idx], tq[idx] if tq is not None else None, "not tracked")

    def fresh(self, shape: Sequence[int]) -> FieldValue:
        """Uniformly random values (what every max returns)."""
        self.max_calls += 1
        shape = tuple(shape)
        p = torch.randint(0, self.ctx.p, shape, generator=self._max_gen, dtype=torch.float64)
        q = torch.randint(0, self.ctx.q, shape, generator=self._max_gen, dtype=torch.float64) if self.ctx.track_q else None
        return FieldValue(p, q, "not tracked")

    # -- the algebra interface of reference.run_graph ---------------------
    def map(self, x: FieldValue, f: Callable[[torch.Tensor], torch.Tensor]) -> FieldValue:
        return FieldValue(f(x.p), f(x.q) if x.q is not None else None, x.why)

    def shape(self, x: FieldValue) -> tuple[int, ...]:
        return x.shape

    def cat(self, xs: Sequence[FieldValue], dim: int) -> FieldValue:
        qs, why = self._q_of(*xs)
        return FieldValue(torch.cat([x.p for x in xs], dim), torch.cat(qs, dim) if qs is not None else None, why)

    def lift(self, x: torch.Tensor) -> FieldValue:
        """Integer tensor -> its residues (for tests and hand-made inputs)."""
        xi = x.to(torch.int64)
        q = torch.remainder(xi, self.ctx.q).to(torch.float64) if self.ctx.track_q else None
        return FieldValue(torch.remainder(xi, self.ctx.p).to(torch.float64), q, "not tracked")

    def matmul(self, a: FieldValue, b: FieldValue, trans_b: bool = False) -> FieldValue:
        def t(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(-1, -2) if trans_b else x

        qs, why = self._q_of(a, b)
        p = matmul_mod(a.p, t(b.p), self.ctx.p)
        q = matmul_mod(qs[0], t(qs[1]), self.ctx.q) if qs is not None else None
        return FieldValue(p, q, why)

    def binary(self, fn: str, a: FieldValue, b: FieldValue) -> FieldValue:
        if fn == "div":
            return self.binary("mul", a, self._inverse(b))
        P, Q = self.ctx.p, self.ctx.q
        qs, why = self._q_of(a, b)
        if fn == "add":
            p = _reduce_big(a.p + b.p, P)
            q = _reduce_big(qs[0] + qs[1], Q) if qs else None
        elif fn == "sub":
            p = _reduce_big(a.p - b.p, P)
            q = _reduce_big(qs[0] - qs[1], Q) if qs else None
        elif fn == "mul":
            p = _mulmod(a.p, b.p, P)
            q = _mulmod(qs[0], qs[1], Q) if qs else None
        else:
            raise MuGraphError(f"unknown binary fn {fn!r}")
        return FieldValue(p, q, why)

    def unary(self, fn: str, x: FieldValue, scalar: float | None = None) -> FieldValue:
        if fn == "exp":
            if not self.ctx.track_q:
                raise RuntimeError("exp reached in a trial that does not track exponents; the graph scan missed it")
            if x.q is None:
                raise Undecidable(f"exp of a value whose exponent residue is undefined ({x.why}), e.g. exp of an exp")
            table = self.ctx.exp_table()
            return FieldValue(table[x.q.to(torch.int64)], None, "result of exp")
        if fn == "silu":
            return self._oracle("silu", x)
        if fn == "sqrt":
            return self._oracle("sqrt", x)
        if fn == "rsqrt":
            return self._inverse(self._oracle("sqrt", x))
        if fn == "recip":
            return self._inverse(x)
        if fn == "square":
            return self.binary("mul", x, x)
        if fn == "neg":
            qs, why = self._q_of(x)
            return FieldValue(_reduce_big(-x.p, self.ctx.p), _reduce_big(-qs[0], self.ctx.q) if qs else None, why)
        if fn == "mul_scalar":
            return self.binary("mul", x, self._const(scalar))
        if fn == "add_scalar":
            return self.binary("add", x, self._const(scalar))
        raise MuGraphError(f"unknown unary fn {fn!r}")

    def sum(self, x: FieldValue, dim: int, keepdim: bool = True) -> FieldValue:
        qs, why = self._q_of(x)
        p = _reduce_big(x.p.sum(dim, keepdim=keepdim), self.ctx.p)
        q = _reduce_big(qs[0].sum(dim, keepdim=keepdim), self.ctx.q) if qs else None
        return FieldValue(p, q, why)

    def max(self, x: FieldValue, dim: int, keepdim: bool = True) -> FieldValue:
        shape = list(x.shape)
        d = dim % len(shape)
        if keepdim:
            shape[d] = 1
        else:
            del shape[d]
        return self.fresh(shape)

    def scale_by_count(self, x: FieldValue, n: int) -> FieldValue:
        if n % self.ctx.p == 0:
            raise Undecidable(f"count {n} is a multiple of the prime {self.ctx.p}; it has no inverse")
        inv = FieldValue(torch.tensor(float(pow(n, -1, self.ctx.p)), dtype=torch.float64), None, "not tracked")
        if self.ctx.track_q:
            inv.q = torch.tensor(float(pow(n, -1, self.ctx.q)), dtype=torch.float64) if n % self.ctx.q else None
            inv.why = None if inv.q is not None else f"count {n} is a multiple of q"
        return self.binary("mul", x, inv)

    def running_max(self, prev: FieldValue | None, x_rowmax: FieldValue, first: bool) -> FieldValue:
        if first:
            return x_rowmax
        return self.fresh(torch.broadcast_shapes(prev.p.shape, x_rowmax.p.shape))

    def rms_norm(self, x: FieldValue, w: FieldValue | None, eps: float) -> FieldValue:
        n = x.shape[-1]
        ms = self.scale_by_count(self.sum(self.binary("mul", x, x), -1), n)
        y = self.binary("mul", x, self.unary("rsqrt", self.unary("add_scalar", ms, eps)))
        return y if w is None else self.binary("mul", y, w)
