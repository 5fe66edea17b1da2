"""Enumeration of μGraphs at two levels, in canonical order.

**Kernel level.** A kernel graph grows one operator at a time: a pre-defined
operator on existing tensors, or a customized operator whose block graph is
enumerated below. Every new tensor's abstract expression must be a possible
subexpression of the spec's (the pruning oracle), else the prefix is dropped.

**Block level.** For a customized operator we first choose, structurally, the
grid's dims and every input's input map and for-loop dim (:func:`map_choices`),
at *representative* sizes (each grid dim and the loop split in two where
possible). Abstract expressions do not depend on tile sizes, so the operator
structure is enumerated once per such choice; concrete grid sizes and loop
ranges are instantiated only for structurally complete candidates
(:func:`instantiations`).

**Canonical order.** An operator may be appended only if it reads the newest
tensor or its key ``(max input, inputs, kind, attrs)`` is greater than the
previous operator's; the greedy "smallest ready key first" order of any DAG
satisfies this, so every DAG is generated, and permutations of independent
operators are generated once.

**Partition tags** (the structural rules behind ``pruned_other``). Every tile
records, per dim, which partitioners split it (grid dims ``g0..g2`` and the
loop ``L``), over which partitioners it is an additive *partial* result (a
contraction or sum over a split dim) and over which it is *local* (a max over
a split dim, or anything computed from the running max ``M`` inside the loop).
An operator whose inputs disagree (a matmul contracting a dim split by the grid
on one side only, a non-linear function of a partial sum, a plain accumulator
of a value that depends on the running max, ...) computes a layout-dependent
function no spec has and is pruned. The tags also give each block output its
output map: the tile dim a grid dim splits, or a leading partial dim when the
grid dim only appears in the partial/local tags.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mirage_serve.mugraph.graph import (
    BINARY_FNS,
    REDUCE_FNS,
    UNARY_FNS,
    BlockGraph,
    BlockInput,
    BlockOutput,
    KernelGraph,
    MuGraphError,
    Op,
)
from mirage_serve.mugraph.shapes import TensorInfo, broadcast_shapes, infer_tile_op, tile_shape_of_input
from mirage_serve.search.labels import SpecLabels, op_labels, spec_labels, wildcard

log = logging.getLogger(__name__)

LOOP = "L"
RUNNING_MAX = "M"
_PHASE_RANK = {"invariant": 0, "both": 1, "loop": 2, "post": 2}
_LINEAR_UNARY = frozenset({"neg", "mul_scalar"})
_EMPTY: frozenset[str] = frozenset()


# --------------------------------------------------------------------------- statistics


@dataclass
class Counters:
    """What one piece of enumeration saw (summed over workers by the driver)."""

    enumerated: int = 0  # prefixes / candidate operators generated and checked
    pruned_abstract: int = 0  # rejected because the new expression is no possible subexpression
    pruned_other: int = 0  # rejected by shapes, phases, canonical order, partition rules, duplicates
    block_nodes: int = 0
    structures: int = 0  # structurally complete kernel graphs reached
    truncated: bool = False  # a node or time limit cut this piece short

    def add(self, other: Counters) -> None:
        self.enumerated += other.enumerated
        self.pruned_abstract += other.pruned_abstract
        self.pruned_other += other.pruned_other
        self.block_nodes += other.block_nodes
        self.structures += other.structures
        self.truncated = self.truncated or other.truncated


class Budget:
    """A deadline and a node limit of one map choice's enumeration."""

    def __init__(self, deadline: float | None, max_nodes: int) -> None:
        self.deadline = deadline
        self.max_nodes = max_nodes
        self.nodes = 0
        self.cut = False  # the enumeration stopped before it was complete

    def exhausted(self) -> bool:
        return self.nodes >= self.max_nodes or self.out_of_time()

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


# --------------------------------------------------------------------------- vocabulary


# Operators a spec's compound operators decompose into when the search splits
# them across a for-loop or a grid: an RMSNorm becomes a mean-of-squares (or
# RMS) accumulator, ``add_scalar(eps)``, ``rsqrt`` and products; a max
# reduction becomes a running-max accumulator with max-rescaled sums.
_DECOMPOSE_UNARY = {"rms_norm": ("rsqrt", "add_scalar")}
_DECOMPOSE_ACCUM = {"rms_norm": ("mean_sq_last", "rms_last"), "max": ("max_last", "rescaled_sum", "rescaled_sum_last")}
_ALWAYS_BINARY = ("add", "mul")  # combining partial results, scaling
_ALWAYS_REDUCE = ("sum",)  # combining partial results
_ALWAYS_ACCUM = ("sum", "sum_last")


@dataclass(frozen=True)
class Vocabulary:
    """The operator alphabet the search may use, read off the spec.

    Functions: the spec's own unary / binary / reduce functions, the operators
    its compound operators decompose into (``_DECOMPOSE_*``: RMSNorm, max), and
    the operators every split form needs (``add``/``mul`` to combine and scale
    partial results, ``sum`` reductions and accumulators). Parameters: the
    scalars of its scalar operators and the eps of its RMSNorms (also offered
    as ``add_scalar``, the form an RMSNorm takes when split into a loop).
    ``Vocabulary.full(spec)`` offers every operator of the IR instead."""

    mul_scalars: tuple[float, ...]
    add_scalars: tuple[float, ...]
    eps: tuple[float, ...]
    sum_to_sizes: tuple[int, ...] = ()
    unary_fns: tuple[str, ...] = UNARY_FNS
    binary_fns: tuple[str, ...] = BINARY_FNS
    reduce_fns: tuple[str, ...] = REDUCE_FNS
    accum_fns: tuple[str, ...] = ("sum", "sum_last", "mean_sq_last", "rms_last", "max_last", "rescaled_sum", "rescaled_sum_last")
    rms_norm: bool = True
    labels: SpecLabels | None = None  # index labels of the spec (mirage_serve.search.labels); None: no label rules

    @staticmethod
    def from_spec(spec: KernelGraph, full: bool = False) -> Vocabulary:
        mul, add, eps, sizes = set(), set(), set(), set()
        unary, binary, reduce, accum, kinds = set(), set(_ALWAYS_BINARY), set(_ALWAYS_REDUCE), set(_ALWAYS_ACCUM), set()

        def visit(op: Op) -> None:
            kinds.add(op.kind)
            fn = op.attr("fn")
            if op.kind == "unary":
                unary.add(fn)
                if fn == "mul_scalar":
                    mul.add(float(op.attr("scalar")))
                if fn == "add_scalar":
                    add.add(float(op.attr("scalar")))
            if op.kind == "binary":
                binary.add(fn)
            if op.kind == "reduce":
                reduce.add(fn)
                accum.update(_DECOMPOSE_ACCUM.get(fn, ()))
            if op.kind == "accum":
                accum.add(fn)
            if op.kind == "rms_norm":
                e = float(op.attr("eps", 0.0))
                eps.add(e)
                if e:
                    add.add(e)
                unary.update(_DECOMPOSE_UNARY["rms_norm"])
                accum.update(_DECOMPOSE_ACCUM["rms_norm"])
            if op.kind in ("sum_to",) or (op.kind == "accum" and fn == "sum_to"):
                sizes.add(int(op.attr("size")))
            if op.block is not None:
                for o in op.block.ops:
                    visit(o)

        for op in spec.ops:
            visit(op)
        if not add:
            unary.discard("add_scalar")
        if not mul:
            unary.discard("mul_scalar")
        base = dict(mul_scalars=tuple(sorted(mul)), add_scalars=tuple(sorted(add)), eps=tuple(sorted(eps)) or (0.0,),
                    sum_to_sizes=tuple(sorted(sizes)))
        try:
            base["labels"] = spec_labels(spec)
        except MuGraphError:
            base["labels"] = None
        if full:
            return Vocabulary(**base)
        return Vocabulary(**base,
                          unary_fns=tuple(f for f in UNARY_FNS if f in unary),
                          binary_fns=tuple(f for f in BINARY_FNS if f in binary),
                          reduce_fns=tuple(f for f in REDUCE_FNS if f in reduce),
                          accum_fns=tuple(f for f in Vocabulary.accum_fns if f in accum),
                          rms_norm="rms_norm" in kinds)

    def unary_ops(self) -> list[tuple[str, float | None]]:
        out: list[tuple[str, float | None]] = []
        for fn in self.unary_fns:
            if fn == "mul_scalar":
                out.extend((fn, s) for s in self.mul_scalars)
            elif fn == "add_scalar":
                out.extend((fn, s) for s in self.add_scalars)
            else:
                out.append((fn, None))
        return out


