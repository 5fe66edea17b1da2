"""Random fused programs over named axes, and their lowerings to μGraphs.

A :class:`Program` is a block-graph body written over *axes* instead of grid
and loop choices: every tile has a type (a tuple of axis names, ``"1"`` for a
size-1 dim) and the generator only builds programs whose meaning does not
depend on how the axes are tiled:

* ``par`` axes may be split over the grid and are never reduced;
* ``inner`` axes are never split (reductions, rms_norm and matmuls contract them);
* the one ``stream`` axis is split into for-loop chunks (and, in split mode,
  over a grid dim too); it is only reduced through accumulators, or by a
  chunk contraction (matmul / sum over it) that is summed by a ``sum``
  accumulator, with only linear operators in between; values that depend on a
  running max (``p = exp(s - m)``) reach only the rescaled accumulators.

Every program therefore has two kinds of lowering that compute the same
function: :func:`lower_spec` (the unfused kernel graph of pre-defined
operators, accumulators replaced by whole-tensor reductions) and
:func:`lower_block` for any :class:`Tiling` (grid splits, loop range, split of
the stream axis with a combining kernel, or the epilogue moved to kernel
operators). Pairs of lowerings are the fuzzer's equivalent rewrites.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from mirage_serve.mugraph.graph import BlockBuilder, GraphBuilder, KernelGraph, MuGraphError, Op
from mirage_serve.mugraph.shapes import TensorInfo, infer_tile_op

ONE = "1"
MAX_TENSOR = 2048  # elements per tensor: the Triton interpreter runs programs one by one

# tile categories (what the generator knows about a tile)
INV, CHUNK, PARTIAL, CHUNK_M, PARTIAL_M, MAX, POST = "inv", "chunk", "partial", "chunk_m", "partial_m", "max", "post"
LOOP_CATS = (CHUNK, PARTIAL, CHUNK_M, PARTIAL_M)


@dataclass(frozen=True)
class Axis:
    name: str
    size: int
    role: str  # par | inner | stream


@dataclass(frozen=True)
class PInput:
    name: str
    axes: tuple[str, ...]


@dataclass(frozen=True)
class Program:
    """Tiles are numbered like a block graph's: inputs first, then one per op."""

    axes: tuple[Axis, ...]
    dtype: str
    inputs: tuple[PInput, ...]
    ops: tuple[Op, ...]
    outputs: tuple[int, ...]
    types: tuple[tuple[str, ...], ...]  # per tile
    cats: tuple[str, ...]  # per tile
    skeleton: str = ""

    def axis(self, name: str) -> Axis:
        return next(a for a in self.axes if a.name == name)

    @property
    def stream(self) -> Axis | None:
        return next((a for a in self.axes if a.role == "stream"), None)

    def shape(self, typ: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(1 if a == ONE else self.axis(a).size for a in typ)

    def to_obj(self) -> dict[str, Any]:
        from mirage_serve.mugraph.serialize import _op_to_obj

        return {
            "axes": [[a.name, a.size, a.role] for a in self.axes],
            "dtype": self.dtype,
            "inputs": [[i.name, list(i.axes)] for i in self.inputs],
            "ops": [_op_to_obj(op) for op in self.ops],
            "outputs": list(self.outputs),
            "types": [list(t) for t in self.types],
            "cats": list(self.cats),
            "skeleton": self.skeleton,
        }

    @staticmethod
    def from_obj(obj: dict[str, Any]) -> Program:
        from mirage_serve.mugraph.serialize import _op_from_obj

        return Program(
            tuple(Axis(n, int(s), r) for n, s, r in obj["axes"]),
            obj["dtype"],
            tuple(PInput(n, tuple(a)) for n, a in obj["inputs"]),
            tuple(_op_from_obj(o, f"program op {j}", "block") for j, o in enumerate(obj["ops"])),
            tuple(obj["outputs"]),
            tuple(tuple(t) for t in obj["types"]),
            tuple(obj["cats"]),
            obj.get("skeleton", ""),
        )


# ----------------------------------------------------------------------------- lowerings


@dataclass(frozen=True)
class Tiling:
    """How a block lowering tiles a program.

    ``grid``: (axis name, factor) per grid dim; the stream axis appears here in
    split mode (partial outputs combined by kernel operators). ``loop``: for-loop
    range. ``epilogue_in_kernel``: the block graph stops at the accumulators and
    the operators after them run as kernel operators (always so in split mode)."""

    grid: tuple[tuple[str, int], ...]
    loop: int
    epilogue_in_kernel: bool = False

    def split(self, prog: Program) -> int:
        s = prog.stream
        return next((f for a, f in self.grid if s is not None and a == s.name), 1)

    def describe(self) -> str:
        g = "x".join(f"{a}/{f}" for a, f in self.grid) or "1"
        return f"grid {g}, loop {self.loop}" + (", epilogue as kernel ops" if self.epilogue_in_kernel else "")


def _needed(prog: Program, roots: list[int], have: set[int] | frozenset[int] = frozenset()) -> set[int]:
    """Tiles the roots depend on, not looking behind tiles in ``have``."""
    n_in = len(prog.inputs)
    need, stack = set(), list(roots)
    while stack:
        t = stack.pop()
        if t in need:
            continue
        need.add(t)
        if t >= n_in and t not in have:
            stack.extend(prog.ops[t - n_in].inputs)
    return need


def _kernel_op(g: GraphBuilder, op: Op, ins: list[int]) -> int:
    """A program tile op at kernel level on whole tensors (the same attrs: tile dims are tensor dims)."""
    return g._add(Op.make(op.kind, tuple(ins), **op.a))


def _spec_ops(g: GraphBuilder, prog: Program, env: dict[int, int], upto: set[int] | None = None) -> None:
    """Lower the program's ops (those in ``upto``, default all) to kernel ops; accumulators become
    whole-tensor reductions. ``env`` maps program tiles to kernel tensors and is extended."""
    n_in = len(prog.inputs)
    s = prog.stream
    for j, op in enumerate(prog.ops):
        t = n_in + j
        if t in env or (upto is not None and t not in upto):
            continue
        ins = [env[x] for x in op.inputs]
        if op.kind != "accum":
            env[t] = _kernel_op(g, op, ins)
            continue
        fn = op.attr("fn")
        if fn in ("sum", "rescaled_sum"):
            env[t] = ins[0]
        elif fn in ("sum_last", "rescaled_sum_last"):
            env[t] = g.reduce("sum", ins[0], -1)
        elif fn == "max_last":
            env[t] = g.reduce("max", ins[0], -1)
        elif fn in ("mean_sq_last", "rms_last"):
            ms = g.unary("mul_scalar", g.reduce("sum", g.unary("square", ins[0]), -1), scalar=1.0 / s.size)
            env[t] = g.unary("sqrt", ms) if fn == "rms_last" else ms
        else:
            raise MuGraphError(f"program accumulator {fn!r} has no whole-tensor form")


def lower_spec(prog: Program) -> KernelGraph:
    """The unfused kernel graph: pre-defined operators on whole tensors."""
    g = GraphBuilder()
    env = {j: g.input(i.name, prog.shape(i.axes), prog.dtype) for j, i in enumerate(prog.inputs)}
    _spec_ops(g, prog, env, _needed(prog, list(prog.outputs)))
    return g.build([env[t] for t in prog.outputs])


def valid_tilings_grid_axes(prog: Program, out_tiles: list[int]) -> list[str]:
    """Par axes present in every tile the block writes (others would need partial outputs)."""
    common = None
    for t in out_tiles:
        ax = {a for a in prog.types[t] if a != ONE}
        common = ax if common is None else common & ax
    return sorted(a.name for a in prog.axes if a.role == "par" and a.name in (common or set()))


def block_outputs(prog: Program, tiling: Tiling) -> list[int]:
    """Program tiles the block graph writes under ``tiling``."""
    if not tiling.epilogue_in_kernel and tiling.split(prog) == 1:
        return list(prog.outputs)
    if not any(op.kind == "accum" for op in prog.ops):
        return list(prog.outputs)
    n_in = len(prog.inputs)
    need = _needed(prog, list(prog.outputs))
    outs = []
    for j, op in enumerate(prog.ops):
        t = n_in + j
        if op.kind != "accum" or t not in need:
            continue
        outs.append(t)
        if op.attr("fn").startswith("rescaled") and op.inputs[1] not in outs:
            outs.append(op.inputs[1])
    return sorted(set(outs))


def lower_block(prog: Program, tiling: Tiling) -> KernelGraph:
    """One customized operator (plus combining and epilogue kernel operators in split
    or epilogue mode) computing the program under ``tiling``. Raises MuGraphError if
    the tiling does not divide the axes."""
    split = tiling.split(prog)
    s = prog.stream
    n_in = len(prog.inputs)
    g = GraphBuilder()
    kin = [g.input(i.name, prog.shape(i.axes), prog.dtype) for i in prog.inputs]
    bouts = block_outputs(prog, tiling)
    in_block = _needed(prog, bouts)
    used_inputs = sorted(t for t in in_block if t < n_in)
    grid = tuple(f for _, f in tiling.grid) or (1,)
    b = BlockBuilder(grid, tiling.loop)
    remap: dict[int, int] = {}
    for t in used_inputs:
        axes = prog.inputs[t].axes
        imap = tuple(axes.index(a) if a in axes else -1 for a, _ in tiling.grid) or (-1,)
        fdim = axes.index(s.name) if s is not None and s.name in axes else -1
        remap[t] = b.input(len(remap), imap, fdim)
    for j, op in enumerate(prog.ops):
        t = n_in + j
        if t not in in_block:
            continue
        attrs = op.a
        if op.kind == "accum" and attrs.get("fn") == "rms_last" and split > 1:
            attrs = {**attrs, "fn": "mean_sq_last"}  # combined across splits, then sqrt
        remap[t] = b.op(op.kind, *[remap[x] for x in op.inputs], **attrs)
    for t in bouts:
        typ = prog.types[t]
        b.output(remap[t], tuple(typ.index(a) if a in typ else -1 for a, _ in tiling.grid) or (-1,))
    outs = g.customized([kin[t] for t in used_inputs], b.build())
    env: dict[int, int] = {}
    for t, k in zip(bouts, outs, strict=True):
        env[t] = k
    if bouts == list(prog.outputs) and not tiling.epilogue_in_kernel and split == 1:
        return g.build([env[t] for t in prog.outputs])
    # combine partial results (split mode), then the epilogue as kernel operators
    if split > 1:
        combined: dict[int, int] = {}
        maxes: dict[int, tuple[int, int]] = {}  # max tile -> (max over splits keepdim, factor exp(m_p - M))
        for t in bouts:
            op = prog.ops[t - n_in]
            if op.attr("fn") == "max_last":
                mk = g.reduce("max", env[t], 0, keepdim=True)
                maxes[t] = (mk, g.unary("exp", g.binary("sub", env[t], mk)))
                combined[t] = g.reduce("max", env[t], 0, keepdim=False)
        for t in bouts:
            fn = prog.ops[t - n_in].attr("fn")
            if fn == "max_last":
                continue
            if fn in ("sum", "sum_last"):
                combined[t] = g.reduce("sum", env[t], 0, keepdim=False)
            elif fn in ("mean_sq_last", "rms_last"):
                ms = g.unary("mul_scalar", g.reduce("sum", env[t], 0, keepdim=False), scalar=1.0 / split)
                combined[t] = g.unary("sqrt", ms) if fn == "rms_last" else ms
            elif fn.startswith("rescaled"):
                f = maxes[prog.ops[t - n_in].inputs[1]][1]
                combined[t] = g.reduce("sum", g.binary("mul", env[t], f), 0, keepdim=False)
            else:
                raise MuGraphError(f"accumulator {fn!r} cannot be combined across splits")
        env = combined
    for j in range(len(prog.inputs)):
        env.setdefault(j, kin[j])
    _spec_ops(g, prog, env, _needed(prog, list(prog.outputs), set(env)))
    return g.build([env[t] for t in prog.outputs])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def random_tiling(prog: Program, rng: random.Random, max_blocks: int = 8) -> Tiling:
    """A random tiling that divides every axis (grid of at most ``max_blocks`` programs)."""
    s = prog.stream
    epilogue = rng.random() < 0.2
    split = 1
    if s is not None and rng.random() < 0.3:
        split = rng.choice([d for d in divisors(s.size) if d <= 4])
    mode = Tiling((), 1, epilogue)
    if split > 1:
        mode = Tiling(((s.name, split),), 1, True)
    eligible = valid_tilings_grid_axes(prog, block_outputs(prog, mode))
    rng.shuffle(eligible)
    grid: list[tuple[str, int]] = []
    blocks = split
    for a in eligible[: rng.choice([0, 1, 1, 2, 2])]:
        opts = [d for d in divisors(prog.axis(a).size) if d * blocks <= max_blocks]
        f = rng.choice(opts)
        if f > 1 or rng.random() < 0.2:  # a size-1 grid dim now and then
            grid.append((a, f))
            blocks *= f
    if split > 1:
        grid.insert(rng.randrange(len(grid) + 1), (s.name, split))
    grid = grid[:3]
    loop = 1
    if s is not None:
        loop = rng.choice(divisors(s.size // split))
    return Tiling(tuple(grid), loop, epilogue or split > 1)


# ----------------------------------------------------------------------------- generation


class Reject(Exception):
    """The requested operator does not fit the program (the generator tries another)."""


@dataclass
class _Tile:
    typ: tuple[str, ...]
    cat: str
    pos: bool = False  # strictly positive, away from 0 (safe denominator / sqrt argument)
    nonneg: bool = False
    m: int | None = None  # chunk_m / partial_m: the max tile it was shifted by


def bcast(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...] | None:
    """Right-aligned broadcast of two tile types (None if they do not broadcast)."""
    n = max(len(a), len(b))
    pa, pb = (ONE,) * (n - len(a)) + a, (ONE,) * (n - len(b)) + b
    out = []
    for x, y in zip(pa, pb):
        if x == y or y == ONE:
            out.append(x)
        elif x == ONE:
            out.append(y)
        else:
            return None
    t = tuple(out)
    named = [x for x in t if x != ONE]
    return t if len(named) == len(set(named)) else None


def _plain_cat(cats: set[str]) -> str | None:
    """The category of a value combined from plain tiles (invariants with chunks, or invariants
    with post-loop values), or None when a partial or max-shifted tile takes part."""
    for cat, allowed in ((INV, {INV}), (CHUNK, {CHUNK, INV}), (POST, {POST, INV})):
        if cats <= allowed:
            return cat
    return None


SAFE_UNARY = ("neg", "mul_scalar", "add_scalar", "square", "silu", "exp")
POS_UNARY = ("sqrt", "rsqrt", "recip")
SCALARS = (0.5, 2.0, -1.5, 0.125, 0.3, 3.0, -0.7)
EPS = (1e-6, 1e-5, 0.1, 0.0)


@dataclass
class ProgBuilder:
    axes: list[Axis]
    dtype: str
    rng: random.Random
    inputs: list[PInput] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    tiles: list[_Tile] = field(default_factory=list)

    def ax(self, role: str) -> list[str]:
        return [a.name for a in self.axes if a.role == role]

    @property
    def stream(self) -> str | None:
        s = self.ax("stream")
        return s[0] if s else None

    def role(self, a: str) -> str:
        return "one" if a == ONE else next(x.role for x in self.axes if x.name == a)

    def input(self, axes: tuple[str, ...]) -> int:
        if self.ops:
            raise Reject("inputs come first")
        name = f"in{len(self.inputs)}"
        self.inputs.append(PInput(name, axes))
        self.tiles.append(_Tile(axes, CHUNK if self.stream in axes else INV))
        return len(self.tiles) - 1

    def _add(self, op: Op, tile: _Tile) -> int:
        if not 1 <= len(tile.typ) <= 3:
            raise Reject("rank")
        self.ops.append(op)
        self.tiles.append(tile)
        return len(self.tiles) - 1

    # -- operators --------------------------------------------------------------
    def unary(self, fn: str, x: int, scalar: float | None = None) -> int:
        t = self.tiles[x]
        if t.cat in (PARTIAL, PARTIAL_M, CHUNK_M) and fn not in ("neg", "mul_scalar"):
            raise Reject("non-linear op on a chunk partial or a max-shifted value")
        if t.cat == MAX:
            raise Reject("the running max is used only by the softmax template and after the loop")
        if fn in POS_UNARY and not t.pos:
            raise Reject("sqrt/rsqrt/recip need a positive argument")
        if fn in ("mul_scalar", "add_scalar") and scalar is None:
            scalar = self.rng.choice(SCALARS)
        pos = fn == "exp" or (fn in POS_UNARY and t.pos) or (fn == "add_scalar" and t.nonneg and scalar > 0) or (
            fn == "mul_scalar" and t.pos and scalar > 0)
        nonneg = pos or fn == "square" or (fn == "mul_scalar" and t.nonneg and scalar > 0)
        return self._add(Op.make("unary", (x,), fn=fn, scalar=scalar if fn in ("mul_scalar", "add_scalar") else None),
                         _Tile(t.typ, t.cat, pos, nonneg, t.m))

    def binary(self, fn: str, x: int, y: int) -> int:
        a, b = self.tiles[x], self.tiles[y]
        typ = bcast(a.typ, b.typ)
        if typ is None:
            raise Reject("types do not broadcast")
        cats = {a.cat, b.cat}
        if MAX in cats:
            raise Reject("running max outside the template")
        m = a.m if a.m is not None else b.m
        cat = _plain_cat(cats)
        if cat is not None:
            pass
        elif cats == {PARTIAL} or cats == {PARTIAL_M}:
            if fn not in ("add", "sub"):
                raise Reject("partials combine linearly")
            if a.m != b.m:
                raise Reject("partials of different maxima")
            cat = a.cat
        elif cats in ({PARTIAL, INV}, {PARTIAL_M, INV}):
            if not (fn == "mul" or (fn == "div" and b.cat == INV)):
                raise Reject("a partial scales only by an invariant")
            cat = a.cat if a.cat != INV else b.cat
        elif cats in ({CHUNK_M, CHUNK}, {CHUNK_M, INV}, {CHUNK_M}):
            if fn != "mul" or cats == {CHUNK_M}:
                raise Reject("a max-shifted value scales only by an independent factor")
            cat = CHUNK_M
        else:
            raise Reject(f"cannot combine {sorted(cats)}")
        if fn == "div" and not b.pos:
            raise Reject("denominator must be positive")
        pos = fn in ("mul", "div", "add") and a.pos and b.pos
        nonneg = pos or (fn in ("mul", "add") and a.nonneg and b.nonneg)
        return self._add(Op.make("binary", (x, y), fn=fn), _Tile(typ, cat, pos, nonneg, m))

    def matmul(self, x: int, y: int, trans_b: bool) -> int:
        a, b = self.tiles[x], self.tiles[y]
        if len(a.typ) < 2 or len(b.typ) < 2:
            raise Reject("matmul rank")
        k = a.typ[-1]
        bk, bn = (b.typ[-1], b.typ[-2]) if trans_b else (b.typ[-2], b.typ[-1])
        if k != bk or k == ONE:
            raise Reject("inner dims")
        if len(b.typ) == 3 and a.typ[:-2] != b.typ[:-2]:
            raise Reject("batch")
        if len(b.typ) > len(a.typ):
            raise Reject("batch")
        typ = a.typ[:-1] + (bn,)
        if len([x for x in typ if x != ONE]) != len({x for x in typ if x != ONE}):
            raise Reject("repeated axis")
        role = self.role(k)
        cats = {a.cat, b.cat}
        if MAX in cats or POST in cats and (cats & set(LOOP_CATS)):
            raise Reject("phases")
        if role == "stream":
            if cats <= {CHUNK, INV} and CHUNK in cats:
                cat, m = PARTIAL, None
            elif a.cat == CHUNK_M and b.cat in (CHUNK, INV):
                cat, m = PARTIAL_M, a.m
            else:
                raise Reject("stream contraction of these categories")
        elif role == "inner":
            cat = _plain_cat(cats)
            if cat is not None:
                pass
            elif cats in ({PARTIAL, INV},) and b.cat == INV:
                cat = PARTIAL
            elif cats in ({PARTIAL_M, INV},) and b.cat == INV:
                cat = PARTIAL_M
            else:
                raise Reject("inner contraction of these categories")
            m = a.m if a.m is not None else b.m
        else:
            raise Reject("contract only inner or stream axes")
        return self._add(Op.make("matmul", (x, y), trans_b=trans_b or None), _Tile(typ, cat, m=m))

    def reduce(self, fn: str, x: int, dim: int, keepdim: bool) -> int:
        t = self.tiles[x]
        d = dim % len(t.typ)
        a = t.typ[d]
        if a == ONE:
            raise Reject("reducing a size-1 dim")
        role = self.role(a)
        typ = t.typ[:d] + ((ONE,) if keepdim else ()) + t.typ[d + 1 :]
        if not typ:
            raise Reject("scalar")
        if role == "stream":
            if fn != "sum" or t.cat not in (CHUNK, CHUNK_M):
                raise Reject("stream reduce")
            cat = PARTIAL if t.cat == CHUNK else PARTIAL_M
        elif role == "inner":
            if t.cat in (PARTIAL, PARTIAL_M, CHUNK_M) and fn != "sum":
                raise Reject("max of a partial")
            if t.cat == MAX:
                raise Reject("max tile")
            cat = t.cat
        else:
            raise Reject("par axes are never reduced")
        return self._add(Op.make("reduce", (x,), fn=fn, dim=dim, keepdim=keepdim),
                         _Tile(typ, cat, t.pos and fn == "sum" or t.pos and fn == "max", t.nonneg, t.m))

    def rms_norm(self, x: int, w: int | None, eps: float) -> int:
        t = self.tiles[x]
        if self.role(t.typ[-1]) != "inner" or t.cat not in (INV, CHUNK, POST):
            raise Reject("rms_norm over an inner last axis only")
        ins: tuple[int, ...] = (x,)
        if w is not None:
            wt = self.tiles[w]
            if bcast(t.typ, wt.typ) != t.typ or wt.typ[-1] != t.typ[-1] or wt.cat not in (INV, t.cat):
                raise Reject("weight")
            if t.cat == POST and wt.cat not in (INV, POST) or t.cat == INV and wt.cat != INV:
                raise Reject("weight phase")
            ins = (x, w)
        return self._add(Op.make("rms_norm", ins, eps=eps), _Tile(t.typ, t.cat))

    def accum(self, fn: str, x: int, m: int | None = None) -> int:
        t = self.tiles[x]
        s = self.stream
        if fn == "sum":
            if t.cat != PARTIAL:
                raise Reject("sum accumulates chunk partials")
            return self._add(Op.make("accum", (x,), fn="sum"), _Tile(t.typ, POST))
        if fn == "rescaled_sum":
            if t.cat != PARTIAL_M or t.m != m:
                raise Reject("rescaled_sum of a max-shifted partial")
            return self._add(Op.make("accum", (x, m), fn=fn), _Tile(t.typ, POST))
        if t.typ[-1] != s:
            raise Reject("last-dim accumulators need the stream axis last")
        typ = t.typ[:-1] + (ONE,)
        if fn == "rescaled_sum_last":
            if t.cat != CHUNK_M or t.m != m:
                raise Reject("rescaled_sum_last of a max-shifted chunk")
            return self._add(Op.make("accum", (x, m), fn=fn), _Tile(typ, POST, t.pos, t.nonneg))
        if t.cat != CHUNK:
            raise Reject("accumulate a chunk")
        if fn == "max_last":
            return self._add(Op.make("accum", (x,), fn=fn), _Tile(typ, MAX))
        pos = fn in ("sum_last",) and t.pos
        nonneg = fn in ("mean_sq_last", "rms_last") or (fn == "sum_last" and t.nonneg)
        return self._add(Op.make("accum", (x,), fn=fn), _Tile(typ, POST, pos, nonneg))

    def shifted_exp(self, s: int, m: int) -> int:
        """p = exp(s - m) for the running max m = max_last(s)."""
        a = self.tiles[s]
        typ = bcast(a.typ, self.tiles[m].typ)
        d = self._add(Op.make("binary", (s, m), fn="sub"), _Tile(typ, CHUNK_M, m=m))
        return self._add(Op.make("unary", (d,), fn="exp"), _Tile(typ, CHUNK_M, True, True, m))

    def max_post(self, m: int) -> int:
        """The running max read after the loop (m_R), as an ordinary post value."""
        self.tiles[m] = _Tile(self.tiles[m].typ, POST)
        return m

    def build(self, outputs: list[int], skeleton: str) -> Program:
        n_in = len(self.inputs)
        for t in outputs:
            if self.tiles[t].cat not in (POST, INV):
                raise Reject("outputs are accumulated or invariant")
            if self.stream in self.tiles[t].typ:
                raise Reject("output keeps the stream axis")
        prog = Program(tuple(self.axes), self.dtype, tuple(self.inputs), tuple(self.ops), tuple(outputs),
                       tuple(t.typ for t in self.tiles), tuple(t.cat for t in self.tiles), skeleton)
        # shapes must validate at the IR level too
        infos = [TensorInfo(prog.shape(i.axes), prog.dtype) for i in prog.inputs]
        for j, op in enumerate(prog.ops):
            if op.kind != "accum":
                try:
                    info = infer_tile_op(op, [infos[x] for x in op.inputs], f"program op {j}")
                except MuGraphError as e:
                    raise Reject(str(e)) from e
                if info.shape != prog.shape(prog.types[n_in + j]):
                    raise Reject(f"program op {j}: shape {info.shape} != type {prog.types[n_in + j]}")
            infos.append(TensorInfo(prog.shape(prog.types[n_in + j]), prog.dtype))
        return prog


# ---- skeletons: each builds a program in a ProgBuilder and returns its outputs


def _axes(rng: random.Random, n_par: int, n_inner: int, stream: bool) -> list[Axis]:
    out = [Axis(n, rng.choice((1, 2, 3, 4, 4, 6, 8)), "par") for n in ("M", "N", "B")[:n_par]]
    out += [Axis(n, rng.choice((2, 3, 4, 5, 8, 8, 16)), "inner") for n in ("D", "E")[:n_inner]]
    if stream:
        out.append(Axis("S", rng.choice((4, 6, 8, 8, 12, 16, 16, 24, 32)), "stream"))
    return out


def _prologue(b: ProgBuilder, x: int, vecs: list[int], n: int) -> int:
    """A few element-wise operators on x with vectors that broadcast to it."""
    rng = b.rng
    for _ in range(n):
        try:
            if vecs and rng.random() < 0.5:
                v = rng.choice(vecs)
                x = b.binary(rng.choice(("mul", "add", "sub", "mul")), x, v) if rng.random() < 0.5 else b.binary(rng.choice(("mul", "add")), v, x)
            else:
                x = b.unary(rng.choice(SAFE_UNARY if b.tiles[x].cat != CHUNK_M else ("neg", "mul_scalar")), x)
        except Reject:
            pass
    return x


def _epilogue(b: ProgBuilder, x: int, others: list[int], n: int) -> int:
    rng = b.rng
    for _ in range(n):
        try:
            r = rng.random()
            if r < 0.35 and others:
                y = rng.choice(others)
                fn = rng.choice(("add", "mul", "sub", "div"))
                x = b.binary(fn, x, y) if rng.random() < 0.7 else b.binary(fn, y, x)
            elif r < 0.5:
                d = rng.randrange(len(b.tiles[x].typ))
                if b.role(b.tiles[x].typ[d]) == "inner":
                    x = b.reduce(rng.choice(("sum", "max")), x, d - len(b.tiles[x].typ) if rng.random() < 0.5 else d, rng.random() < 0.7)
            elif r < 0.6:
                x = b.rms_norm(x, None, rng.choice(EPS[:3]))
            else:
                fn = rng.choice(SAFE_UNARY + POS_UNARY)
                x = b.unary(fn, x)
        except Reject:
            pass
    return x


def sk_matmul(b: ProgBuilder) -> list[int]:
    """Y = epilogue(sum_i prologue(X_i) @ W_i), optionally with row statistics (RMSNorm→linear)."""
    rng = b.rng
    M, N, S = "M", rng.choice(b.ax("par")[1:] + b.ax("inner")) if len(b.ax("par")) > 1 or b.ax("inner") else None, b.stream
    if N is None:
        raise Reject("needs a second axis")
    batch = "B" in b.ax("par") and rng.random() < 0.5
    pre = ("B",) if batch else ()
    x = b.input(pre + (M, S))
    trans = rng.random() < 0.6
    w = b.input((pre if batch and rng.random() < 0.5 else ()) + ((N, S) if trans else (S, N)))
    vecs = [b.input((S,))] if rng.random() < 0.6 else []
    if rng.random() < 0.3:
        vecs.append(b.input(pre + (M, S)))
    bias = b.input((N,)) if rng.random() < 0.5 else None
    rowv = b.input(pre + (M, ONE)) if rng.random() < 0.3 else None
    xs = _prologue(b, x, vecs, rng.randrange(3))
    acc_in = b.matmul(xs, w, trans)
    if rng.random() < 0.3:
        acc_in = b.unary(rng.choice(("neg", "mul_scalar")), acc_in)
    acc = b.accum("sum", acc_in)
    stats = []
    for fn in rng.sample(("mean_sq_last", "rms_last", "sum_last", "max_last"), rng.randrange(3)):
        src = x if rng.random() < 0.6 else xs
        try:
            st = b.accum(fn, src)
            if fn == "max_last":
                st = b.max_post(st)
            stats.append(st)
        except Reject:
            pass
    y = acc
    for st in stats:
        try:
            t = st
            if b.tiles[st].nonneg:
                t = b.unary(rng.choice(("rsqrt", "sqrt", "recip")), b.unary("add_scalar", st, scalar=rng.choice((1e-6, 1e-5, 0.5))))
            y = b.binary(rng.choice(("mul", "add", "sub")), y, t)
        except Reject:
            pass
    others = [t for t in (bias, rowv) if t is not None]
    y = _epilogue(b, y, others, rng.randrange(4))
    outs = [y]
    if stats and rng.random() < 0.3:
        outs.append(stats[0])
    return outs


def sk_lora(b: ProgBuilder) -> list[int]:
    """Y = X @ W + s * (X @ A) @ B: two accumulators, a matmul over an inner axis after the loop."""
    rng = b.rng
    if not b.ax("inner") or len(b.ax("par")) < 2:
        raise Reject("needs N and a rank axis")
    M, N, R, S = "M", "N", b.ax("inner")[0], b.stream
    x = b.input((M, S))
    w = b.input((N, S))
    a = b.input((R, S))
    bb = b.input((N, R)) if rng.random() < 0.5 else b.input((R, N))
    main = b.accum("sum", b.matmul(x, w, True))
    xa = b.accum("sum", b.matmul(x, a, True))
    trans = b.tiles[bb].typ == (N, R)
    low = b.matmul(xa, bb, trans)
    if rng.random() < 0.6:
        low = b.unary("mul_scalar", low)
    y = b.binary(rng.choice(("add", "sub")), main, low)
    return [_epilogue(b, y, [], rng.randrange(3))]


def sk_softmax(b: ProgBuilder) -> list[int]:
    """Decode attention: online softmax (running max, rescaled sums) or plain exp sums."""
    rng = b.rng
    if not b.ax("inner"):
        raise Reject("needs a head dim")
    M, D, S = "M", b.ax("inner")[0], b.stream
    Y = rng.choice([D] + b.ax("inner")[1:] + [a for a in b.ax("par") if a not in ("M", "B")])
    batch = "B" in b.ax("par") and rng.random() < 0.6
    pre = ("B",) if batch else ()
    q = b.input(pre + (M, D))
    k = b.input(pre + (S, D)) if rng.random() < 0.7 else b.input(pre + (D, S))
    v = b.input(pre + (S, Y))
    qs = _prologue(b, q, [], rng.randrange(2))
    s = b.matmul(qs, k, b.tiles[k].typ[-1] == D)
    if rng.random() < 0.7:
        s = b.unary("mul_scalar", s, scalar=rng.choice((0.5, 0.25, 0.3536)))
    online = rng.random() < 0.75
    if online:
        m = b.accum("max_last", s)
        p = b.shifted_exp(s, m)
        if rng.random() < 0.2:
            p = b.unary("mul_scalar", p)
        lsum = b.accum("rescaled_sum_last", p, m)
        o = b.accum("rescaled_sum", b.matmul(p, v, False), m)
    else:
        p = b.unary("exp", s)
        lsum = b.accum("sum_last", p)
        o = b.accum("sum", b.matmul(p, v, False))
    y = b.binary("div", o, lsum)
    y = _epilogue(b, y, [], rng.randrange(3))
    outs = [y]
    if online and rng.random() < 0.25:
        outs.append(b.max_post(m))
    return outs


def sk_rowstat(b: ProgBuilder) -> list[int]:
    """Row statistics over the stream axis combined after the loop."""
    rng = b.rng
    pre = ("B",) if "B" in b.ax("par") and rng.random() < 0.4 else ()
    M = "M"
    x = b.input(pre + (M, b.stream))
    vecs = [b.input((b.stream,))] if rng.random() < 0.5 else []
    xs = _prologue(b, x, vecs, rng.randrange(4))
    accs = []
    for fn in rng.sample(("sum_last", "mean_sq_last", "rms_last", "max_last", "online"), rng.randint(1, 3)):
        try:
            if fn == "online":
                m = b.accum("max_last", xs)
                accs.append(b.accum("rescaled_sum_last", b.shifted_exp(xs, m), m))
            else:
                t = b.accum(fn, rng.choice((x, xs)))
                accs.append(b.max_post(t) if fn == "max_last" else t)
        except Reject:
            pass
    if not accs:
        raise Reject("no statistic")
    y = accs[0]
    for t in accs[1:]:
        try:
            y = b.binary(rng.choice(("add", "mul", "sub", "div")), y, t)
        except Reject:
            pass
    return [_epilogue(b, y, [], rng.randrange(3))]


def sk_elementwise(b: ProgBuilder) -> list[int]:
    """No loop: element-wise chains, reductions and rms_norm over inner axes."""
    rng = b.rng
    row, inner = "M", (b.ax("inner") or [None])[0]
    typ = (row, inner) if inner else (row,)
    if "N" in b.ax("par") and rng.random() < 0.5:
        typ = ("N",) + typ
    x = b.input(typ)
    others = [x]
    if rng.random() < 0.7:
        others.append(b.input(typ))
    if inner and rng.random() < 0.6:
        others.append(b.input((inner,)))
    if rng.random() < 0.3:
        others.append(b.input(typ[:-1] + (ONE,)))
    y = x
    for _ in range(rng.randint(1, 6)):
        try:
            r = rng.random()
            if r < 0.4:
                y = b.binary(rng.choice(("add", "sub", "mul", "div")), y, rng.choice(others)) if rng.random() < 0.7 else b.binary(
                    rng.choice(("add", "sub", "mul")), rng.choice(others), y)
            elif r < 0.55 and inner:
                y = b.rms_norm(y, rng.choice([None] + [o for o in others if b.tiles[o].typ == (inner,)]), rng.choice(EPS[:3]))
            elif r < 0.7 and inner:
                d = b.tiles[y].typ.index(inner) if inner in b.tiles[y].typ else None
                if d is not None:
                    y = b.reduce(rng.choice(("sum", "max")), y, d, rng.random() < 0.6)
            else:
                y = b.unary(rng.choice(SAFE_UNARY + POS_UNARY), y)
        except Reject:
            pass
    return [y]


SKELETONS = {"matmul": sk_matmul, "lora": sk_lora, "softmax": sk_softmax, "rowstat": sk_rowstat, "elementwise": sk_elementwise}
WEIGHTS = {"matmul": 4, "lora": 1, "softmax": 3, "rowstat": 2, "elementwise": 2}
DTYPE_WEIGHTS = {"float32": 5, "bfloat16": 4, "float16": 1}


def random_program(rng: random.Random, skeleton: str | None = None, dtype: str | None = None, tries: int = 50) -> Program:
    """A random program (retrying skeletons that do not fit the drawn axes)."""
    for _ in range(tries):
        name = skeleton or rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
        stream = name != "elementwise"
        n_par = rng.choice((1, 2, 2, 3)) if name != "lora" else 2
        n_inner = rng.choice((0, 1, 1, 2)) if name not in ("softmax", "lora") else rng.choice((1, 2))
        if name == "elementwise":
            n_inner = max(n_inner, rng.choice((0, 1, 1)))
        dt = dtype or rng.choices(list(DTYPE_WEIGHTS), list(DTYPE_WEIGHTS.values()))[0]
        b = ProgBuilder(_axes(rng, n_par, n_inner, stream), dt, rng)
        try:
            outs = SKELETONS[name](b)
            prog = b.build(outs, name)
        except Reject:
            continue
        if any(_numel(prog.shape(t)) > MAX_TENSOR for t in prog.types):
            continue
        return prog
    raise Reject(f"no program after {tries} tries")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
