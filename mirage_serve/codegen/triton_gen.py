"""Block graph -> Triton kernel source.

One customized operator becomes one ``@triton.jit`` function: a program per
grid point (``tl.program_id`` per grid dim), tiles loaded by the input maps
(offsets mirror :func:`mirage_serve.reference.load_tile_fn`: along a dim split
by the grid and the loop, block b owns chunk b and iteration i loads sub-chunk
i), a ``for`` loop over ``forloop_range``, fp32 accumulators in registers, the
operators after the loop once, and stores by the output maps (partial outputs
get their leading grid dims). 16-bit tensors are loaded, computed in fp32 and
cast on store.

Registers: each tile dim class (see :mod:`mirage_serve.codegen.analysis`) has
one power-of-two extent; padded entries are masked on load (zero) and store,
and re-masked before any reduction over a padded dim whose padding may hold
non-zero values. Size-1 tile dims are squeezed (a value's register dims are its
tile's dims of size > 1, in tile order). Sizes are literals; a row dim uses the
runtime ``n_rows`` in its masks and strides (all tensors are contiguous).

**Variable extents.** A tensor dim may be declared variable (e.g. the KV length
of decode attention): its size in memory is the argument ``n_ext<e>`` (used in
strides) and only the first ``v_ext<e>`` positions (read from ``ext<e>_ptr``, a
device int32, clamped to ``n_ext<e>``) are valid. Its tile dim class gets a
runtime mask ``dm<c>`` next to the padding mask, so masked positions are
excluded from every reduction exactly like padding; operators whose result
depends on the count of positions (mean of squares, rms, rms_norm, strided
sums) are refused over such a class.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mirage_serve.codegen.analysis import block_dims, summed_matmuls
from mirage_serve.codegen.params import GEMV_PRODUCT_PER_THREAD, CodegenError, CodegenParams, dot_operand_bytes, gemv_fits
from mirage_serve.mugraph.graph import MuGraphError, Op
from mirage_serve.mugraph.shapes import TensorInfo

TL_DTYPES = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16"}
PTR_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _num(x: float) -> str:
    x = float(x)
    if x != x or x in (float("inf"), float("-inf")):
        return f'float("{x}")'
    return repr(x)


#: The combine function of NaN-propagating max reductions, emitted before a kernel that uses one.
#: ``tl.max`` and ``tl.maximum`` default to ``maxnum`` (a NaN operand is dropped); ``torch.amax``,
#: the reference, propagates NaN. ``maximum`` with ``PropagateNan.ALL`` is one instruction
#: (``max.NaN.f32``) like ``maxnum``, so the reduction costs the same.
MAX_COMBINE = "_max_nan"
_MAX_COMBINE_SRC = f"""__name__ = "mirage_serve.codegen.generated"  # the module Triton resolves called functions in

