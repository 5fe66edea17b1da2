"""Tuning knobs of code generation (none of them changes what a kernel computes)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

MATMUL_MODES = ("auto", "dot", "fma")
DOT_PRECISIONS = ("auto", "ieee", "tf32", "input")


class CodegenError(ValueError):
    """A μGraph construct the Triton generator does not support; the message names the operator."""


#: Elements of a GEMV-style broadcast product a thread holds in registers; above it the code spills.
GEMV_PRODUCT_PER_THREAD = 128
#: Bytes of one iteration's operand tiles (16-row padded; 4 bytes an element for tf32 operands, 2
#: for 16-bit ones) up to which ``"auto"`` moves a spilling GEMV onto ``tl.dot``; larger staged
#: tiles would not fit Hopper's shared memory.
AUTO_DOT_MAX_OPERAND_BYTES = 96 * 1024


def gemv_fits(rows: int, cols: int, inner: int, num_warps: int, operand_bytes: int = 4) -> bool:
    """Whether ``matmul="auto"`` computes a tile matmul of fewer than ``dot_min_rows`` rows as GEMV
    math: one row always (the MMA would pad it to 16); otherwise while its broadcast product fits
    the registers, or where the tiles ``tl.dot`` would stage (``operand_bytes`` an element: 4 for
    tf32 or fp32 operands, 2 for 16-bit ones) are too large for shared memory."""
    if rows <= 1 or rows * cols * inner <= GEMV_PRODUCT_PER_THREAD * 32 * num_warps:
        return True
    return (max(16, rows) + max(16, cols)) * inner * operand_bytes > AUTO_DOT_MAX_OPERAND_BYTES


def dot_operand_bytes(dot_precision: str, low: bool, exact16: bool) -> int:
    """Bytes an element of a ``tl.dot`` operand tile takes: 2 where the MMA multiplies 16-bit
    operands (``"input"`` precision in a 16-bit graph, or ``"auto"`` on two 16-bit inputs loaded as
    they are: ``exact16``), else 4 (tf32 or fp32)."""
    return 2 if low and (dot_precision == "input" or (dot_precision == "auto" and exact16)) else 4


@dataclass(frozen=True)
class CodegenParams:
    """Knobs where a μGraph leaves freedom; its grid and forloop_range fix the tiling.

    * ``num_warps``, ``num_stages``: passed to every launch.
    * ``matmul``: ``"dot"`` uses ``tl.dot`` for every tile matmul with rows,
      columns and inner dim > 1 (padding each to >= 16); ``"fma"`` uses
      broadcast-multiply-reduce (GEMV style) everywhere; ``"auto"`` uses
      ``tl.dot`` when the tile has at least ``dot_min_rows`` rows, and also from
      two rows up when the GEMV form's broadcast product (rows x columns x
      inner) would not fit the threads' registers, so that code would spill
      (more than :data:`GEMV_PRODUCT_PER_THREAD` a thread), unless the dot's
      staged tiles would not fit shared memory (:func:`gemv_fits`). Where a
      tile matmul then stays GEMV math that would spill (one row, or tiles too
      large for ``tl.dot``), ``"auto"`` also splits each for-loop iteration into
      more steps, as ``k_chunks`` does, until none does or the loop body does
      not allow a finer split
      (:func:`mirage_serve.codegen.triton_gen.loop_split`): smaller tiles
      that fit the registers or go to ``tl.dot``, the same arithmetic.
    * ``dot_precision``: ``"ieee"`` (exact fp32), ``"tf32"``, ``"input"`` (cast
      operands to the graph's 16-bit dtype, native tensor-core MMA), or
      ``"auto"``: ieee for float32 graphs; in 16-bit graphs, native 16-bit MMA
      for a tile matmul both of whose operands are 16-bit inputs loaded as they
      are (their products are exact in fp32, as with tf32, at half the staged
      bytes), tf32 for the others (tf32 holds bf16/fp16 values exactly).
    * ``shrink_grid``: launch only the programs that own valid rows when the
      runtime row count is below the bucket.
    * ``dot_swap``: 1 computes a tile matmul A @ B as ``(B^T @ A^T)^T`` on the
      tensor cores, so a wide weight tile is the MMA's M side and a few batch
      rows (padded to 16) its N side.
    * ``k_chunks``: split every for-loop iteration into this many steps along
      the loop dims (an inner chunk of ``tile / k_chunks`` per step). It runs the
      same arithmetic in smaller register tiles; allowed only where the loop body
      decomposes (see :func:`mirage_serve.codegen.triton_gen.check_loop_refinable`).
      ``matmul="auto"`` may split further (above).
    * ``pdl``: 1 launches every kernel with programmatic dependent launch
      (Hopper and newer): a kernel's launch overlaps the tail of the one before
      it and waits (``griddepcontrol.wait``) before touching memory. 2 does so for every kernel
      but the graph's first, which is launched plainly (after all work before it, like a kernel
      without PDL) and only lets the kernel after it launch early: a first kernel launched with
      PDL behind an unrelated kernel pays for the overlap without gaining from it.
    * ``fused_combine``: 1 runs a graph of two kernels, partials then their combine (split-KV
      attention, split-K), as one launch: each program of the first writes its partials, then
      counts itself in on an atomic counter of its group (the programs whose partials one combine
      program reads); the last to arrive runs the combine programs of that group. Only for graphs
      of that form (:func:`mirage_serve.codegen.runtime.fusable_combine`).
    * ``late_ext_mask``: masks loads of a variable-extent dim (e.g. the KV length) only by the
      tensor's size in memory (``n_ext``, a launch argument) instead of the valid length read from
      ``ext_ptr``, so they issue without waiting for that read; positions past the valid length are
      then excluded where they matter (zeroed in matmul operands and reductions over that dim, like
      padding). 2: every such load; 1: only tiles that no operator reading them directly contracts
      or reduces over that dim (K of decode attention, not V, which would be zeroed right after its
      load). Such loads read up to the tensor's size, not the valid length.
    * ``stream_evict``: L2 eviction hints on loads: 1 ``evict_first`` on tiles no other program
      reads, 2 also ``evict_last`` on tiles several programs read (not on ``tma`` loads).
    * ``dot_acc``: 1 lets a tile matmul on the tensor cores whose only reader is a sum accumulator
      (plain or rescaled) accumulate in the MMA itself, ``acc = tl.dot(a, b, acc)`` (for a swapped
      dot the accumulator is kept transposed until after the loop), instead of adding a separate
      ``tl.dot`` result to it: Triton can then leave the MMA in flight across loop iterations.
    * ``tma``: 1 loads the for-loop's streamed tiles through tensor descriptors
      (``tl.make_tensor_descriptor`` / ``desc.load``: Hopper's bulk tensor copy engine) where the
      tile is a plain box of its tensor: every mask on it is a bound of a tensor dim (the row
      count, a variable extent, a dim the tile covers from 0), which the descriptor's shape then
      enforces by filling zeros; other tiles (a ragged column block, 1-D tiles, a box dim over 256)
      keep ordinary loads. The descriptors are made per program in a global workspace that
      :mod:`mirage_serve.codegen.runtime` allocates (``triton.set_allocator``). On an H200
      (2026-12-04, Triton 3.6) it was slower everywhere it applied (decode attention +2.5-2.7 µs,
      RMSNorm->QKV b32 +0.7 µs; benchmarks/NOTES.md), so the tuner does not offer it.
    """

    num_warps: int = 4
    num_stages: int = 2
    matmul: str = "auto"
    dot_min_rows: int = 16
    dot_precision: str = "auto"
    shrink_grid: bool = True
    dot_swap: int = 0
    k_chunks: int = 1
    pdl: int = 0
    fused_combine: int = 0
    late_ext_mask: int = 0
    stream_evict: int = 0
    tma: int = 0
    dot_acc: int = 0

    def __post_init__(self) -> None:
        if self.matmul not in MATMUL_MODES:
            raise CodegenError(f"CodegenParams.matmul={self.matmul!r}; use one of {MATMUL_MODES}")
        if self.dot_precision not in DOT_PRECISIONS:
            raise CodegenError(f"CodegenParams.dot_precision={self.dot_precision!r}; use one of {DOT_PRECISIONS}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise CodegenError(f"CodegenParams.num_warps={self.num_warps}; use a power of two from 1 to 32")
        if not 1 <= self.num_stages <= 8:
            raise CodegenError(f"CodegenParams.num_stages={self.num_stages}; use 1..8")
        if self.dot_min_rows < 1:
            raise CodegenError("CodegenParams.dot_min_rows must be positive")
        if any(v not in (0, 1) for v in (self.dot_swap, self.fused_combine, self.tma, self.dot_acc)):
            raise CodegenError("CodegenParams.dot_swap, .fused_combine, .tma and .dot_acc are 0 or 1")
        if self.pdl not in (0, 1, 2):
            raise CodegenError(f"CodegenParams.pdl={self.pdl}; use 0, 1 or 2")
        if self.late_ext_mask not in (0, 1, 2):
            raise CodegenError(f"CodegenParams.late_ext_mask={self.late_ext_mask}; use 0, 1 or 2")
        if self.stream_evict not in (0, 1, 2):
            raise CodegenError(f"CodegenParams.stream_evict={self.stream_evict}; use 0, 1 or 2")
        if self.k_chunks < 1 or self.k_chunks & (self.k_chunks - 1):
            raise CodegenError(f"CodegenParams.k_chunks={self.k_chunks}; use a power of two >= 1")

    def to_dict(self) -> dict:
        return asdict(self)

    def cache_params(self) -> dict[str, int | str]:
        """The fields that differ from the defaults, as ints and strings (the kernel cache's params form)."""
        default = CodegenParams()
        return {k: (int(v) if isinstance(v, bool) else v) for k, v in asdict(self).items() if v != getattr(default, k)}

    @staticmethod
    def from_dict(d: dict) -> CodegenParams:
        unknown = set(d) - set(CodegenParams.__dataclass_fields__)
        if unknown:
            raise CodegenError(f"unknown codegen parameter(s) {sorted(unknown)}; known: {sorted(CodegenParams.__dataclass_fields__)}")
        fields = CodegenParams.__dataclass_fields__
        return CodegenParams(**{k: (bool(v) if fields[k].type in (bool, "bool") else v) for k, v in d.items()})

    def key(self) -> str:
        """A short stable digest, for names of registered operators and cache keys."""
        d = self.to_dict()
        for k in ("fused_combine", "late_ext_mask", "stream_evict", "tma", "dot_acc"):  # keys of points without them stay as they were before the knobs existed
            if not d[k]:
                del d[k]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]
