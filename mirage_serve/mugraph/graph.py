"""The μGraph IR: kernel graphs whose customized operators carry block graphs.

Everything is plain, immutable data. Tensors are numbered positionally (SSA):
in a kernel graph, tensor ``i`` is the output of the ``i``-th single-output
operator, counting each output of a customized operator separately; in a block
graph, tensors ``0 .. len(inputs)-1`` are the loaded tiles and the operators'
outputs follow in order.

Kernel-level operator kinds (``Op.kind``):

* ``input``      attrs ``name``, ``shape``, ``dtype``; no inputs.
* ``matmul``     ``a @ b`` (or ``a @ b^T`` with ``trans_b``); leading dims equal or ``b`` rank 2.
* ``unary``      attr ``fn`` in :data:`UNARY_FNS`; ``scalar`` for ``mul_scalar``/``add_scalar``.
* ``binary``     attr ``fn`` in :data:`BINARY_FNS`, numpy broadcasting.
* ``reduce``     attrs ``fn`` (``sum``/``max``), ``dim``, ``keepdim``.
* ``rms_norm``   ``x * rsqrt(mean(x^2, -1) + eps) [* w]``; attr ``eps``; inputs ``(x,)`` or ``(x, w)``.
* ``concat``     attr ``dim``.
* ``customized`` a :class:`BlockGraph` in ``Op.block``; one output per block output.

Block-level operators are the same tile operators (``matmul``, ``unary``,
``binary``, ``reduce``, ``rms_norm``, ``concat``, ``sum_to``) plus ``accum``
operators (attr ``fn`` in :data:`ACCUM_FNS`) that close the for-loop; see
:mod:`mirage_serve.mugraph.shapes` for their exact semantics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

UNARY_FNS = ("exp", "silu", "sqrt", "rsqrt", "square", "neg", "recip", "mul_scalar", "add_scalar")
BINARY_FNS = ("add", "sub", "mul", "div")
REDUCE_FNS = ("sum", "max")
KERNEL_KINDS = ("input", "matmul", "unary", "binary", "reduce", "rms_norm", "concat", "customized")
TILE_KINDS = ("matmul", "unary", "binary", "reduce", "rms_norm", "concat", "sum_to")
# For-loop accumulators (block level). ``x_i`` is the input's value in iteration i of R.
#   sum            Σ_i x_i
#   sum_last       Σ_i Σ_lastdim x_i              (last dim -> 1)
#   sum_to         Σ_i strided sum of the last dim down to attr ``size``: out[c] = Σ_k x[c + size*k]
#   mean_sq_last   Σ_i Σ_lastdim x_i^2 / (R * n)  (last dim -> 1)
#   rms_last       sqrt(mean_sq_last)             (upstream Mirage's red_ld_rms)
#   max_last       running max over the loop and the last dim; its value is usable inside the
#                  loop (the max so far, m_i) and after it (m_R)
#   rescaled_sum       inputs (x, m): Σ_i x_i * exp(m_i - m_R), m a ``max_last`` output
#   rescaled_sum_last  inputs (x, m): Σ_i Σ_lastdim x_i * exp(m_i - m_R)
ACCUM_FNS = ("sum", "sum_last", "sum_to", "mean_sq_last", "rms_last", "max_last", "rescaled_sum", "rescaled_sum_last")
DTYPES = ("float32", "float16", "bfloat16")
MAX_RANK = 4
MAX_GRID_DIMS = 3

_ALLOWED_ATTRS: dict[str, frozenset[str]] = {
    "input": frozenset({"name", "shape", "dtype", "strides"}),
    "matmul": frozenset({"trans_b"}),
    "unary": frozenset({"fn", "scalar"}),
    "binary": frozenset({"fn"}),
    "reduce": frozenset({"fn", "dim", "keepdim"}),
    "rms_norm": frozenset({"eps"}),
    "concat": frozenset({"dim"}),
    "customized": frozenset(),
    "sum_to": frozenset({"size"}),
    "accum": frozenset({"fn", "size"}),
}


class MuGraphError(ValueError):
    """A μGraph is malformed: the message names the operator, the dimension and why."""


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True)
class Op:
    """One operator: a kind, the ids of the tensors it reads, attributes, and for
    ``customized`` operators the block graph it runs."""

    kind: str
    inputs: tuple[int, ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()
    block: BlockGraph | None = None

    @staticmethod
    def make(kind: str, inputs: tuple[int, ...] | list[int] = (), block: BlockGraph | None = None, **attrs: Any) -> Op:
        """Build an operator; attributes are stored sorted so equal operators compare equal."""
        allowed = _ALLOWED_ATTRS.get(kind)
        if allowed is None:
            raise MuGraphError(f"unknown operator kind {kind!r}; known: {sorted(_ALLOWED_ATTRS)}")
        extra = set(attrs) - allowed
        if extra:
            raise MuGraphError(f"operator {kind!r} takes no attribute(s) {sorted(extra)}; allowed: {sorted(allowed)}")
        items = tuple(sorted((k, _freeze(v)) for k, v in attrs.items() if v is not None))
        return Op(kind, tuple(int(i) for i in inputs), items, block)

    @cached_property
    def a(self) -> dict[str, Any]:
        """The attributes as a dict (read-only by convention)."""
        return dict(self.attrs)

    def attr(self, name: str, default: Any = None) -> Any:
        return self.a.get(name, default)

    @property
    def num_outputs(self) -> int:
        if self.kind == "customized":
            return len(self.block.outputs) if self.block is not None else 0
        return 1

    def describe(self) -> str:
        """``kind(fn=...)`` for messages and listings."""
        parts = [f"{k}={v}" for k, v in self.attrs if k not in ("shape",)]
        return f"{self.kind}({', '.join(parts)})" if parts else self.kind


@dataclass(frozen=True)
class BlockInput:
    """A tile of kernel tensor ``source`` (index into the customized op's inputs).

    ``input_map[g]`` is the tensor dim split evenly over grid dim ``g`` (-1: the
    tensor is replicated along it); ``forloop_dim`` is split again into
    ``forloop_range`` chunks, chunk ``i`` loaded in iteration ``i`` (-1: the tile is
    loop-invariant and usable both inside and after the loop).
    """

    source: int
    input_map: tuple[int, ...]
    forloop_dim: int = -1


@dataclass(frozen=True)
class BlockOutput:
    """Writes block tensor ``tensor`` into a kernel tensor.

    ``output_map[g]`` is the tensor dim that grid dim ``g`` tiles (-1: none). A grid
    dim of size > 1 that no output dim takes produces partial results: the output
    tensor gets one leading dim per such grid dim (in grid order), to be combined
    by a later kernel (split-K, split-KV).
    """

    tensor: int
    output_map: tuple[int, ...]


@dataclass(frozen=True)
class BlockGraph:
    """One program instance per grid point, streaming inputs through a for-loop."""

    grid: tuple[int, ...]
    forloop_range: int
    inputs: tuple[BlockInput, ...]
    ops: tuple[Op, ...]
    outputs: tuple[BlockOutput, ...]

    @property
    def num_blocks(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n


@dataclass(frozen=True)
class KernelGraph:
    """A program of whole-kernel operators over device-memory tensors."""

    ops: tuple[Op, ...]
    outputs: tuple[int, ...] = field(default=())

    @cached_property
    def tensor_producers(self) -> tuple[tuple[int, int], ...]:
        """For each tensor id: (index of the producing op, output index of that op)."""
        out: list[tuple[int, int]] = []
        for i, op in enumerate(self.ops):
            for j in range(op.num_outputs):
                out.append((i, j))
        return tuple(out)

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_producers)

    @cached_property
    def input_ids(self) -> tuple[int, ...]:
        """Tensor ids of the ``input`` operators, in order."""
        return tuple(t for t, (i, _) in enumerate(self.tensor_producers) if self.ops[i].kind == "input")

    @cached_property
    def input_ops(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind == "input")

    @cached_property
    def info(self):
        """Shapes and dtypes of every tensor (validates the graph; raises MuGraphError)."""
        from mirage_serve.mugraph.shapes import infer_kernel

        return infer_kernel(self)

    def validate(self) -> KernelGraph:
        """Check the whole graph; returns it so calls can chain."""
        _ = self.info
        return self

    @property
    def customized_ops(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind == "customized")


class GraphBuilder:
    """Convenience builder for kernel graphs: each method appends an op and
    returns the id of its output tensor (or ids, for customized ops)."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._n = 0

    def _add(self, op: Op) -> int | tuple[int, ...]:
        self.ops.append(op)
        first = self._n
        self._n += op.num_outputs
        if op.kind == "customized":
            return tuple(range(first, self._n))
        return first

    def input(self, name: str, shape: tuple[int, ...] | list[int], dtype: str = "float32", strides: tuple[int, ...] | None = None) -> int:
        return self._add(Op.make("input", name=name, shape=tuple(shape), dtype=dtype, strides=strides))

    def matmul(self, a: int, b: int, trans_b: bool = False) -> int:
        return self._add(Op.make("matmul", (a, b), trans_b=trans_b or None))

    def unary(self, fn: str, x: int, scalar: float | None = None) -> int:
        return self._add(Op.make("unary", (x,), fn=fn, scalar=scalar))

    def binary(self, fn: str, a: int, b: int) -> int:
        return self._add(Op.make("binary", (a, b), fn=fn))

    def reduce(self, fn: str, x: int, dim: int, keepdim: bool = True) -> int:
        return self._add(Op.make("reduce", (x,), fn=fn, dim=dim, keepdim=keepdim))

    def rms_norm(self, x: int, w: int | None = None, eps: float = 0.0) -> int:
        return self._add(Op.make("rms_norm", (x,) if w is None else (x, w), eps=eps))

    def concat(self, xs: list[int], dim: int) -> int:
        return self._add(Op.make("concat", tuple(xs), dim=dim))

    def customized(self, inputs: list[int], block: BlockGraph) -> tuple[int, ...]:
        return self._add(Op.make("customized", tuple(inputs), block=block))

    def build(self, outputs: list[int] | tuple[int, ...]) -> KernelGraph:
        return KernelGraph(tuple(self.ops), tuple(outputs)).validate()


class BlockBuilder:
    """Builder for block graphs: inputs first, then tile ops and accumulators."""

    def __init__(self, grid: tuple[int, ...] | list[int], forloop_range: int = 1) -> None:
        self.grid = tuple(grid)
        self.forloop_range = forloop_range
        self.inputs: list[BlockInput] = []
        self.ops: list[Op] = []
        self.outputs: list[BlockOutput] = []

    def _next_id(self) -> int:
        return len(self.inputs) + len(self.ops)

    def input(self, source: int, input_map: tuple[int, ...] | list[int], forloop_dim: int = -1) -> int:
        if self.ops:
            raise MuGraphError("block inputs must be declared before any operator")
        self.inputs.append(BlockInput(source, tuple(input_map), forloop_dim))
        return len(self.inputs) - 1

    def op(self, kind: str, *inputs: int, **attrs: Any) -> int:
        tid = self._next_id()
        self.ops.append(Op.make(kind, inputs, **attrs))
        return tid

    def matmul(self, a: int, b: int, trans_b: bool = False) -> int:
        return self.op("matmul", a, b, trans_b=trans_b or None)

    def unary(self, fn: str, x: int, scalar: float | None = None) -> int:
        return self.op("unary", x, fn=fn, scalar=scalar)

    def binary(self, fn: str, a: int, b: int) -> int:
        return self.op("binary", a, b, fn=fn)

    def reduce(self, fn: str, x: int, dim: int, keepdim: bool = True) -> int:
        return self.op("reduce", x, fn=fn, dim=dim, keepdim=keepdim)

    def accum(self, fn: str, *xs: int, size: int | None = None) -> int:
        return self.op("accum", *xs, fn=fn, size=size)

    def output(self, tensor: int, output_map: tuple[int, ...] | list[int]) -> None:
        self.outputs.append(BlockOutput(tensor, tuple(output_map)))

    def build(self) -> BlockGraph:
        return BlockGraph(self.grid, self.forloop_range, tuple(self.inputs), tuple(self.ops), tuple(self.outputs))