@triton.jit
def {MAX_COMBINE}(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

"""


def interpreter_fast_max() -> None:
    """Let Triton's CPU interpreter reduce with :data:`MAX_COMBINE` through ``np.max`` (which
    propagates NaN, as the combine does) instead of one Python call per element."""
    import numpy as np
    from triton.runtime import interpreter as it

    ops = it.ReduceOps
    if getattr(ops, "_mirage_fast_max", False):
        return
    original = ops.apply_impl

    def apply_impl(self, input):
        if getattr(self.combine_fn, "__name__", None) == MAX_COMBINE:
            return self.min_max(input[0], val_reduce_op=np.max)
        return original(self, input)

    ops.apply_impl = apply_impl
    ops._mirage_fast_max = True


@dataclass(frozen=True)
class KernelSource:
    """Generated source of one kernel and how to launch it."""

    name: str
    text: str
    grid: tuple[int, ...]
    signature: dict[str, str]  # argument name -> Triton type, for ahead-of-time compilation
    uses_n_rows: bool
    # per grid dim: rows each program owns when the launch may shrink with n_rows, else 0
    rows_per_program: tuple[int, ...]
    extents: tuple[int, ...] = ()  # variable extents this kernel takes (n_ext<e>, ext<e>_ptr), in order
    pdl: bool = False  # launch with programmatic dependent launch
    # a partials kernel with its combine fused in (``fused_combine``): after its own outputs it takes the
    # combine's outputs (this many) and an int32 counter per group of programs (this many), zero between launches
    combine_outputs: int = 0
    counters: int = 0
    tma: bool = False  # makes tensor descriptors (``tma``): needs Triton's global workspace allocator


@dataclass
class _Val:
    name: str
    dims: tuple[int, ...]  # tile dims of size > 1, in register order
    zero: bool  # padded entries are known to be exactly 0
    raw: bool = False  # still in the tensor's 16-bit storage dtype (loaded for tl.dot only)


def check_loop_refinable(block, bd, factor: int, where: str) -> None:
    """Raise CodegenError unless splitting every loop iteration into ``factor`` steps is exact.

    It is when the loop body decomposes over the loop-split dim classes: a
    per-iteration value reduced over one of them (a matmul contracting it, a sum
    or max over it) feeds accumulators only; accumulators are sums, maxima,
    sums of squares over the last dim or their rescaled forms (not ``sum_to``);
    and no rms_norm or sum_to runs over such a class inside the loop."""
    n_in = len(block.inputs)
    loop_cls = {bd.cls[j][bi.forloop_dim] for j, bi in enumerate(block.inputs) if bi.forloop_dim != -1} - {None}
    consumers: dict[int, list] = {}
    for op in block.ops:
        for x in op.inputs:
            consumers.setdefault(x, []).append(op)
    for j, op in enumerate(block.ops):
        t = n_in + j
        what = f"{where}: k_chunks={factor} does not split the loop: block op {j} ({op.describe()})"
        if op.kind == "accum":
            if op.attr("fn") == "sum_to":
                raise CodegenError(f"{what} is a strided-sum accumulator")
            continue
        src = op.inputs[0] if op.inputs else None
        reduced = None
        if op.kind == "matmul":
            reduced = bd.cls[src][-1]
        elif op.kind == "reduce":
            d = op.attr("dim", -1) % len(bd.tiles[src].shape)
            reduced = bd.cls[src][d]
        elif op.kind in ("rms_norm", "sum_to"):
            if bd.cls[src][-1] in loop_cls:
                raise CodegenError(f"{what} normalises or sums down a loop-split dim inside the loop")
            continue
        if reduced in loop_cls and any(c.kind != "accum" for c in consumers.get(t, [])):
            raise CodegenError(f"{what} reduces over the loop dim and feeds more than accumulators")


class _Gen:
    def __init__(
        self,
        name: str,
        op: Op,
        arg_infos: list[TensorInfo],
        arg_storage: list[str],
        arg_rows: list[int | None],
        out_infos: list[TensorInfo],
        out_storage: list[str],
        out_rows: list[int | None],
        params: CodegenParams,
        where: str,
        arg_ext: list[dict[int, int]] | None = None,
        out_ext: list[dict[int, int]] | None = None,
        early_inputs: frozenset[int] = frozenset(),
        plain_launch: bool = False,
    ) -> None:
        self.name, self.op, self.block = name, op, op.block
        self.early_inputs = early_inputs
        # ``pdl=2``, the graph's first kernel: launched plainly (after all work before it), it only lets the next one launch early
        self.plain_launch = plain_launch
        self.arg_ext = arg_ext or [{} for _ in arg_infos]
        self.out_ext = out_ext or [{} for _ in out_infos]
        self.arg_infos, self.arg_storage, self.arg_rows = arg_infos, arg_storage, arg_rows
        self.out_infos, self.out_storage, self.out_rows = out_infos, out_storage, out_rows
        self.params, self.where = params, where
        self.loop_split = 1  # iterations of the block graph's loop each one is split into (k_chunks, or matmul='auto')
        self.bd = block_dims(self.block, arg_infos)
        self.tiles = self.bd.tiles
        self.n_in = len(self.block.inputs)
        self.lines: list[str] = []
        self.uses_n_rows = False
        # set by generate_fused_combine: a callee body (program ids as arguments, partials read through L2),
        # or a partials kernel with lines after its stores and extra pointer arguments
        self.body_mode = False
        self.tail: list[str] = []
        self.extra_args: list[tuple[str, str]] = []
        self.force_n_rows = False
        self.force_extents: tuple[int, ...] = ()
        self.uses_max = False  # emit the MAX_COMBINE helper
        dtypes = {i.dtype for i in arg_infos}
        self.low = next((d for d in ("bfloat16", "float16") if d in dtypes), None)
        for t, cls in enumerate(self.bd.cls):
            kept = [c for c in cls if c is not None]
            if len(set(kept)) != len(kept):
                raise CodegenError(f"{self._w(t)}: two dims of one tile are the same axis (e.g. X @ X^T); not supported")
        self._plan_dots()
        self.pad = [max(_pow2(s), 16 if c in self.dot_classes else 1) for c, s in enumerate(self.bd.size)]
        self._plan_extents()
        self.acc_dots = self._plan_acc_dots()
        self.late_loads = self._plan_late_loads()
        self.late_ext = bool(self.late_loads)
        self.tma_loads: dict[int, tuple[list[str], list[str], list[int], list[str]]] = {}

    def _plan_late_loads(self) -> set[int]:
        """Block inputs whose loads ``late_ext_mask`` bounds by the tensor's size instead of the valid
        length: with 2 every input of a variable-extent class; with 1 those that no operator reading
        the loaded tile directly contracts or reduces over such a class (a matmul over the KV
        positions, say, which would otherwise zero it right after the load)."""
        mode = self.params.late_ext_mask
        if not mode or not self.dyn:
            return set()
        out = set()
        for j in range(self.n_in):
            mine = {c for c in self.bd.cls[j] if c in self.dyn}
            if not mine:
                continue
            if mode == 1:
                reduced = False
                for op in self.block.ops:
                    if j not in op.inputs:
                        continue
                    if op.kind == "matmul":
                        reduced |= self.bd.cls[op.inputs[0]][-1] in mine
                    elif op.kind in ("reduce", "accum"):
                        reduced = True
                if reduced:
                    continue
            out.add(j)
        return out

    # ---- helpers -------------------------------------------------------------------------
    def _w(self, t: int) -> str:
        if t < self.n_in:
            return f"{self.where}, block input {t}"
        return f"{self.where}, block op {t - self.n_in} ({self.block.ops[t - self.n_in].describe()})"

    def emit(self, line: str, depth: int = 1) -> None:
        self.lines.append("    " * depth + line)

    def kept(self, t: int) -> tuple[int, ...]:
        return tuple(d for d, c in enumerate(self.bd.cls[t]) if c is not None)

    def classes(self, t: int, dims: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.bd.cls[t][d] for d in dims)

    def spilling_gemvs(self) -> list[tuple[int, int, int]]:
        """(rows, columns, inner) of the tile matmuls this kernel computes as GEMV math whose broadcast
        product holds more than :data:`GEMV_PRODUCT_PER_THREAD` elements a thread: code that spills
        registers (rows count every dim of the first operand but the contracted one)."""
        limit = GEMV_PRODUCT_PER_THREAD * 32 * self.params.num_warps
        out = []
        for j, op in enumerate(self.block.ops):
            if op.kind != "matmul" or self.n_in + j in self.dot_ops:
                continue
            sa, sb = self.tiles[op.inputs[0]].shape, self.tiles[op.inputs[1]].shape
            m, k = math.prod(sa[:-1]), sa[-1]
            n = sb[-2] if op.attr("trans_b") else sb[-1]
            if m * n * k > limit:
                out.append((m, n, k))
        return out

    def _plan_dots(self) -> None:
        self.dot_ops: set[int] = set()
        self.dot_classes: set[int] = set()
        mode = self.params.matmul
        prec = self.params.dot_precision
        uses = {t: [(self.n_in + j, op) for j, op in enumerate(self.block.ops) if t in op.inputs] for t in range(self.n_in)}
        # 16-bit inputs read only by tile matmuls: exact as 16-bit MMA operands (dot_precision "auto")
        exact16 = {t for t in range(self.n_in) if self.low is not None and uses[t]
                   and self.arg_storage[self.block.inputs[t].source] == self.low
                   and all(op.kind == "matmul" for _, op in uses[t])}
        low = self.low is not None
        for j, op in enumerate(self.block.ops):
            if op.kind != "matmul" or mode == "fma":
                continue
            t = self.n_in + j
            a, b = op.inputs
            sa, sb = self.tiles[a].shape, self.tiles[b].shape
            ca, cb = self.bd.cls[a], self.bd.cls[b]
            kb, nb = (len(sb) - 1, len(sb) - 2) if op.attr("trans_b") else (len(sb) - 2, len(sb) - 1)
            m, k, n = ca[-2], ca[-1], cb[nb]
            batch = [c for c in ca[:-2] + cb[: len(sb) - 2] if c is not None]
            if None in (m, k, n) or batch:
                continue
            if mode == "auto" and sa[-2] < self.params.dot_min_rows and gemv_fits(
                    sa[-2], sb[nb], sa[-1], self.params.num_warps, dot_operand_bytes(prec, low, {a, b} <= exact16)):
                continue
            self.dot_ops.add(t)
            self.dot_classes.update((m, k, n))
        # swapped dots (dot_swap), unless a dot's result reaches a max: Triton 3.6 compiled such kernels
        # (attention) with the NaN-propagating max into illegal accesses and wrong results on an H200
        self.swap_dots = set(self.dot_ops) if self.params.dot_swap and not self._dots_into_max() else set()
        # dots on the 16-bit operands themselves: every dot with "input" precision (operands cast to the
        # 16-bit dtype); with "auto", the dots both of whose operands are 16-bit inputs that no GEMV or
        # tf32 dot also reads (those inputs then stay 16-bit in registers)
        raw = {t for t in exact16 if all(u in self.dot_ops for u, _ in uses[t])}  # 16-bit inputs only dots read
        native = set(self.dot_ops) if low and prec == "input" else set()
        while low and prec == "auto":
            native = {self.n_in + j for j, op in enumerate(self.block.ops) if self.n_in + j in self.dot_ops and set(op.inputs) <= raw}
            kept = {t for t in raw if all(u in native for u, _ in uses[t])}
            if kept == raw:
                break
            raw = kept
        self.native_dots: set[int] = native
        self.raw_loads: set[int] = raw if native else set()
        # a tile read only as the transposed operand of dots is loaded as [K, N] directly (unless the
        # dot is swapped, which wants B as [N, K])
        self.load_transposed: set[int] = set()
        for t in range(self.n_in):
            if uses[t] and all(
                u in self.dot_ops and u not in self.swap_dots and op.attr("trans_b") and op.inputs == (op.inputs[0], t) and op.inputs[0] != t
                for u, op in uses[t]
            ):
                self.load_transposed.add(t)

    def _plan_acc_dots(self) -> dict[int, int]:
        """``dot_acc``: the :func:`~mirage_serve.codegen.analysis.summed_matmuls` on the tensor cores that run
        in the loop, with no variable-extent dim to mask: the accumulator is then the MMA's own
        (``acc = tl.dot(a, b, acc)``), in the MMA's orientation."""
        if not self.params.dot_acc:
            return {}
        return {u: t for u, t in summed_matmuls(self.block).items()
                if t in self.dot_ops and self.tiles[t].phase == "loop" and len(self.kept(t)) == 2
                and self.classes(t, self.kept(t)) == self.classes(u, self.kept(u))
                and not any(c in self.dyn for c in self.bd.cls[t] if c is not None)}

    def _dots_into_max(self) -> set[int]:
        """Tile matmuls whose result a max reduction or running max reads, directly or through other ops."""
        feeds: dict[int, set[int]] = {}  # tile -> the matmuls it derives from
        out: set[int] = set()
        for j, op in enumerate(self.block.ops):
            t = self.n_in + j
            feeds[t] = set().union(*(feeds.get(x, set()) for x in op.inputs)) | ({t} if op.kind == "matmul" else set())
            if (op.kind == "reduce" and op.attr("fn") == "max") or (op.kind == "accum" and op.attr("fn") == "max_last"):
                out |= feeds[t]
        return out

    def _plan_extents(self) -> None:
        """Tile dim classes of variable extents: class -> extent id; refuse count-dependent operators over them."""
        self.dyn: dict[int, int] = {}
        for j, bi in enumerate(self.block.inputs):
            for d, e in self.arg_ext[bi.source].items():
                c = self.bd.cls[j][d]
                if c is None:
                    continue
                if self.dyn.get(c, e) != e:
                    raise CodegenError(f"{self._w(j)}: dim {d} joins two variable extents; not supported")
                self.dyn[c] = e
        for j, bo in enumerate(self.block.outputs):
            n_partial = len(self.out_infos[j].shape) - len(self.tiles[bo.tensor].shape)
            for d, e in self.out_ext[j].items():
                c = self.bd.cls[bo.tensor][d - n_partial] if d >= n_partial else None
                if c is not None:
                    self.dyn.setdefault(c, e)
        if not self.dyn:
            return
        for j, op in enumerate(self.block.ops):
            t = self.n_in + j
            src = op.inputs[0] if op.inputs else None
            last = self.bd.cls[src][-1] if src is not None else None
            fn = op.attr("fn") if op.kind in ("accum", "reduce", "unary", "binary") else None
            if last in self.dyn and (op.kind in ("rms_norm", "sum_to") or fn in ("mean_sq_last", "rms_last", "sum_to")):
                raise CodegenError(f"{self._w(t)}: depends on the number of positions of a variable-extent dim; not supported")
        # every input tile of a variable class must place it alike (same grid offsets, same loop status)
        self.dyn_base: dict[int, tuple[str, int | None]] = {}  # class -> (grid offset expr, loop step or None)
        for j, bi in enumerate(self.block.inputs):
            tile = self.tiles[j].shape
            for d, c in enumerate(self.bd.cls[j]):
                if c not in self.dyn:
                    continue
                base = " + ".join(self._grid_terms(bi, d, tile)) or "0"
                step = tile[d] if d == bi.forloop_dim else None
                if self.dyn_base.setdefault(c, (base, step)) != (base, step):
                    raise CodegenError(f"{self._w(j)}: inputs split a variable-extent dim differently; not supported")
        phases = [info.phase for info in self.tiles]
        for t, cls in enumerate(self.bd.cls):
            for c in cls:
                if c in self.dyn_base and self.dyn_base[c][1] is not None and phases[t] in ("invariant", "post", "both"):
                    raise CodegenError(f"{self._w(t)}: a loop-split variable-extent dim outside the loop; not supported")

    def _grid_terms(self, bi, d: int, tile: tuple[int, ...]) -> list[str]:
        terms = []
        for g, td in enumerate(bi.input_map):
            if td == d and self.block.grid[g] > 1:
                step = tile[d] * (self.block.forloop_range if d == bi.forloop_dim else 1)
                terms.append(f"pid{g}" if step == 1 else f"pid{g} * {step}")
        return terms

    def dyn_mask_line(self, c: int, bound: bool = False) -> str:
        """``dm<c>``: positions of class ``c`` below the valid length; with ``bound``, ``bm<c>``: below
        the tensor's size in memory (``late_ext_mask`` loads: no wait for the length read)."""
        base, step = self.dyn_base[c]
        pos = " + ".join(x for x in (base if base != "0" else "", f"i * {step}" if step is not None else "", f"r{c}") if x)
        return f"bm{c} = ({pos}) < n_ext{self.dyn[c]}" if bound else f"dm{c} = ({pos}) < v_ext{self.dyn[c]}"

    def arange(self, c: int, target: tuple[int, ...]) -> str:
        """``tl.arange`` of class ``c`` expanded to the register classes ``target``."""
        return f"r{c}" + self._index(target.index(c), len(target))

    @staticmethod
    def _index(pos: int, n: int) -> str:
        if n <= 1:
            return ""
        return "[" + ", ".join(":" if q == pos else "None" for q in range(n)) + "]"

    def pad_mask(self, cls: tuple[int, ...], only: tuple[int, ...] | None = None, dyn: bool = True) -> str | None:
        parts = [
            f"m{c}" + self._index(p, len(cls))
            for p, c in enumerate(cls)
            if self.pad[c] > self.bd.size[c] and (only is None or c in only)
        ]
        if dyn:
            parts += [f"dm{c}" + self._index(p, len(cls)) for p, c in enumerate(cls) if c in self.dyn and (only is None or c in only)]
        return " & ".join(parts) if parts else None

    def dyn_mask(self, cls: tuple[int, ...], bound: bool = False) -> str | None:
        parts = [("bm" if bound else "dm") + f"{c}" + self._index(p, len(cls)) for p, c in enumerate(cls) if c in self.dyn]
        return " & ".join(parts) if parts else None

    def expand(self, v: _Val, vt: int, target: tuple[int, ...]) -> str:
        """Value ``v`` of tile ``vt`` broadcast to register classes ``target``."""
        vc = self.classes(vt, v.dims)
        missing = [c for c in vc if c not in target]
        if missing:
            raise CodegenError(f"{self._w(vt)}: a tile dim does not line up with its consumer's dims; not supported")
        expr = v.name
        order = sorted(range(len(vc)), key=lambda p: target.index(vc[p]))
        if order != list(range(len(vc))):
            expr = f"tl.permute({expr}, {tuple(order)})"
            vc = tuple(vc[p] for p in order)
        if 0 < len(vc) < len(target):
            expr += "[" + ", ".join(":" if c in vc else "None" for c in target) + "]"
        return expr

    def natural(self, v: _Val, t: int) -> _Val:
        if v.dims == self.kept(t):
            return v
        return _Val(self.expand(v, t, self.classes(t, self.kept(t))), self.kept(t), v.zero, v.raw)

    def shape_of(self, cls: tuple[int, ...]) -> str:
        return "(" + "".join(f"{self.pad[c]}, " for c in cls).rstrip(" ") + ")"

    def masked(self, v: _Val, t: int, along: tuple[int, ...], fill: str) -> str:
        """``v`` (natural order) with padded entries along classes ``along`` set to ``fill``."""
        cls = self.classes(t, v.dims)
        m = self.pad_mask(cls, along)
        if m is None or (fill == "0.0" and v.zero):
            return v.name
        return f"tl.where({m}, {v.name}, {fill})"

    def strides(self, shape: tuple[int, ...], row: int | None, ext: dict[int, int] | None = None) -> list[str]:
        """Row-major strides; the row dim's size is ``n_rows`` and a variable extent's ``n_ext<e>``."""
        out = []
        for d in range(len(shape)):
            lit, syms = 1, []
            for e in range(d + 1, len(shape)):
                if e == row:
                    syms.append("n_rows")
                elif ext and e in ext:
                    syms.append(f"n_ext{ext[e]}")
                else:
                    lit *= shape[e]
            if "n_rows" in syms:
                self.uses_n_rows = True
            if syms:
                out.append(" * ".join(syms + ([str(lit)] if lit != 1 else [])))
            else:
                out.append(str(lit))
        return out

    # ---- generation ----------------------------------------------------------------------
    def generate(self) -> KernelSource:
        blk, rng = self.block, self.block.forloop_range
        body: list[str] = []
        self.lines = body
        phases = [info.phase for info in self.tiles]
        deferred = self._deferred(phases)
        wait_late = deferred is not None
        if self.params.pdl and not self.body_mode:  # wait for the kernel before (its outputs, and its reads of our outputs), then let the next one launch
            if not wait_late and not self.plain_launch:
                self.emit("tl.extra.cuda.gdc_wait()")
            self.emit("tl.extra.cuda.gdc_launch_dependents()")
        deferred = deferred or set()
        extents = sorted({e for m in self.arg_ext + self.out_ext for e in m.values()} | set(self.dyn.values()) | set(self.force_extents))
        for e in extents:
            self.emit(f"v_ext{e} = tl.minimum(tl.load(ext{e}_ptr), n_ext{e})")
        for g, size in enumerate(blk.grid):
            if size > 1 and not self.body_mode:
                self.emit(f"pid{g} = tl.program_id({g})")
        for c, size in enumerate(self.bd.size):
            self.emit(f"r{c} = tl.arange(0, {self.pad[c]})")
            if self.pad[c] > size:
                self.emit(f"m{c} = r{c} < {size}")
        for c in sorted(self.dyn):
            if c not in self.dyn_base:
                raise CodegenError(f"{self.where}: a variable-extent dim reaches an output without coming from an input; not supported")
            if self.dyn_base[c][1] is None:
                self.emit(self.dyn_mask_line(c))
                if self.late_ext:
                    self.emit(self.dyn_mask_line(c, bound=True))
        if self.params.tma and not self.body_mode:
            self.tma_loads = {j: d for j in range(self.n_in) if (d := self._tma_box(j)) is not None}
        loads = self._emit_load_setup()
        env: dict[int, _Val] = {}
        for j, bi in enumerate(blk.inputs):
            if bi.forloop_dim == -1 and j not in deferred:
                env[j] = self._emit_load(j, loads[j], 1)
        for j, op in enumerate(blk.ops):
            t = self.n_in + j
            if phases[t] == "invariant" and t not in deferred:
                env[t] = self._emit_op(op, t, env, 1, "")
        accs = [self.n_in + j for j, op in enumerate(blk.ops) if op.kind == "accum"]
        alpha_needed = {op.inputs[1] for op in blk.ops if op.kind == "accum" and op.attr("fn").startswith("rescaled")}
        for t in accs:
            self._emit_acc_init(t)
        loop_env = dict(env)
        self.emit(f"for i in range({rng}):")
        for c in sorted(self.dyn):
            if self.dyn_base[c][1] is not None:
                self.emit(self.dyn_mask_line(c), 2)
                if self.late_ext:
                    self.emit(self.dyn_mask_line(c, bound=True), 2)
        for j, bi in enumerate(blk.inputs):
            if bi.forloop_dim != -1:
                loop_env[j] = self._emit_load(j, loads[j], 2)
        for j, op in enumerate(blk.ops):
            t = self.n_in + j
            if op.kind == "accum":
                loop_env[t] = self._emit_acc_step(op, t, loop_env, t in alpha_needed)
            elif t in self.acc_dots.values():  # computed by its accumulator's MMA
                continue
            elif phases[t] in ("loop", "both"):
                loop_env[t] = self._emit_op(op, t, loop_env, 2, "")
        if not any(phases[t] in ("loop", "both") for t in range(len(self.tiles))):
            self.emit("pass", 2)
        post = dict(env)
        if wait_late:  # the loop read graph inputs only; what earlier kernels wrote is read (and outputs written) after it
            self.emit("tl.extra.cuda.gdc_wait()")
        for j in range(len(blk.inputs)):
            if j in deferred:
                post[j] = self._emit_load(j, loads[j], 1)
        for j, op in enumerate(blk.ops):
            t = self.n_in + j
            if t in deferred:
                post[t] = self._emit_op(op, t, post, 1, "")
        for j, op in enumerate(blk.ops):
            t = self.n_in + j
            if op.kind == "accum":
                post[t] = self._emit_acc_final(op, t)
            elif phases[t] in ("post", "both"):
                post[t] = self._emit_op(op, t, post, 1, "_post" if phases[t] == "both" else "")
        rows_per_program = [0] * len(blk.grid)
        for j, bo in enumerate(blk.outputs):
            self._emit_store(j, bo, post[bo.tensor])
        body.extend(self.tail)
        if self.params.shrink_grid:
            rows_per_program = self._shrinkable()
        args = [f"in{j}_ptr" for j in range(len(self.arg_infos))] + [f"out{j}_ptr" for j in range(len(self.out_infos))]
        sig = {f"in{j}_ptr": PTR_TYPES[s] for j, s in enumerate(self.arg_storage)}
        sig.update({f"out{j}_ptr": PTR_TYPES[s] for j, s in enumerate(self.out_storage)})
        for a, ty in self.extra_args:
            args.append(a)
            sig[a] = ty
        self.uses_n_rows = self.uses_n_rows or self.force_n_rows
        if self.uses_n_rows:
            args.append("n_rows")
            sig["n_rows"] = "i32"
        for e in extents:
            args += [f"n_ext{e}", f"ext{e}_ptr"]
            sig[f"n_ext{e}"], sig[f"ext{e}_ptr"] = "i32", "*i32"
        if self.body_mode:
            args += [f"pid{g}" for g, size in enumerate(blk.grid) if size > 1]
        deco = "@triton.jit"
        if extents and not self.body_mode:  # a size in strides only: one compiled kernel for every length
            deco = "@triton.jit(do_not_specialize=[" + ", ".join(f'"n_ext{e}"' for e in extents) + "])"
        head = [deco, f"def {self.name}({', '.join(args)}):", f'    """{self.where}: grid {list(blk.grid)}, forloop_range {rng}.']
        def note(rows, ext) -> str:
            return (f", row dim {rows}" if rows is not None else "") + "".join(f", dim {d} variable (extent {e})" for d, e in sorted(ext.items()))

        for j, info in enumerate(self.arg_infos):
            head.append(f"    in{j}: {list(info.shape)} {self.arg_storage[j]}" + note(self.arg_rows[j], self.arg_ext[j]))
        for j, info in enumerate(self.out_infos):
            head.append(f"    out{j}: {list(info.shape)} {self.out_storage[j]}" + note(self.out_rows[j], self.out_ext[j]))
        head.append('    """')
        self.fn_text = "\n".join(head + body) + "\n"
        text = (_MAX_COMBINE_SRC if self.uses_max else "") + self.fn_text
        return KernelSource(self.name, text, tuple(blk.grid), sig, self.uses_n_rows, tuple(rows_per_program), tuple(extents), bool(self.params.pdl) and not self.plain_launch,
                            tma=bool(self.tma_loads))

    def _deferred(self, phases: list[str]) -> set[int] | None:
        """With ``pdl``, in a kernel whose launch may overlap the kernel before it: the loop-invariant
        tiles to load and compute after the loop, so that the loop streams graph inputs while the
        kernel before still runs; None (wait at the start) unless everything read up to the end of the
        loop is a graph input (``early_inputs``: it was written before the kernel before this one
        passed its own wait, so it is visible here)."""
        if not self.params.pdl or self.plain_launch or not self.early_inputs:
            return None
        blk = self.block
        need: set[int] = set()  # invariant tiles the loop reads, directly or through invariant ops
        for j in reversed(range(len(blk.ops))):
            t, op = self.n_in + j, blk.ops[j]
            if op.kind == "accum" or phases[t] in ("loop", "both") or t in need:
                need.update(x for x in op.inputs if phases[x] == "invariant")
        if not any(bi.forloop_dim != -1 for bi in blk.inputs):
            return None
        invariant = {t for t in range(len(self.tiles)) if phases[t] == "invariant"}
        early = need | {j for j, bi in enumerate(blk.inputs) if bi.forloop_dim != -1}
        if any(blk.inputs[j].source not in self.early_inputs for j in range(self.n_in) if j in early):
            return None
        return invariant - need

    def _shrinkable(self) -> list[int]:
        """Rows each program owns along grid dims that every output maps to its row dim."""
        blk = self.block
        out = [0] * len(blk.grid)
        for g, size in enumerate(blk.grid):
            if size <= 1:
                continue
            per = set()
            for j, bo in enumerate(blk.outputs):
                d = bo.output_map[g]
                n_partial = len(self.out_infos[j].shape) - len(self.tiles[bo.tensor].shape)
                if d == -1 or self.out_rows[j] != n_partial + d:
                    per = set()
                    break
                per.add(self.tiles[bo.tensor].shape[d])
            if len(per) == 1:
                out[g] = per.pop()
        return out

    def _emit_load_setup(self) -> list[tuple[str, str | None, str, str | None]]:
        """Per block input: (offset name, mask name or None, per-iteration step, variable-extent mask or None)."""
        blk, rng = self.block, self.block.forloop_range
        res = []
        for j, bi in enumerate(blk.inputs):
            src = bi.source
            shape, tile = self.arg_infos[src].shape, self.tiles[j].shape
            row = self.arg_rows[src]
            strides = self.strides(shape, row, self.arg_ext[src])
            dims = self.kept(j)
            if j in self.load_transposed:
                dims = dims[:-2] + (dims[-1], dims[-2])
            target = self.classes(j, dims)
            terms, masks = [], []
            for d in range(len(shape)):
                idx = []
                for g, td in enumerate(bi.input_map):
                    if td == d and blk.grid[g] > 1:
                        step = tile[d] * (rng if d == bi.forloop_dim else 1)
                        idx.append(f"pid{g}" if step == 1 else f"pid{g} * {step}")
                c = self.bd.cls[j][d]
                if c is not None:
                    idx.append(self.arange(c, target))
                if d == row:
                    self.uses_n_rows = True
                    masks.append(f"({' + '.join(idx) if idx else '0'} < n_rows)")
                if not idx:
                    continue
                term = " + ".join(idx)
                terms.append(term if strides[d] == "1" else f"({term}) * {strides[d]}" if len(idx) > 1 else f"{term} * {strides[d]}")
            masks = self._tensor_mask(target, masks, dyn=False)
            self._load_dims = getattr(self, "_load_dims", {})
            self._load_dims[j] = dims
            if j in self.tma_loads:
                bounds, dstrides, box, _ = self.tma_loads[j]
                self.emit(f"desc{j} = tl.make_tensor_descriptor(in{src}_ptr, shape=[{', '.join(bounds)}], strides=[{', '.join(dstrides)}], "
                          f"block_shape=[{', '.join(map(str, box))}])")
                res.append((f"desc{j}", None, "0", None))
                continue
            off = f"off{j}"
            self.emit(f"{off} = {' + '.join(terms) if terms else '0'}")
            mask = None
            if masks:
                mask = f"mask{j}"
                self.emit(f"{mask} = {' & '.join(masks)}")
            fd = bi.forloop_dim
            step = "0"
            if fd != -1:
                s = strides[fd]
                step = str(tile[fd]) if s == "1" else f"{tile[fd]} * {s}"
            res.append((off, mask, step, self.dyn_mask(target, bound=j in self.late_loads)))
        return res

    def _tma_box(self, j: int) -> tuple[list[str], list[str], list[int], list[str]] | None:
        """``tma``: for a streamed block input whose tile is a plain box of its tensor, the descriptor's
        shape (per dim the bound that its masks test: ``n_rows``, the valid length ``v_ext<e>`` or, for
        a ``late_ext_mask`` load, the size ``n_ext<e>``; else the dim's size), strides, block shape and
        the load's offsets; None where an ordinary load is needed (a mask that is no tensor bound, a
        1-D tile, a box the copy engine cannot take)."""
        blk, rng = self.block, self.block.forloop_range
        bi = blk.inputs[j]
        if bi.forloop_dim == -1:
            return None
        src = bi.source
        shape, tile = self.arg_infos[src].shape, self.tiles[j].shape
        row, ext = self.arg_rows[src], self.arg_ext[src]
        if not 2 <= len(shape) <= 5:
            return None
        elsize = 4 if self.arg_storage[src] == "float32" else 2
        bounds, box, offsets = [], [], []
        for d in range(len(shape)):
            terms = []
            for g, td in enumerate(bi.input_map):
                if td == d and blk.grid[g] > 1:
                    step = tile[d] * (rng if d == bi.forloop_dim else 1)
                    terms.append(f"pid{g}" if step == 1 else f"pid{g} * {step}")
            if d == bi.forloop_dim and rng > 1:
                terms.append(f"i * {tile[d]}")
            c = self.bd.cls[j][d]
            b = 1 if c is None else self.pad[c]
            if b > 256 or (c is None and tile[d] != 1):
                return None
            if d == row:
                bound = "n_rows"
            elif d in ext:
                # (a valid length of 0 still makes a box of one row: the copy engine takes no empty dim)
                bound = f"n_ext{ext[d]}" if j in self.late_loads else f"tl.maximum(v_ext{ext[d]}, 1)"
            else:
                bound = str(shape[d])
            if c is not None and c in self.dyn and d not in ext:
                return None  # a valid-length mask on a dim that is not this tensor's variable one
            if c is not None and self.pad[c] > self.bd.size[c] and (terms or tile[d] != shape[d]):
                return None  # padding inside the tensor (a ragged block): the bound is no tensor bound
            bounds.append(bound)
            box.append(b)
            offsets.append(" + ".join(terms) or "0")
        if box[-1] * elsize < 16 or (offsets[-1] != "0" and tile[-1] * elsize % 16):
            return None
        strides = self.strides(shape, row, ext)
        for d in range(len(shape) - 1):  # leading strides a multiple of 16 bytes whatever the runtime sizes
            lit = math.prod(shape[e] for e in range(d + 1, len(shape)) if e != row and e not in ext)
            if lit * elsize % 16:
                return None
        return bounds, strides, box, offsets

    def _tensor_mask(self, target: tuple[int, ...], row_masks: list[str], dyn: bool = True) -> list[str]:
        """Padding mask plus row conditions; a scalar row test is widened to the tile
        (scalar masks mixed into tile masks are not portable)."""
        import re

        out = []
        for m in row_masks:
            if target and not re.search(r"\br\d+\b", m):
                m = m.replace("(", f"(tl.zeros({self.shape_of(target)}, tl.int32) + ", 1)
            out.append(m)
        pm = self.pad_mask(target, dyn=dyn)
        return [pm, *out] if pm else out

    def _emit_load(self, j: int, setup: tuple[str, str | None, str, str | None], depth: int) -> _Val:
        off, mask, step, dyn_mask = setup
        src = self.block.inputs[j].source
        if j in self.tma_loads:
            _, _, box, offsets = self.tma_loads[j]
            raw = j in self.raw_loads
            expr = f"{off}.load([{', '.join(offsets)}])"
            dims = self._load_dims[j]
            natural = tuple(d for d, c in enumerate(self.bd.cls[j]) if c is not None)
            if len(natural) < len(box):  # squeeze the tile's size-1 dims
                expr = f"tl.reshape({expr}, {self.shape_of(self.classes(j, natural))})"
            if dims != natural:  # loaded [.., K, N] for a transposed matmul operand
                expr = f"tl.permute({expr}, {tuple(natural.index(d) for d in dims)})"
            cast = "" if self.arg_storage[src] == "float32" or raw else ".to(tl.float32)"
            self.emit(f"t{j} = {expr}{cast}", depth)
            # zeros past each bound, like a masked load's other=0.0 (late_ext_mask: past the size only)
            return _Val(f"t{j}", dims, not (j in self.late_loads and self._has_dyn(j)), raw)
        ptr = f"in{src}_ptr + {off}" + (f" + i * ({step})" if step != "0" else "")
        full = " & ".join(x for x in (mask, dyn_mask) if x)
        m = f", mask={full}, other=0.0" if full else ""
        raw = j in self.raw_loads
        cast = "" if self.arg_storage[src] == "float32" or raw else ".to(tl.float32)"
        if self.body_mode:  # other programs of this launch wrote it: read through L2 (no stale L1 line)
            m += ', cache_modifier=".cg"'
        evict = self._eviction(j)
        if evict:
            m += f', eviction_policy="{evict}"'
        self.emit(f"t{j} = tl.load({ptr}{m}){cast}", depth)
        # late_ext_mask: positions past the valid length hold whatever the tensor holds there
        return _Val(f"t{j}", self._load_dims[j], not (j in self.late_loads and dyn_mask), raw)

    def _has_dyn(self, j: int) -> bool:
        return any(c in self.dyn for c in self.bd.cls[j] if c is not None)

    def _eviction(self, j: int) -> str | None:
        """``stream_evict``: ``evict_first`` for a tile no other program reads (each grid dim of more
        than one program splits its tensor), with 2 ``evict_last`` for one that several programs read."""
        mode = self.params.stream_evict
        if not mode:
            return None
        bi = self.block.inputs[j]
        alone = all(d != -1 for g, d in enumerate(bi.input_map) if self.block.grid[g] > 1)
        return "evict_first" if alone else ("evict_last" if mode == 2 else None)

    def _emit_store(self, j: int, bo, v: _Val) -> None:
        blk = self.block
        t = bo.tensor
        v = self.natural(v, t)
        shape, tile = self.out_infos[j].shape, self.tiles[t].shape
        row = self.out_rows[j]
        strides = self.strides(shape, row, self.out_ext[j])
        n_partial = len(shape) - len(tile)
        target = self.classes(t, v.dims)
        terms, masks = [], []
        partial_grid = [g for g, d in enumerate(bo.output_map) if d == -1 and blk.grid[g] > 1]
        for p, g in enumerate(partial_grid):
            terms.append(f"pid{g}" if strides[p] == "1" else f"pid{g} * {strides[p]}")
        for d in range(len(tile)):
            od = n_partial + d
            idx = [f"pid{g}" if tile[d] == 1 else f"pid{g} * {tile[d]}" for g, td in enumerate(bo.output_map) if td == d and blk.grid[g] > 1]
            c = self.bd.cls[t][d]
            if c is not None:
                idx.append(self.arange(c, target))
            if od == row:
                self.uses_n_rows = True
                masks.append(f"({' + '.join(idx) if idx else '0'} < n_rows)")
            if idx:
                term = " + ".join(idx)
                s = strides[od]
                terms.append(term if s == "1" else (f"({term}) * {s}" if len(idx) > 1 else f"{term} * {s}"))
        masks = self._tensor_mask(target, masks)
        val = v.name if self.out_storage[j] == "float32" else f"{v.name}.to({TL_DTYPES[self.out_storage[j]]})"
        m = f", mask={' & '.join(masks)}" if masks else ""
        self.emit(f"tl.store(out{j}_ptr + {' + '.join(terms) if terms else '0'}, {val}{m})")

    # ---- operators -----------------------------------------------------------------------
    def _emit_op(self, op: Op, t: int, env: dict[int, _Val], depth: int, suffix: str) -> _Val:
        name = f"t{t}{suffix}"
        ins = [self.natural(env[x], x) for x in op.inputs] if op.kind != "matmul" else []
        out_cls = self.classes(t, self.kept(t))
        k = op.kind
        if k == "matmul":
            ins = [env[x] if x in self.load_transposed else self.natural(env[x], x) for x in op.inputs]
            return self._emit_matmul(op, t, ins, name, depth)
        if k == "unary":
            (x,) = ins
            fn, s = op.attr("fn"), op.attr("scalar")
            expr = {
                "exp": f"tl.exp({x.name})",
                "silu": f"{x.name} * tl.sigmoid({x.name})",
                "sqrt": f"tl.sqrt({x.name})",
                "rsqrt": f"tl.rsqrt({x.name})",
                "square": f"{x.name} * {x.name}",
                "neg": f"-{x.name}",
                "recip": f"1.0 / {x.name}",
                "mul_scalar": f"{x.name} * {_num(s) if s is not None else ''}",
                "add_scalar": f"{x.name} + {_num(s) if s is not None else ''}",
            }[fn]
            self.emit(f"{name} = {expr}", depth)
            return _Val(name, self.kept(t), x.zero and fn in ("silu", "sqrt", "square", "neg", "mul_scalar"))
        if k == "binary":
            a, b = ins
            sym = {"add": "+", "sub": "-", "mul": "*", "div": "/"}[op.attr("fn")]
            ea, eb = self.expand(a, op.inputs[0], out_cls), self.expand(b, op.inputs[1], out_cls)
            self.emit(f"{name} = {ea} {sym} {eb}", depth)
            zero = a.zero and b.zero and op.attr("fn") != "div"
            if zero and op.attr("fn") in ("add", "sub"):  # an operand broadcast along a padded class is not zero there
                masked = {c for c in out_cls if self.pad[c] > self.bd.size[c] or c in self.dyn}
                zero = all(masked <= set(self.classes(x, v.dims)) for x, v in zip(op.inputs, (a, b), strict=True))
            return _Val(name, self.kept(t), zero)
        if k == "reduce":
            (x,) = ins
            src = op.inputs[0]
            d = op.attr("dim", -1) % len(self.tiles[src].shape)
            c = self.bd.cls[src][d]
            if c is None:
                return _Val(x.name, self.kept(t), x.zero)
            axis = x.dims.index(d)
            if op.attr("fn") == "sum":
                self.emit(f"{name} = tl.sum({self.masked(x, src, (c,), '0.0')}, axis={axis})", depth)
                return _Val(name, self.kept(t), x.zero)
            self.uses_max = True
            self.emit(f"{name} = tl.reduce({self.masked(x, src, (c,), _num(float('-inf')))}, {axis}, {MAX_COMBINE})", depth)
            return _Val(name, self.kept(t), False)
        if k == "rms_norm":
            x = ins[0]
            src = op.inputs[0]
            last = len(self.tiles[src].shape) - 1
            c = self.bd.cls[src][last]
            n = self.tiles[src].shape[last]
            if c is None:
                ms = f"{x.name} * {x.name}"
            else:
                xm = self.masked(x, src, (c,), "0.0")
                self.emit(f"{name}_ms = tl.sum({xm} * {xm}, axis={len(x.dims) - 1}) / {_num(n)}", depth)
                ms = f"{name}_ms"
                if len(x.dims) > 1:
                    ms += "[" + ", ".join([":"] * (len(x.dims) - 1) + ["None"]) + "]"
            expr = f"{x.name} * tl.rsqrt({ms} + {_num(op.attr('eps', 0.0))})"
            if len(ins) > 1:
                expr += f" * {self.expand(ins[1], op.inputs[1], out_cls)}"
            self.emit(f"{name} = {expr}", depth)
            return _Val(name, self.kept(t), False)
        if k == "sum_to":
            expr = self._sum_to(ins[0], op.inputs[0], t, op.attr("size"))
            self.emit(f"{name} = {expr}", depth)
            return _Val(name, self.kept(t), ins[0].zero)
        raise CodegenError(f"{self._w(t)}: block-level {k!r} has no Triton lowering; supported: matmul, unary, binary, reduce, rms_norm, sum_to, accum")

    def _emit_matmul(self, op: Op, t: int, ins: list[_Val], name: str, depth: int) -> _Val:
        a, b = ins
        if t in self.dot_ops:
            self.emit(f"{name} = {self._dot_expr(op, t, ins)}", depth)
            return _Val(name, self.kept(t), a.zero and b.zero)
        ia, ib = op.inputs
        sb = self.tiles[ib].shape
        trans = bool(op.attr("trans_b"))
        am, bm = self._matmul_operands(op, ins)
        ck = self.bd.cls[ia][-1]
        cb = self.bd.cls[ib]
        nb = len(sb) - 2 if trans else len(sb) - 1
        batch = tuple(c for c in self.bd.cls[ia][:-2] if c is not None)
        m, n = self.bd.cls[ia][-2], cb[nb]
        tail = (n, ck) if trans else (ck, n)
        prod = tuple(c for c in batch + (m,) + tail if c is not None)
        ea = self.expand(_Val(am, a.dims, a.zero), ia, prod)
        eb = self.expand(_Val(bm, b.dims, b.zero), ib, prod)
        if ck is None:
            self.emit(f"{name} = {ea} * {eb}", depth)
        else:
            self.emit(f"{name} = tl.sum({ea} * {eb}, axis={prod.index(ck)})", depth)
        return _Val(name, self.kept(t), a.zero and b.zero)

    def _matmul_operands(self, op: Op, ins: list[_Val]) -> tuple[str, str]:
        """The operands of a tile matmul with padding (and invalid positions) of the contracted dim zeroed."""
        a, b = ins
        ia, ib = op.inputs
        ck = self.bd.cls[ia][-1]
        am = self.masked(a, ia, (ck,), "0.0") if ck is not None else a.name
        bm = b.name
        if ck is not None and not b.zero:
            bm = self.masked(b, ib, (ck,), "0.0")
        return am, bm

    def _dot_expr(self, op: Op, t: int, ins: list[_Val], acc: str | None = None) -> str:
        """``tl.dot`` of matmul ``t``; with ``acc``, accumulating into it (for a swapped dot ``acc``
        and the result are transposed: [N, M])."""
        a, b = ins
        ib = op.inputs[1]
        am, bm = self._matmul_operands(op, ins)
        prec = self.params.dot_precision
        if prec == "auto":
            prec = "tf32" if self.low else "ieee"
        kw = ""
        if t in self.native_dots:
            low = TL_DTYPES[self.low]
            am = am if a.raw else f"({am}).to({low})"
            bm = bm if b.raw else f"({bm}).to({low})"
        else:
            kw = f', input_precision="{"ieee" if prec == "input" else prec}"'
        b_nk = bool(op.attr("trans_b")) and ib not in self.load_transposed  # b holds [N, K]
        acc_arg = f", {acc}" if acc is not None else ""
        if t in self.swap_dots:  # (A @ B)^T = B^T @ A^T: the weight's columns are the MMA's M side
            bt = bm if b_nk else f"tl.trans({bm})"
            dot = f"tl.dot({bt}, tl.trans({am}){acc_arg}{kw})"
            return dot if acc is not None else f"tl.trans({dot})"
        return f"tl.dot({am}, {f'tl.trans({bm})' if b_nk else bm}{acc_arg}{kw})"

    def _sum_to(self, x: _Val, src: int, t: int, size: int) -> str:
        """Strided sum of the last dim down to ``size``: out[c] = sum_k x[c + size*k]."""
        last = len(self.tiles[src].shape) - 1
        c_in = self.bd.cls[src][last]
        n = self.tiles[src].shape[last]
        if c_in is None:
            return x.name
        axis = len(x.dims) - 1
        if size == 1:
            return f"tl.sum({self.masked(x, src, (c_in,), '0.0')}, axis={axis})"
        c_out = self.bd.cls[t][last]
        pad_in = self.pad[c_in]
        lead = [self.pad[c] for c in self.classes(src, x.dims[:-1])]
        if pad_in == n and _pow2(size) == size:
            shape = ", ".join(str(s) for s in lead + [n // size, size])
            return f"tl.sum(tl.reshape({x.name}, ({shape})), axis={axis})"
        sel = f"((r{c_in}[:, None] % {size}) == r{c_out}[None, :])"
        if pad_in > n:
            sel += f" & m{c_in}[:, None]"
        pre = ", ".join([":"] * axis)
        xs = f"{x.name}[{pre + ', ' if pre else ''}:, None]"
        sl = f"({sel})" + (f"[{', '.join(['None'] * axis)}, :, :]" if axis else "")
        return f"tl.sum(tl.where({sl}, {xs}, 0.0), axis={axis})"

    # ---- accumulators --------------------------------------------------------------------
    def _emit_acc_init(self, t: int) -> None:
        op = self.block.ops[t - self.n_in]
        shape = self.shape_of(self._acc_classes(t))
        if op.attr("fn") == "max_last":
            self.emit(f'mx{t} = tl.full({shape}, float("-inf"), tl.float32)')
        else:
            self.emit(f"acc{t} = tl.zeros({shape}, tl.float32)")

    def _acc_classes(self, t: int) -> tuple[int, ...]:
        """Register classes of accumulator ``t``: reversed where it is a swapped dot's MMA accumulator."""
        cls = self.classes(t, self.kept(t))
        return cls[::-1] if self.acc_dots.get(t) in self.swap_dots else cls

    def _emit_acc_step(self, op: Op, t: int, env: dict[int, _Val], need_alpha: bool) -> _Val:
        fn = op.attr("fn")
        if t in self.acc_dots:  # the MMA accumulates: acc = dot(a, b, acc), rescaled first where the sum is
            mt = self.acc_dots[t]
            mop = self.block.ops[mt - self.n_in]
            ins = [env[x] if x in self.load_transposed else self.natural(env[x], x) for x in mop.inputs]
            acc = f"acc{t}"
            if fn.startswith("rescaled"):
                at = op.inputs[1]
                acc += f" * {self.expand(_Val(f'alpha{at}', self.kept(at), False), at, self._acc_classes(t))}"
            self.emit(f"acc{t} = {self._dot_expr(mop, mt, ins, acc)}", 2)
            dims = self.kept(t)
            return _Val(f"acc{t}", dims[::-1] if mt in self.swap_dots else dims, False)
        src = op.inputs[0]
        x = self.natural(env[src], src)
        last = len(self.tiles[src].shape) - 1
        c_last = self.bd.cls[src][last]
        axis = len(x.dims) - 1
        out_cls = self.classes(t, self.kept(t))
        if fn == "max_last":
            xm = self.masked(x, src, (c_last,), _num(float("-inf"))) if c_last is not None else x.name
            self.uses_max = self.uses_max or c_last is not None
            rowmax = f"tl.reduce({xm}, {axis}, {MAX_COMBINE})" if c_last is not None else x.name
            if need_alpha:
                self.emit(f"mxprev{t} = mx{t}", 2)
            self.emit(f"mx{t} = tl.maximum(mx{t}, {rowmax}, propagate_nan=tl.PropagateNan.ALL)", 2)
            if need_alpha:  # an unchanged maximum rescales by exactly 1, also when it is infinite (no -inf - -inf = nan)
                self.emit(f"alpha{t} = tl.where(mxprev{t} == mx{t}, 1.0, tl.exp(mxprev{t} - mx{t}))", 2)
            return _Val(f"mx{t}", self.kept(t), False)
        if fn in ("sum", "rescaled_sum"):
            kept_dyn = tuple(c for c in self.classes(src, x.dims) if c in self.dyn)
            contrib = self.masked(x, src, kept_dyn, "0.0") if kept_dyn else x.name
        elif fn in ("sum_last", "rescaled_sum_last"):
            contrib = f"tl.sum({self.masked(x, src, (c_last,), '0.0')}, axis={axis})" if c_last is not None else x.name
        elif fn in ("mean_sq_last", "rms_last"):
            xm = self.masked(x, src, (c_last,), "0.0") if c_last is not None else x.name
            contrib = f"tl.sum({xm} * {xm}, axis={axis})" if c_last is not None else f"{x.name} * {x.name}"
        elif fn == "sum_to":
            contrib = self._sum_to(x, src, t, op.attr("size"))
        else:
            raise CodegenError(f"{self._w(t)}: accumulator {fn!r} has no Triton lowering")
        if fn.startswith("rescaled"):
            mt = op.inputs[1]
            alpha = self.expand(_Val(f"alpha{mt}", self.kept(mt), False), mt, out_cls)
            self.emit(f"acc{t} = acc{t} * {alpha} + {contrib}", 2)
        else:
            self.emit(f"acc{t} += {contrib}", 2)
        return _Val(f"acc{t}", self.kept(t), False)

    def _emit_acc_final(self, op: Op, t: int) -> _Val:
        fn = op.attr("fn")
        src = op.inputs[0]
        if fn == "max_last":
            return _Val(f"mx{t}", self.kept(t), False)
        zero = False  # conservative: accumulated padding is re-masked where it matters
        if fn in ("mean_sq_last", "rms_last"):
            count = self.tiles[src].shape[-1] * self.block.forloop_range
            expr = f"acc{t} / {_num(count)}"
            if fn == "rms_last":
                expr = f"tl.sqrt({expr})"
            self.emit(f"t{t} = {expr}")
            return _Val(f"t{t}", self.kept(t), zero)
        if self.acc_dots.get(t) in self.swap_dots:
            self.emit(f"acc{t} = tl.trans(acc{t})")
        return _Val(f"acc{t}", self.kept(t), zero)


def generate_kernel(
    name: str,
    op: Op,
    arg_infos: list[TensorInfo],
    arg_storage: list[str],
    arg_rows: list[int | None],
    out_infos: list[TensorInfo],
    out_storage: list[str],
    out_rows: list[int | None],
    params: CodegenParams,
    where: str,
    arg_ext: list[dict[int, int]] | None = None,
    out_ext: list[dict[int, int]] | None = None,
    early_inputs: frozenset[int] = frozenset(),
    plain_launch: bool = False,
) -> KernelSource:
    """Triton source for one customized operator (see the module docstring).

    ``arg_ext`` / ``out_ext``: per kernel input / output, its variable-extent dims (dim -> extent id).
    ``early_inputs``: kernel inputs that a ``pdl`` launch may read before waiting for the kernel
    before it (graph inputs, in a kernel that is not the graph's first). ``plain_launch``: with
    ``pdl=2``, this is the graph's first kernel: it is launched without programmatic dependent launch
    and does not wait, but still lets the kernel after it launch early."""
    if op.block is None:
        raise CodegenError(f"{where}: customized operator without a block graph")
    return _build_gen(name, op, arg_infos, arg_storage, arg_rows, out_infos, out_storage, out_rows, params, where, arg_ext, out_ext,
                      early_inputs, plain_launch).generate()


def _build_gen(name, op, arg_infos, arg_storage, arg_rows, out_infos, out_storage, out_rows, params, where, arg_ext=None, out_ext=None,
               early_inputs=frozenset(), plain_launch=False) -> _Gen:
    if op.block is None:
        raise CodegenError(f"{where}: customized operator without a block graph")
    def make(factor: int) -> _Gen:
        block = op.block if factor == 1 else dataclasses.replace(op.block, forloop_range=op.block.forloop_range * factor)
        g = _Gen(name, op if factor == 1 else dataclasses.replace(op, block=block), arg_infos, arg_storage, arg_rows, out_infos,
                 out_storage, out_rows, params, where, arg_ext, out_ext, early_inputs, plain_launch)
        g.loop_split = factor
        return g

    gen = make(1)
    base = gen.bd
    f = params.k_chunks
    looped = any(bi.forloop_dim != -1 for bi in op.block.inputs)
    if f > 1 and looped:
        check_loop_refinable(op.block, base, f, where)
        try:
            gen = make(f)
        except MuGraphError as e:
            raise CodegenError(f"{where}: k_chunks={f} does not divide the loop tiles: {e}") from e
    if params.matmul == "auto" and looped:
        gen = _split_spilling_loop(gen, make, base, op, where)
    return gen


#: The most ``matmul="auto"`` splits a loop iteration to keep GEMV math in registers.
MAX_AUTO_SPLIT = 64


def loop_split(op: Op, arg_infos: list[TensorInfo], out_infos: list[TensorInfo], params: CodegenParams) -> int:
    """Steps each iteration of customized operator ``op``'s loop runs in when generated with
    ``params`` (tensors stored in their own dtypes): ``k_chunks``, times what ``matmul="auto"`` adds
    to keep GEMV math in registers; 1 where no kernel can be generated for it."""
    try:
        return _build_gen("k", op, arg_infos, [i.dtype for i in arg_infos], [None] * len(arg_infos), out_infos,
                          [o.dtype for o in out_infos], [None] * len(out_infos), params, "loop_split").loop_split
    except (CodegenError, MuGraphError):
        return 1


def _split_spilling_loop(gen: _Gen, make, base, op: Op, where: str) -> _Gen:
    """``matmul="auto"``: while some tile matmul stays GEMV math that would spill registers (its
    ``tl.dot`` tiles do not fit shared memory, or it has one row), double the steps each loop
    iteration runs in, as ``k_chunks`` does, where the loop body allows it: the same arithmetic in
    smaller tiles, which then fit the registers or move to ``tl.dot``. Stops at the first split without such
    a matmul, at a split the loop does not allow (keeping the last one it did) or at
    :data:`MAX_AUTO_SPLIT` times the requested ``k_chunks``."""
    limit = gen.loop_split * MAX_AUTO_SPLIT
    while gen.spilling_gemvs() and gen.loop_split < limit:
        factor = gen.loop_split * 2
        try:
            check_loop_refinable(op.block, base, factor, where)
            gen = make(factor)
        except (CodegenError, MuGraphError):
            break
    return gen


def generate_fused_combine(name: str, first: dict, second: dict, links: dict[int, int], free: dict[int, int], sources: list[int],
                           groups: tuple[int, ...], partial_programs: int, params: CodegenParams) -> KernelSource:
    """One kernel for a partials kernel and the combine kernel that reads only its outputs (``fused_combine``).

    ``first`` / ``second``: :func:`generate_kernel`'s arguments (less name and params) for the two.
    ``links``: combine grid dim -> partials grid dim whose program index it shares; ``free``: the
    combine's other grid dims (> 1) -> size; ``sources``: per combine kernel input, the partials
    output it is; ``groups``: the partials grid dims (> 1) that combine programs are linked to (a
    group is one index along them); ``partial_programs``: programs a group (the product of the
    partial grid dims). The combine becomes a ``@triton.jit`` callee with its program ids as
    arguments, called by the last program of a group to count itself in on ``cnt_ptr`` for each
    index along the free dims (unrolled); that program then resets the counter for the next launch."""
    g2 = _build_gen(f"{name}_combine", params=dataclasses.replace(params, pdl=0), **second)
    g2.body_mode = True
    src2 = g2.generate()
    g1 = _build_gen(name, params=params, **first)
    n_out2 = len(second["out_infos"])
    g1.extra_args = [(f"cout{j}_ptr", PTR_TYPES[s]) for j, s in enumerate(second["out_storage"])] + [("cnt_ptr", "*i32")]
    g1.force_n_rows = src2.uses_n_rows
    g1.force_extents = src2.extents
    grid1 = first["op"].block.grid
    grp, stride = [], 1
    for g in reversed(groups):
        grp.append(f"pid{g}" if stride == 1 else f"pid{g} * {stride}")
        stride *= grid1[g]
    call = [f"out{s}_ptr" for s in sources] + [f"cout{j}_ptr" for j in range(n_out2)]
    if src2.uses_n_rows:
        call.append("n_rows")
    for e in src2.extents:
        call += [f"n_ext{e}", f"ext{e}_ptr"]
    grid2 = second["op"].block.grid
    call += [f"pid{links[g]}" if g in links else f"f{g}" for g, size in enumerate(grid2) if size > 1]
    tail = ["    tl.debug_barrier()  # every thread of this program has stored its partials",
            f"    grp = {' + '.join(reversed(grp)) if grp else '0'}",
            "    arrived = tl.atomic_add(cnt_ptr + grp, 1)  # acq_rel at GPU scope: the partials of those before are visible",
            f"    if arrived == {partial_programs - 1}:  # the last of its group: combine, then reset for the next launch"]
    depth = 2
    for g, size in sorted(free.items()):
        tail.append("    " * depth + f"for f{g} in tl.static_range({size}):")  # unrolled: all parts' loads in flight at once
        depth += 1
    tail.append("    " * depth + f"{src2.name}({', '.join(call)})")
    # a plain store: nothing else touches this counter in this launch, and the next launch counts only after
    # this one has finished (stream order, or its griddepcontrol.wait under programmatic dependent launch)
    tail.append("        tl.store(cnt_ptr + grp, 0)")
    g1.tail = tail
    src1 = g1.generate()
    prefix = _MAX_COMBINE_SRC if (g1.uses_max or g2.uses_max) else '__name__ = "mirage_serve.codegen.generated"\n\n'
    text = prefix + g2.fn_text + "\n\n" + g1.fn_text
    return dataclasses.replace(src1, text=text, combine_outputs=n_out2, counters=math.prod(grid1[g] for g in groups))