# --------------------------------------------------------------------------- expressions


class ExprEngine:
    """The search's view of abstract expressions and the pruning oracle.

    ``abstract`` provides ``graph_exprs``, ``kernel_op_expr`` and
    ``block_op_expr``; ``oracle`` provides ``is_possible_subexpr`` and
    ``matches_output``. With ``prune`` off every prefix is kept (only the
    structural rules apply) and expressions are only computed to recognise
    complete graphs."""

    def __init__(self, abstract: Any, oracle: Any, prune: bool = True) -> None:
        self.abstract = abstract
        self.oracle = oracle
        self.prune = prune

    def graph_exprs(self, graph: KernelGraph) -> list[Any]:
        return list(self.abstract.graph_exprs(graph))

    def kernel_op_exprs(self, op: Op, in_exprs: list[Any], in_infos: list[TensorInfo], prefix: KernelGraph) -> list[Any]:
        """Expressions of the outputs of ``op`` appended to ``prefix``."""
        out = None
        if op.kind == "customized" and hasattr(self.abstract, "block_exprs"):
            out = self.abstract.block_exprs(op.block, in_exprs, in_infos)[1]
        elif op.kind != "customized":
            try:
                out = self.abstract.kernel_op_expr(op, in_exprs, in_infos)
            except (NotImplementedError, AttributeError):
                out = None
        if out is None:
            ext = KernelGraph(prefix.ops + (op,), (prefix.num_tensors,))
            return self.graph_exprs(ext)[prefix.num_tensors :]
        return list(out) if isinstance(out, list | tuple) else [out]

    def block_expr(self, op: Op, in_exprs: list[Any], in_infos: list[TensorInfo], forloop_range: int) -> Any:
        if not self.prune:
            return None
        return self.abstract.block_op_expr(op, in_exprs, in_infos, forloop_range)

    def fingerprint(self, expr: Any) -> Any:
        """What two tensors with equal expressions share (their normal form where the
        abstraction has one): an operator producing a tile equal to an existing one
        is redundant."""
        if expr is None:
            return None
        nf = getattr(self.abstract, "normal_form", None)
        return nf(expr) if nf is not None else None

    def collapsed(self, expr: Any) -> bool:
        """True for a tile the abstraction reduces to a number although it is computed
        from inputs: a difference of maxima over different ranges (maxima are
        size-free), an exp of one. Such a tile is not truly constant (the
        max-rescaling factor exp(m_i - M) of a split softmax is one), so an operator
        reading it is not a duplicate of its other operand even when their
        expressions agree."""
        fp = self.fingerprint(expr)
        is_const = getattr(self.abstract, "is_constant", None)
        return fp is not None and is_const is not None and bool(is_const(fp))

    def possible(self, expr: Any) -> bool:
        if not self.prune or expr is None:
            return True
        return bool(self.oracle.is_possible_subexpr(expr))

    def matches(self, expr: Any, index: int) -> bool:
        return expr is not None and bool(self.oracle.matches_output(expr, index))


# --------------------------------------------------------------------------- partition tags


@dataclass(frozen=True)
class Tags:
    dims: tuple[frozenset[str], ...]
    partial: frozenset[str] = _EMPTY
    local: frozenset[str] = _EMPTY

    def varies(self) -> frozenset[str]:
        out = set(self.partial)
        for d in self.dims:
            out |= d
        return frozenset(out)


def _combine_dims(a: tuple[int, ...], ta: Tags, b: tuple[int, ...], tb: Tags) -> tuple[frozenset[str], ...] | None:
    """Broadcast two tiles' dim tags; None if a split dim meets a differently split one."""
    n = max(len(a), len(b))
    pa, pb = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    da = (_EMPTY,) * (n - len(a)) + ta.dims
    db = (_EMPTY,) * (n - len(b)) + tb.dims
    out = []
    for sa, sb, xa, xb in zip(pa, pb, da, db, strict=True):
        if xa == xb:
            out.append(xa)
        elif sa == 1 and not xa:
            out.append(xb)
        elif sb == 1 and not xb:
            out.append(xa)
        else:
            return None
    return tuple(out)


def _linear_ok(ta: Tags, tb: Tags) -> bool:
    """A product of a partial sum with something varying over the same split is not a partial sum."""
    return not (ta.partial & tb.varies()) and not (tb.partial & ta.varies())


