"""Tuning knobs of code generation (none of them changes what a kernel computes)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

MATMUL_MODES = ("auto", "dot", "fma")
DOT_PRECISIONS = ("auto", "ieee", "tf32", "input")


class CodegenError(ValueError):
    """A μGraph construct the Triton generator does not support; the message names the operator."""


@dataclass(frozen=True)
class CodegenParams:
    """Knobs where a μGraph leaves freedom; its grid and forloop_range fix the tiling.

    * ``num_warps``, ``num_stages``: passed to every launch.
    * ``matmul``: ``"dot"`` uses ``tl.dot`` for every tile matmul with rows,
      columns and inner dim > 1 (padding each to >= 16); ``"fma"`` uses
      broadcast-multiply-reduce (GEMV style) everywhere; ``"auto"`` uses
      ``tl.dot`` when the tile has at least ``dot_min_rows`` rows.
    * ``dot_precision``: ``"ieee"`` (exact fp32), ``"tf32"``, ``"input"`` (cast
      operands to the graph's 16-bit dtype, native tensor-core MMA), or
      ``"auto"``: ieee for float32 graphs, tf32 for 16-bit ones (tf32 holds
      bf16/fp16 values exactly).
    * ``shrink_grid``: launch only the programs that own valid rows when the
      runtime row count is below the bucket.
    """

    num_warps: int = 4
    num_stages: int = 2
    matmul: str = "auto"
    dot_min_rows: int = 16
    dot_precision: str = "auto"
    shrink_grid: bool = True

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

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> CodegenParams:
        unknown = set(d) - set(CodegenParams.__dataclass_fields__)
        if unknown:
            raise CodegenError(f"unknown codegen parameter(s) {sorted(unknown)}; known: {sorted(CodegenParams.__dataclass_fields__)}")
        return CodegenParams(**d)

    def key(self) -> str:
        """A short stable digest, for names of registered operators and cache keys."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:10]