def tile_tags(op: Op, ins: list[TensorInfo], tags: list[Tags], out: TensorInfo) -> Tags | None:
    """Partition tags of a tile operator's output, or None if the operator mixes
    partitions inconsistently (see the module docstring)."""
    kind = op.kind
    local = frozenset().union(*(t.local for t in tags))
    if out.phase == "loop" and any(i.phase == "both" for i in ins):
        local = local | {RUNNING_MAX}
    if kind == "unary":
        t = tags[0]
        if t.partial and op.attr("fn") not in _LINEAR_UNARY:
            return None
        return Tags(t.dims, t.partial, local)
    if kind == "binary":
        ta, tb = tags
        dims = _combine_dims(ins[0].shape, ta, ins[1].shape, tb)
        if dims is None:
            return None
        fn = op.attr("fn")
        if fn in ("add", "sub"):
            if ta.partial != tb.partial:
                return None
            partial = ta.partial
        elif fn == "mul":
            if not _linear_ok(ta, tb):
                return None
            partial = ta.partial | tb.partial
        else:  # div: linear in the numerator only
            if tb.partial or (ta.partial & tb.varies()):
                return None
            partial = ta.partial
        return Tags(dims, partial, local)
    if kind == "matmul":
        ta, tb = tags
        a, b = ins[0].shape, ins[1].shape
        trans = bool(op.attr("trans_b"))
        ka, kb = ta.dims[-1], (tb.dims[-1] if trans else tb.dims[-2])
        if ka != kb or not _linear_ok(ta, tb):
            return None
        n_tag = tb.dims[-2] if trans else tb.dims[-1]
        batch_a, batch_b = ta.dims[:-2], tb.dims[:-2]
        if len(b) > 2:
            bd = _combine_dims(a[:-2], Tags(batch_a), b[:-2], Tags(batch_b))
            if bd is None:
                return None
            batch_a = bd
        if n_tag & ta.varies() - ka or ta.dims[-2] & tb.varies() - kb:
            return None
        return Tags(batch_a + (ta.dims[-2], n_tag), ta.partial | tb.partial | ka, local)
    if kind == "reduce":
        t = tags[0]
        d = op.attr("dim", -1) % len(ins[0].shape)
        red = t.dims[d]
        if op.attr("fn") == "max":
            if t.partial or LOOP in red:
                return None
            partial, local = t.partial, local | red
        else:
            partial = t.partial | red
        keep = op.attr("keepdim", True)
        dims = t.dims[:d] + ((_EMPTY,) if keep else ()) + t.dims[d + 1 :]
        return Tags(dims, partial, local)
    if kind == "rms_norm":
        t = tags[0]
        if t.partial or t.dims[-1]:
            return None
        if len(tags) == 2:
            if tags[1].partial:
                return None
            dims = _combine_dims(ins[0].shape, t, ins[1].shape, tags[1])
            if dims is None:
                return None
            return Tags(dims, _EMPTY, local)
        return Tags(t.dims, _EMPTY, local)
    if kind == "concat":
        d = op.attr("dim", 0) % len(ins[0].shape)
        first = tags[0]
        for t in tags:
            if t.dims[d] or t.partial != first.partial or t.local != first.local or t.varies() != first.varies():
                return None
            if any(t.dims[k] != first.dims[k] for k in range(len(t.dims)) if k != d):
                return None
        return Tags(first.dims, first.partial, local)
    if kind == "sum_to":
        t = tags[0]
        if t.dims[-1]:
            return None
        return Tags(t.dims, t.partial, local)
    return None


def accum_tags(fn: str, x: Tags) -> Tags | None:
    """Partition tags after a for-loop accumulator, or None if it does not
    accumulate a loop-split quantity consistently."""
    others = x.dims[:-1]
    last = x.dims[-1]
    if any(LOOP in d for d in others):
        return None
    rescaled = fn.startswith("rescaled")
    if (RUNNING_MAX in x.local) != rescaled:
        return None  # a value scaled by the running max needs a rescaled accumulator, and only it
    local = x.local - {RUNNING_MAX}
    if fn in ("sum", "rescaled_sum"):
        if LOOP not in x.partial or LOOP in last:
            return None
        return Tags(x.dims, x.partial - {LOOP}, local)
    if fn in ("sum_last", "rescaled_sum_last"):
        if LOOP not in (last | x.partial):
            return None
        return Tags(others + (_EMPTY,), (x.partial | last) - {LOOP}, local)
    if fn in ("mean_sq_last", "rms_last"):
        if x.partial or LOOP not in last or local:
            return None
        return Tags(others + (_EMPTY,), last - {LOOP}, local)
    if fn == "max_last":
        if x.partial or LOOP not in last:
            return None
        return Tags(others + (_EMPTY,), _EMPTY, local | (last - {LOOP}))
    if fn == "sum_to":
        if LOOP not in last:
            return None
        return Tags(x.dims[:-1] + (_EMPTY,), x.partial | (last - {LOOP}), local)
    return None


def accum_info(fn: str, ins: list[TensorInfo], size: int | None) -> TensorInfo:
    """Shape and phase of an accumulator's output (raises MuGraphError like the IR does)."""
    x = ins[0]
    if fn.startswith("rescaled"):
        broadcast_shapes(x.shape, ins[1].shape, "accumulator")
    shape = x.shape
    if fn in ("sum_last", "mean_sq_last", "rms_last", "max_last", "rescaled_sum_last"):
        shape = shape[:-1] + (1,)
    elif fn == "sum_to":
        if size is None or shape[-1] % size:
            raise MuGraphError(f"sum_to size {size} does not divide {shape[-1]}")
        shape = shape[:-1] + (size,)
    return TensorInfo(shape, x.dtype, "both" if fn == "max_last" else "post")


# --------------------------------------------------------------------------- input maps


@dataclass(frozen=True)
class MapChoice:
    """One structural choice for a customized operator: grid rank, every input's
    input map and for-loop dim, and the representative sizes used while the
    operator structure is enumerated."""

    sources: tuple[int, ...]  # kernel tensor ids read by the operator
    input_maps: tuple[tuple[int, ...], ...]
    forloop_dims: tuple[int, ...]
    grid: tuple[int, ...]  # representative
    forloop_range: int  # representative

    def block_inputs(self) -> tuple[BlockInput, ...]:
        return tuple(BlockInput(j, m, f) for j, (m, f) in enumerate(zip(self.input_maps, self.forloop_dims, strict=True)))


def _smallest_split(n: int) -> int:
    for p in range(2, int(math.isqrt(n)) + 1):
        if n % p == 0:
            return p
    return n


def map_choices(infos: list[TensorInfo], max_grid_dims: int, counters: Counters | None = None,
                labels: list | None = None, spec_lab: SpecLabels | None = None) -> list[MapChoice]:
    """Every structurally sensible (input maps, loop dims) choice for a customized
    operator reading tensors with ``infos`` (sources are 0..n-1; the caller maps
    them to kernel tensor ids).

    Rules (each rejected choice counts in ``pruned_other``): every grid dim is
    split by at least one input and all dims it splits have the same extent (>1);
    all loop dims have the same extent (>1) and the same grid splits; grid dims
    appear in canonical order (their per-input columns sorted). With index labels
    (``labels`` of the inputs, ``spec_lab``): the dims one grid dim splits carry
    one label, every input carrying that label is split along it, and the loop runs along a label the spec contracts (a loop tile
    leaves the loop only through an accumulator, which sums or maxes along it), in every input that carries it."""
    counters = counters or Counters()
    out: list[MapChoice] = []
    for rank in range(1, max_grid_dims + 1):
        per_input = []
        for info in infos:
            r = len(info.shape)
            opts = []
            for imap in itertools.product(range(-1, r), repeat=rank):
                used = [d for d in imap if d >= 0]
                if len(used) != len(set(used)) or any(info.shape[d] < 2 for d in used):
                    continue
                for f in range(-1, r):
                    if f >= 0 and info.shape[f] < 2:
                        continue
                    opts.append((imap, f))
            per_input.append(opts)
        for combo in itertools.product(*per_input):
            counters.enumerated += 1
            choice = _check_maps(infos, rank, combo)
            if choice is not None and labels is not None and spec_lab is not None and not _labels_fit(combo, rank, labels, spec_lab):
                choice = None
            if choice is None:
                counters.pruned_other += 1
                continue
            out.append(choice)
    return out


def _labels_fit(combo, rank: int, labels: list, spec_lab: SpecLabels) -> bool:
    for g in range(rank):
        seen = {labels[j][m[g]] for j, (m, _) in enumerate(combo) if m[g] >= 0} - {None}
        if len(seen) > 1:
            return False
        # aligned: a label split by this grid dim is split in every input that carries it
        # (a block holding one input's slice of it and another input's whole extent can only
        # combine them after reducing the whole one, which no spec label relation allows)
        for label in seen:
            for j, (m, _) in enumerate(combo):
                if label in labels[j] and m[g] < 0:
                    return False
    loop = {labels[j][f] for j, (_, f) in enumerate(combo) if f >= 0} - {None}
    if len(loop) > 1 or not all(spec_lab.is_contracted(x) for x in loop):
        return False
    # aligned loop: every input carrying the loop's label streams along it. A block holding one
    # input's whole extent of it and another's chunk can only combine them at forloop_range 1,
    # which is the choice where neither streams
    for label in loop:
        for j, (_, f) in enumerate(combo):
            if label in labels[j] and (f < 0 or labels[j][f] != label):
                return False
    return True


def final_grid_ok(choice: MapChoice, labels: list, spec_lab: SpecLabels) -> bool:
    """In the operator that produces the spec's outputs, every grid dim must split
    a label of those outputs: a grid dim along any other label (one the spec
    contracts) makes partial results, which need a later operator to combine
    them, and a kept dim of another label would not be in the output's shape."""
    for g in range(len(choice.grid)):
        for j, m in enumerate(choice.input_maps):
            if m[g] >= 0 and not spec_lab.in_outputs(labels[j][m[g]]):
                return False
    return True


def _check_maps(infos: list[TensorInfo], rank: int, combo) -> MapChoice | None:
    columns = []
    grid = []
    for g in range(rank):
        col = tuple(m[g] for m, _ in combo)
        extents = {infos[j].shape[d] for j, d in enumerate(col) if d >= 0}
        if len(extents) != 1:
            return None
        columns.append(tuple(d if d >= 0 else 99 for d in col))
        grid.append(_smallest_split(extents.pop()))
    if columns != sorted(columns) or len(set(columns)) != len(columns):
        return None
    loop = set()
    for j, (m, f) in enumerate(combo):
        if f >= 0:
            loop.add((infos[j].shape[f], tuple(g for g in range(rank) if m[g] == f)))
    if len(loop) > 1:
        return None
    rng = 1
    if loop:
        extent, gsplit = loop.pop()
        for g in gsplit:
            if extent % grid[g]:
                return None
            extent //= grid[g]
        if extent < 2:
            return None
        rng = _smallest_split(extent)
    try:
        for j, (m, f) in enumerate(combo):
            tile_shape_of_input(infos[j].shape, tuple(grid), m, f, rng, "map choice")
    except MuGraphError:
        return None
    return MapChoice(tuple(range(len(infos))), tuple(m for m, _ in combo), tuple(f for _, f in combo), tuple(grid), rng)


def min_input_tile_bytes(choice: MapChoice, infos: list[TensorInfo], cfg) -> int:
    """A lower bound of the shared memory the input tiles of ``choice`` need at
    any instantiation :func:`instantiations` may pick: every grid-split dim at its
    largest grid option (of either role), every loop dim at its smallest chunk,
    other dims whole. :func:`instantiations` rejects any concrete operator whose
    tiles exceed ``cfg.target.smem_per_block``, so a choice whose bound already
    exceeds it has no instantiation and is pruned before its operators are enumerated."""
    from mirage_serve.search.cost import DTYPE_BYTES

    total = 0
    for j, (imap, f) in enumerate(zip(choice.input_maps, choice.forloop_dims, strict=True)):
        shape = infos[j].shape
        numel = 1
        for d, extent in enumerate(shape):
            size = extent
            if d in imap:
                grids = _grid_options(extent, "tile", cfg) + _grid_options(extent, "split", cfg)
                if grids:
                    size = max(1, extent // max(grids))
            if f == d:
                size = min(size, min(cfg.loop_chunks))
            numel *= size
        total += numel * DTYPE_BYTES.get(infos[j].dtype, 4)
    return total


# --------------------------------------------------------------------------- block graphs


@dataclass
class _BlockState:
    infos: list[TensorInfo]
    tags: list[Tags]
    exprs: list[Any]
    ops: list[Op]
    uses: list[int]
    max_ids: list[int] = field(default_factory=list)
    keys: list[tuple] = field(default_factory=list)
    op_set: set = field(default_factory=set)
    fps: dict = field(default_factory=dict)  # (fingerprint, shape, phase, tags) -> count
    labels: list = field(default_factory=list)  # index labels per tile (mirage_serve.search.labels)
    sigs: list = field(default_factory=list)  # per tile: an id of (info, tags, labels, expr, is running max)


def _tile_fp(engine: ExprEngine, expr: Any, info: TensorInfo, tags: Tags) -> Any:
    fp = engine.fingerprint(expr)
    return None if fp is None else (fp, info.shape, info.phase, tags)


def _live_bound_ok(st: _BlockState, n_in: int, remaining: int, max_outputs: int) -> bool:
    """Can ``remaining`` more operators still consume every input and every loop
    tile and leave at most ``max_outputs`` unconsumed tiles? Each operator reads at
    most two tiles and leaves its own result unconsumed, so it lowers the count
    of (unconsumed results + unused inputs) by at most one and consumes at most
    two of the tiles that must be consumed."""
    unused = sum(1 for j in range(n_in) if st.uses[j] == 0)
    sinks = loop_sinks = 0
    for t in range(n_in, len(st.infos)):
        if st.uses[t] == 0:
            sinks += 1
            loop_sinks += st.infos[t].phase == "loop"
    return sinks + unused - remaining <= max_outputs and loop_sinks + unused <= 2 * remaining


def _op_key(op: Op) -> tuple:
    return (max(op.inputs), op.inputs, op.kind, tuple((k, repr(v)) for k, v in op.attrs))


def _reduce_ops(vocab: Vocabulary, t: int, rank: int) -> Iterator[Op]:
    """Every reduction of tensor or tile ``t`` (each dim, kept or dropped)."""
    for fn in vocab.reduce_fns:
        for d in range(rank):
            yield Op.make("reduce", (t,), fn=fn, dim=d, keepdim=True)
            if rank > 1:
                yield Op.make("reduce", (t,), fn=fn, dim=d, keepdim=False)


def _single_ops(vocab: Vocabulary, t: int, info: TensorInfo) -> Iterator[Op]:
    """Every tile operator reading only tile ``t``."""
    rank = len(info.shape)
    for fn, sc in vocab.unary_ops():
        yield Op.make("unary", (t,), fn=fn, scalar=sc)
    yield from _reduce_ops(vocab, t, rank)
    for e in vocab.eps if vocab.rms_norm else ():
        yield Op.make("rms_norm", (t,), eps=e)
    for sz in vocab.sum_to_sizes:
        yield Op.make("sum_to", (t,), size=sz)
    if info.phase == "loop":
        for fn in vocab.accum_fns:
            if not fn.startswith("rescaled"):
                yield Op.make("accum", (t,), fn=fn)
        for sz in vocab.sum_to_sizes:
            yield Op.make("accum", (t,), fn="sum_to", size=sz)


def _pair_ops(vocab: Vocabulary, a: int, b: int, ia: TensorInfo, ib: TensorInfo, b_is_max: bool) -> Iterator[Op]:
    """Every tile operator reading tiles ``a`` and ``b`` in this order (operators
    that need distinct tiles or an order of commutative operands are filtered by
    the caller, which knows the tile ids)."""
    if {ia.phase, ib.phase} == {"loop", "post"}:
        return
    for fn in vocab.binary_fns:
        yield Op.make("binary", (a, b), fn=fn)
    ra, rb = len(ia.shape), len(ib.shape)
    if ra >= 2 and ra == rb:
        yield Op.make("matmul", (a, b))
        yield Op.make("matmul", (a, b), trans_b=True)
    if ra == rb:
        for d in range(ra):
            yield Op.make("concat", (a, b), dim=d)
        for e in vocab.eps if vocab.rms_norm else ():
            yield Op.make("rms_norm", (a, b), eps=e)
    if b_is_max and ia.phase == "loop" and "rescaled_sum" in vocab.accum_fns:
        yield Op.make("accum", (a, b), fn="rescaled_sum")
        yield Op.make("accum", (a, b), fn="rescaled_sum_last")


def _id_ok(op: Op) -> bool:
    """The tile-id rules: commutative operands in order, distinct tiles where needed."""
    ins = op.inputs
    if len(ins) != 2:
        return True
    a, b = ins
    fn = op.attr("fn")
    if op.kind == "binary":
        return not ((fn in ("add", "mul") and a > b) or (fn in ("sub", "div") and a == b))
    if op.kind in ("concat", "rms_norm", "accum"):
        return a != b
    return True


def _templates(st: _BlockState, ctx: _BlockCtx, inputs: tuple[int, ...]):
    """The operators on these tiles, evaluated once per tile signatures:
    (valid [(kind, attrs, attrs key, outcome)], #rejected by other rules, #rejected abstractly)."""
    key = tuple(st.sigs[t] for t in inputs)
    hit = ctx.templates.get(key)
    if hit is not None:
        return hit
    if len(inputs) == 1:
        ops = _single_ops(ctx.vocab, inputs[0], st.infos[inputs[0]])
    else:
        a, b = inputs
        ops = _pair_ops(ctx.vocab, a, b, st.infos[a], st.infos[b], b in st.max_ids)
    valid, other, abstract = [], 0, 0
    for op in ops:
        res = _evaluate(st, ctx, op)
        if res == "other":
            other += 1
        elif res == "abstract":
            abstract += 1
        else:
            valid.append((op.kind, op.attrs, tuple((k, repr(v)) for k, v in op.attrs), res, op))
    hit = ctx.templates[key] = (valid, other, abstract)
    return hit


def _weight_fits(op: Op, ins: list[TensorInfo]) -> bool:
    """An RMSNorm weight must broadcast to x's shape, not enlarge it."""
    if op.kind != "rms_norm" or len(ins) < 2:
        return True
    return broadcast_shapes(ins[0].shape, ins[1].shape, "rms_norm") == ins[0].shape


def _try_block_op(st: _BlockState, op: Op, spec_lab: SpecLabels | None = None) -> tuple[TensorInfo, Tags, tuple] | None:
    ins = [st.infos[t] for t in op.inputs]
    tags = [st.tags[t] for t in op.inputs]
    try:
        if op.kind == "accum":
            fn = op.attr("fn")
            if ins[0].phase != "loop":
                return None
            if fn.startswith("rescaled") and op.inputs[1] not in st.max_ids:
                return None
            info = accum_info(fn, ins, op.attr("size"))
            tg = accum_tags(fn, tags[0])
        else:
            phases = {i.phase for i in ins}
            if "loop" in phases and "post" in phases:
                return None
            if op.kind in ("rms_norm", "matmul") and len(ins) == 2 and len(ins[0].shape) != len(ins[1].shape):
                return None  # tiles carry grid dims in front: keep operand ranks equal so nothing broadcasts across them
            shape_info = infer_tile_op(op, ins, "candidate")
            if not 1 <= len(shape_info.shape) <= 4 or not _weight_fits(op, ins):
                return None
            phase = max(phases, key=_PHASE_RANK.__getitem__)
            info = TensorInfo(shape_info.shape, shape_info.dtype, phase)
            tg = tile_tags(op, ins, tags, info)
    except MuGraphError:
        return None
    if tg is None or len(tg.dims) != len(info.shape):
        return None
    if spec_lab is None or not st.labels:
        return info, tg, wildcard(len(info.shape))
    lab = op_labels(op, [i.shape for i in ins], [st.labels[t] for t in op.inputs], info.shape, spec_lab)
    if lab is None:
        return None
    return info, tg, lab


def output_map_of(tags: Tags, grid_rank: int) -> tuple[int, ...] | None:
    """The output map a tile's tags imply, or None if some grid dim would write
    the same values from several blocks (the tile does not vary along it)."""
    omap = []
    for g in range(grid_rank):
        name = f"g{g}"
        dims = [d for d, s in enumerate(tags.dims) if name in s]
        if dims:
            omap.append(dims[0])
        elif name in tags.partial or name in tags.local:
            omap.append(-1)
        else:
            return None
    return tuple(omap)


@dataclass(frozen=True)
class BlockCompletion:
    """A structurally complete customized operator (representative sizes)."""

    op: Op  # kind customized, inputs = kernel tensor ids
    exprs: tuple[Any, ...]  # abstract expressions of its outputs


def enumerate_blocks(
    choice: MapChoice,
    sources: tuple[int, ...],
    kernel_infos: list[TensorInfo],
    kernel_exprs: list[Any],
    prefix: KernelGraph,
    engine: ExprEngine,
    vocab: Vocabulary,
    max_ops: int,
    max_outputs: int,
    counters: Counters,
    budget: Budget,
    kernel_labels: list | None = None,
) -> Iterator[BlockCompletion]:
    """Depth-first over the operator structures of one map choice; yields every
    complete customized operator whose outputs' expressions pass the oracle."""
    rank = len(choice.grid)
    in_infos = [kernel_infos[s] for s in sources]
    infos, tags, exprs = [], [], []
    for j, bi in enumerate(choice.block_inputs()):
        shape = tile_shape_of_input(in_infos[j].shape, choice.grid, bi.input_map, bi.forloop_dim, choice.forloop_range, "tile")
        infos.append(TensorInfo(shape, in_infos[j].dtype, "invariant" if bi.forloop_dim == -1 else "loop"))
        dims = []
        for d in range(len(shape)):
            s = {f"g{g}" for g in range(rank) if bi.input_map[g] == d}
            if bi.forloop_dim == d:
                s.add(LOOP)
            dims.append(frozenset(s))
        tags.append(Tags(tuple(dims)))
        exprs.append(kernel_exprs[sources[j]])
    st = _BlockState(infos, tags, exprs, [], [0] * len(infos))
    if kernel_labels is not None and vocab.labels is not None:
        st.labels = [tuple(kernel_labels[s]) for s in sources]
    for e, i, t in zip(exprs, infos, tags, strict=True):
        fp = _tile_fp(engine, e, i, t)
        if fp is not None:
            st.fps[fp] = st.fps.get(fp, 0) + 1
    ctx = _BlockCtx(choice, sources, kernel_infos, kernel_exprs, prefix, engine, vocab, max_ops, max_outputs, counters, budget)
    st.sigs = [ctx.sig(i, t, st.labels[j] if st.labels else None, e, False) for j, (i, t, e) in enumerate(zip(infos, tags, exprs, strict=True))]
    yield from _block_dfs(st, ctx)


@dataclass
class _BlockCtx:
    choice: MapChoice
    sources: tuple[int, ...]
    kernel_infos: list[TensorInfo]
    kernel_exprs: list[Any]
    prefix: KernelGraph
    engine: ExprEngine
    vocab: Vocabulary
    max_ops: int
    max_outputs: int
    counters: Counters
    budget: Budget
    # operator outcomes by input tile signatures: the same operators on equal
    # tiles are checked once per enumeration, whatever the node
    sig_ids: dict = field(default_factory=dict)
    templates: dict = field(default_factory=dict)

    def sig(self, info: TensorInfo, tags: Tags, label: Any, expr: Any, is_max: bool) -> int:
        key = (info, tags, label, expr, is_max)
        sid = self.sig_ids.get(key)
        if sid is None:
            sid = self.sig_ids[key] = len(self.sig_ids)
        return sid


def _evaluate(st: _BlockState, ctx: _BlockCtx, op: Op):
    """(info, tags, labels, expr, fingerprint) of ``op`` on the current tiles, or
    ("other" | "abstract") naming the rule that rejects it."""
    res = _try_block_op(st, op, ctx.vocab.labels)
    if res is None:
        return "other"
    info, tg, lab = res
    in_exprs = [st.exprs[t] for t in op.inputs]
    expr = ctx.engine.block_expr(op, in_exprs, [st.infos[t] for t in op.inputs], ctx.choice.forloop_range)
    if not ctx.engine.possible(expr):
        return "abstract"
    if st.labels and ctx.vocab.labels is not None and not ctx.vocab.labels.summand_ok(
            op, in_exprs, [st.labels[t] for t in op.inputs], [st.infos[t].shape for t in op.inputs]):
        return "abstract"  # a sum over an index of the wrong product (axiom 5 with indices)
    return info, tg, lab, expr, _tile_fp(ctx.engine, expr, info, tg)


def _node_candidates(st: _BlockState, ctx: _BlockCtx, lo: int, n: int, prev, counters: Counters):
    """(op, canonical key, outcome) of every valid operator that may extend this
    node: its largest input is at least ``lo``, it reads the newest tile or its key
    exceeds the previous operator's, and it is not already in the graph."""
    groups = [(t,) for t in range(lo, n)]
    groups += [(a, b) for a in range(n) for b in range(n) if max(a, b) >= lo]
    for inputs in groups:
        valid, other, abstract = _templates(st, ctx, inputs)
        counters.enumerated += len(valid) + other + abstract
        counters.pruned_other += other
        counters.pruned_abstract += abstract
        reads_newest = (n - 1) in inputs
        top = max(inputs)
        for kind, attrs, akey, res, proto in valid:
            key = (top, inputs, kind, akey)
            if (prev is not None and not reads_newest and key <= prev) or key in st.op_set:
                counters.pruned_other += 1
                continue
            op = proto if proto.inputs == inputs else Op(kind, inputs, attrs)
            if not _id_ok(op):
                counters.pruned_other += 1
                continue
            yield op, key, res


def _block_dfs(st: _BlockState, ctx: _BlockCtx) -> Iterator[BlockCompletion]:
    counters, budget = ctx.counters, ctx.budget
    if budget.exhausted():
        budget.cut = True
        return
    budget.nodes += 1
    counters.block_nodes += 1
    if st.ops:
        yield from _complete_block(st, ctx)
    if len(st.ops) >= ctx.max_ops:
        return
    n = len(st.infos)
    prev = st.keys[-1] if st.keys else None
    lo = prev[0] if prev is not None else 0
    for op, key, res in _node_candidates(st, ctx, lo, n, prev, counters):
        info, tg, lab, expr, fp = res
        if fp is not None and fp in st.fps and not any(ctx.engine.collapsed(st.exprs[t]) for t in op.inputs):
            counters.pruned_abstract += 1  # equal to an existing tile: its uses can read that one
            continue
        is_max = op.kind == "accum" and op.attr("fn") == "max_last"
        st.sigs.append(ctx.sig(info, tg, lab, expr, is_max))
        st.infos.append(info)
        st.tags.append(tg)
        st.exprs.append(expr)
        if st.labels:
            st.labels.append(lab)
        st.ops.append(op)
        st.keys.append(key)
        st.op_set.add(key)
        for t in op.inputs:
            st.uses[t] += 1
        st.uses.append(0)
        if fp is not None:
            st.fps[fp] = st.fps.get(fp, 0) + 1
        if is_max:
            st.max_ids.append(n)
        if _live_bound_ok(st, len(ctx.choice.sources), ctx.max_ops - len(st.ops), ctx.max_outputs):
            yield from _block_dfs(st, ctx)
        else:
            counters.pruned_other += 1
        if fp is not None:
            st.fps[fp] -= 1
            if not st.fps[fp]:
                del st.fps[fp]
        if is_max:
            st.max_ids.pop()
        st.uses.pop()
        for t in op.inputs:
            st.uses[t] -= 1
        st.op_set.discard(key)
        st.keys.pop()
        st.ops.pop()
        st.exprs.pop()
        st.tags.pop()
        st.infos.pop()
        st.sigs.pop()
        if st.labels:
            st.labels.pop()
        if budget.exhausted():
            budget.cut = True
            return


def _complete_block(st: _BlockState, ctx: _BlockCtx) -> Iterator[BlockCompletion]:
    choice, counters = ctx.choice, ctx.counters
    n_in = len(choice.sources)
    if any(st.uses[j] == 0 for j in range(n_in)):
        return  # an unused input: the same operator without it is enumerated elsewhere
    n = len(st.infos)
    sinks = [t for t in range(n_in, n) if st.uses[t] == 0]
    if any(st.infos[t].phase == "loop" for t in sinks) or len(sinks) > ctx.max_outputs:
        return
    extra_pool = [t for t in range(n_in, n) if st.uses[t] > 0 and st.infos[t].phase in ("post", "both")]
    rank = len(choice.grid)
    for k in range(0, ctx.max_outputs - len(sinks) + 1):
        for extra in itertools.combinations(extra_pool, k):
            outs = sorted(sinks + list(extra))
            omaps = [output_map_of(st.tags[t], rank) for t in outs]
            if any(m is None for m in omaps):
                counters.pruned_other += 1
                continue
            block = BlockGraph(choice.grid, choice.forloop_range, choice.block_inputs(), tuple(st.ops),
                               tuple(BlockOutput(t, m) for t, m in zip(outs, omaps, strict=True)))
            op = Op.make("customized", ctx.sources, block=block)
            try:
                _ = KernelGraph(ctx.prefix.ops + (op,), (ctx.prefix.num_tensors,)).info
            except MuGraphError:
                counters.pruned_other += 1
                continue
            counters.enumerated += 1
            exprs = ctx.engine.kernel_op_exprs(op, [ctx.kernel_exprs[s] for s in ctx.sources],
                                               [ctx.kernel_infos[s] for s in ctx.sources], ctx.prefix)
            if not all(ctx.engine.possible(e) for e in exprs):
                counters.pruned_abstract += 1
                continue
            yield BlockCompletion(op, tuple(exprs))


# --------------------------------------------------------------------------- instantiation


def _grid_options(extent: int, role: str, cfg) -> list[int]:
    if role == "split":
        return sorted({s for s in cfg.splits if s >= 2 and extent % s == 0})
    tiles = set(cfg.tile_widths)
    if extent <= cfg.small_grid_extent:
        tiles |= {1, 2, 4, 8}
    return sorted({extent // t for t in tiles if extent % t == 0 and extent // t >= 1})


def _op_options(op: Op, infos: list[TensorInfo], cfg) -> list[tuple[tuple[int, ...], int]]:
    """Concrete (grid, forloop_range) choices for one customized operator."""
    block = op.block
    rank = len(block.grid)
    args = [infos[t] for t in op.inputs]
    roles, extents = [], []
    for g in range(rank):
        ext = next(args[bi.source].shape[bi.input_map[g]] for bi in block.inputs if bi.input_map[g] >= 0)
        extents.append(ext)
        roles.append("tile" if any(bo.output_map[g] >= 0 for bo in block.outputs) else "split")
    options = [_grid_options(e, r, cfg) for e, r in zip(extents, roles, strict=True)]
    for g in range(rank):
        # a leading (batch) dim of tensors of rank >= 3, e.g. attention's batch x kv heads: blocks share
        # nothing along it, so one block per element is always an option, whatever its extent
        mapped = [(args[bi.source].shape, bi.input_map[g]) for bi in block.inputs if bi.input_map[g] >= 0]
        if roles[g] == "tile" and all(len(shape) >= 3 and d < len(shape) - 2 for shape, d in mapped):
            options[g] = sorted(set(options[g]) | {extents[g]})
    grids = list(itertools.product(*options))
    loop_inputs = [bi for bi in block.inputs if bi.forloop_dim >= 0]
    out = []
    for grid in grids:
        if not loop_inputs:
            out.append((tuple(grid), 1))
            continue
        bi = loop_inputs[0]
        extent = args[bi.source].shape[bi.forloop_dim]
        for g in range(rank):
            if bi.input_map[g] == bi.forloop_dim:
                extent //= grid[g]
        ranges = {extent // c for c in cfg.loop_chunks if extent % c == 0 and extent // c >= 1}
        if extent <= max(cfg.loop_chunks):
            ranges.add(1)
        out.extend((tuple(grid), r) for r in sorted(ranges))
    return out


def instantiations(graph: KernelGraph, cfg, counters: Counters | None = None) -> list[tuple[float, KernelGraph]]:
    """Concrete sizes for a structurally complete graph: every combination of
    the per-operator options (tile widths, splits, loop chunks) that passes the
    shape rules and the shared-memory budget, as (estimated seconds, graph),
    cheapest first; at most ``cfg.max_instantiations`` combinations are tried."""
    from mirage_serve.search.cost import block_smem_bytes, graph_cost

    results: list[tuple[float, KernelGraph]] = []
    tried = 0

    def rec(i: int, ops: list[Op]) -> None:
        nonlocal tried
        if tried >= cfg.max_instantiations:
            return
        if i == len(graph.ops):
            tried += 1
            g = KernelGraph(tuple(ops), graph.outputs)
            try:
                _ = g.info
            except MuGraphError:
                return
            results.append((graph_cost(g, cfg.target).seconds, g))
            return
        op = graph.ops[i]
        if op.kind != "customized":
            rec(i + 1, ops + [op])
            return
        prefix = KernelGraph(tuple(ops), (0,))
        try:
            infos = list(prefix.info)
        except MuGraphError:
            return
        for grid, rng in _op_options(op, infos, cfg):
            b = op.block
            nb = BlockGraph(grid, rng, b.inputs, b.ops, b.outputs)
            nop = Op.make("customized", op.inputs, block=nb)
            try:
                KernelGraph(tuple(ops) + (nop,), (len(infos),)).validate()
                if block_smem_bytes(nb, [infos[t] for t in op.inputs]) > cfg.target.smem_per_block:
                    if counters is not None:
                        counters.pruned_other += 1
                    continue
            except MuGraphError:
                continue
            rec(i + 1, ops + [nop])

    rec(0, [])
    results.sort(key=lambda r: r[0])
    return results


# --------------------------------------------------------------------------- kernel level


def prefix_graph(ops: tuple[Op, ...]) -> KernelGraph:
    """A kernel-graph prefix as a graph (its output is a placeholder)."""
    return KernelGraph(ops, (0,))


def _kernel_key(op: Op) -> tuple:
    return (max(op.inputs), op.inputs, op.kind, tuple((k, repr(v)) for k, v in op.attrs), repr(op.block) if op.block else "")


def _last_op(ops: tuple[Op, ...]) -> Op | None:
    for op in reversed(ops):
        if op.kind != "input":
            return op
    return None


def canonical_ok(ops: tuple[Op, ...], num_tensors: int, op: Op) -> bool:
    """The canonical-order rule at kernel level (see the module docstring)."""
    prev = _last_op(ops)
    if prev is None:
        return True
    newest = range(num_tensors - prev.num_outputs, num_tensors)
    return any(t in newest for t in op.inputs) or _kernel_key(op) > _kernel_key(prev)


def predefined_candidates(infos: list[TensorInfo], vocab: Vocabulary) -> Iterator[Op]:
    """Every pre-defined kernel operator over the existing tensors."""
    n = len(infos)
    ids = range(n)
    for t in ids:
        for fn, s in vocab.unary_ops():
            yield Op.make("unary", (t,), fn=fn, scalar=s)
    for a in ids:
        for b in ids:
            for fn in vocab.binary_fns:
                if (fn in ("add", "mul") and a > b) or (fn in ("sub", "div") and a == b):
                    continue
                yield Op.make("binary", (a, b), fn=fn)
            if len(infos[a].shape) >= 2 and len(infos[b].shape) >= 2:
                yield Op.make("matmul", (a, b))
                yield Op.make("matmul", (a, b), trans_b=True)
            if a != b:
                for d in range(len(infos[a].shape)):
                    yield Op.make("concat", (a, b), dim=d)
    for t in ids:
        yield from _reduce_ops(vocab, t, len(infos[t].shape))
        for e in vocab.eps if vocab.rms_norm else ():
            yield Op.make("rms_norm", (t,), eps=e)
            for w in ids:
                if w != t:
                    yield Op.make("rms_norm", (t, w), eps=e)


@dataclass(frozen=True)
class KernelState:
    """A kernel-graph prefix that survived pruning (inputs included)."""

    ops: tuple[Op, ...]

    @property
    def num_customized(self) -> int:
        return sum(op.kind == "customized" for op in self.ops)

    @property
    def num_kernel_ops(self) -> int:
        return sum(op.kind != "input" for op in self.ops)


def expand_predefined(state: KernelState, infos: list[TensorInfo], exprs: list[Any], engine: ExprEngine,
                      vocab: Vocabulary, counters: Counters, labels: list | None = None) -> list[tuple[KernelState, list[Any]]]:
    """Append one pre-defined operator in every canonical, shape-valid, label-respecting,
    oracle-approved way (``labels``: index labels of the prefix's tensors)."""
    out = []
    n = len(infos)
    seen = {(_kernel_key(op)) for op in state.ops if op.kind != "input"}
    prefix = prefix_graph(state.ops)
    for op in predefined_candidates(infos, vocab):
        counters.enumerated += 1
        if not canonical_ok(state.ops, n, op) or _kernel_key(op) in seen:
            counters.pruned_other += 1
            continue
        try:
            info = infer_tile_op(op, [infos[t] for t in op.inputs], "candidate")
            if not 1 <= len(info.shape) <= 4 or not _weight_fits(op, [infos[t] for t in op.inputs]):
                raise MuGraphError("rank")
        except MuGraphError:
            counters.pruned_other += 1
            continue
        if labels is not None and vocab.labels is not None and op_labels(
                op, [infos[t].shape for t in op.inputs], [labels[t] for t in op.inputs], info.shape, vocab.labels) is None:
            counters.pruned_other += 1
            continue
        new_exprs = engine.kernel_op_exprs(op, [exprs[t] for t in op.inputs], [infos[t] for t in op.inputs], prefix)
        if not all(engine.possible(e) for e in new_exprs):
            counters.pruned_abstract += 1
            continue
        if labels is not None and vocab.labels is not None and engine.prune and not vocab.labels.summand_ok(
                op, [exprs[t] for t in op.inputs], [labels[t] for t in op.inputs], [infos[t].shape for t in op.inputs]):
            counters.pruned_abstract += 1
            continue
        out.append((KernelState(state.ops + (op,)), exprs + new_exprs))
    return out


def customized_sources(state: KernelState, infos: list[TensorInfo], max_inputs: int) -> list[tuple[int, ...]]:
    """Sets of kernel tensors a new customized operator may read, in canonical order."""
    n = len(infos)
    out = []
    for k in range(1, min(max_inputs, n) + 1):
        for sources in itertools.combinations(range(n), k):
            probe = Op.make("customized", sources)
            prev = _last_op(state.ops)
            if prev is not None:
                newest = range(n - prev.num_outputs, n)
                if not any(t in newest for t in sources) and _kernel_key(probe)[:4] < _kernel_key(prev)[:4]:
                    continue
            out.append(sources)
    return out


def expand_customized(state: KernelState, infos: list[TensorInfo], exprs: list[Any], sources: tuple[int, ...],
                      choices: list[MapChoice], engine: ExprEngine, vocab: Vocabulary, cfg, counters: Counters,
                      deadline: float | None, node_budget: int, labels: list | None = None,
                      max_outputs: int | None = None) -> tuple[list[tuple[KernelState, list[Any]]], list[MapChoice]]:
    """Append one customized operator reading ``sources``, for each map choice,
    visiting at most ``node_budget`` block-graph prefixes per choice.

    Returns the new states and the choices whose enumeration the node budget cut
    short (the driver runs those again with a larger budget)."""
    out = []
    unfinished: list[MapChoice] = []
    prefix = prefix_graph(state.ops)
    n = len(infos)
    for choice in choices:
        budget = Budget(deadline, node_budget)
        for comp in enumerate_blocks(choice, sources, infos, exprs, prefix, engine, vocab, cfg.max_block_ops,
                                     max_outputs or cfg.max_block_outputs, counters, budget, labels):
            if not canonical_ok(state.ops, n, comp.op):
                counters.pruned_other += 1
                continue
            out.append((KernelState(state.ops + (comp.op,)), exprs + list(comp.exprs)))
        if budget.cut and budget.out_of_time():
            counters.truncated = True
            break
        if budget.cut:
            unfinished.append(choice)
    return out, unfinished


def complete_graph(state: KernelState, exprs: list[Any], engine: ExprEngine, num_outputs: int) -> KernelGraph | None:
    """The kernel graph a state computes if its tensors match every spec output
    and no operator is dead (every non-input tensor is consumed or an output)."""
    ops = state.ops
    n = len(exprs)
    last = ops[-1]
    newest = range(n - last.num_outputs, n) if last.kind != "input" else range(0)
    chosen = []
    for i in range(num_outputs):
        # only the newest operator's tensors can complete the graph: older ones were checked when they appeared
        pool = list(newest) if num_outputs == 1 else [t for t in range(n) if ops_kind_of(state, t) != "input"]
        match = next((t for t in pool if engine.matches(exprs[t], i)), None)
        if match is None:
            return None
        chosen.append(match)
    g = KernelGraph(ops, tuple(chosen))
    consumed = set(chosen)
    for op in ops:
        consumed.update(op.inputs)
    for t, (i, _) in enumerate(g.tensor_producers):
        if ops[i].kind != "input" and t not in consumed:
            return None
    return g


def ops_kind_of(state: KernelState, tensor: int) -> str:
    t = 0
    for op in state.ops:
        if tensor < t + op.num_outputs:
            return op.kind
        t += op.num_outputs
    raise MuGraphError(f"tensor {tensor} is not produced by the prefix")


# --------------------------------------------------------------------------- structure checks


def canonical_block_order(block: BlockGraph) -> BlockGraph:
    """The same block graph with its operators in canonical order (greedy:
    the ready operator of smallest key first), tensors renumbered."""
    n_in = len(block.inputs)
    new_id = {j: j for j in range(n_in)}
    placed: list[Op] = []
    remaining = list(range(len(block.ops)))
    while remaining:
        ready = []
        for i in remaining:
            op = block.ops[i]
            if all(t in new_id for t in op.inputs):
                ready.append((_op_key(Op(op.kind, tuple(new_id[t] for t in op.inputs), op.attrs)), i))
        _, i = min(ready)
        op = block.ops[i]
        placed.append(Op(op.kind, tuple(new_id[t] for t in op.inputs), op.attrs))
        new_id[n_in + i] = n_in + len(placed) - 1
        remaining.remove(i)
    outs = tuple(BlockOutput(new_id[o.tensor], o.output_map) for o in block.outputs)
    return BlockGraph(block.grid, block.forloop_range, block.inputs, tuple(placed), outs)


def block_rejection(block: BlockGraph, arg_infos: list[TensorInfo]) -> str | None:
    """Why the enumeration would never generate ``block`` (its operators in the
    given order, at these sizes), or None if it lies in the search space."""
    rank = len(block.grid)
    infos, tags = [], []
    for bi in block.inputs:
        shape = tile_shape_of_input(arg_infos[bi.source].shape, block.grid, bi.input_map, bi.forloop_dim, block.forloop_range, "tile")
        infos.append(TensorInfo(shape, arg_infos[bi.source].dtype, "invariant" if bi.forloop_dim == -1 else "loop"))
        tags.append(Tags(tuple(frozenset({f"g{g}" for g in range(rank) if bi.input_map[g] == d} | ({LOOP} if bi.forloop_dim == d else set()))
                               for d in range(len(shape)))))
    st = _BlockState(infos, tags, [None] * len(infos), [], [0] * len(infos))
    for i, op in enumerate(block.ops):
        key = _op_key(op)
        n = len(st.infos)
        if st.keys and (n - 1) not in op.inputs and key <= st.keys[-1]:
            return f"op {i} ({op.describe()}) breaks the canonical order"
        if max(op.inputs) < (st.keys[-1][0] if st.keys else 0):
            return f"op {i} ({op.describe()}) is not generated after the previous operator"
        res = _try_block_op(st, op)
        if res is None:
            return f"op {i} ({op.describe()}) is rejected by the shape, phase or partition rules"
        st.infos.append(res[0])
        st.tags.append(res[1])
        st.keys.append(key)
        if op.kind == "accum" and op.attr("fn") == "max_last":
            st.max_ids.append(n)
    for o in block.outputs:
        m = output_map_of(st.tags[o.tensor], rank)
        if m is None:
            return f"output tile {o.tensor} is replicated over a grid dim"
        if m != tuple(o.output_map):
            return f"output tile {o.tensor}: the partition rules give output map {m}, the graph has {o.output_map}"
    return None
