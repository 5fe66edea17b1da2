"""Compile a whole kernel graph: generated Triton launches plus torch operators.

Customized operators run as generated Triton kernels; pre-defined kernel
operators (matmul, element-wise, reductions, rms_norm, concat) run as torch
ops. Storage: graph outputs and ordinary intermediates keep their declared
dtypes; partial outputs (a leading dim per unmapped grid dim) are float32, read
by the combining operator. torch ops compute in float32 (matmuls in their
operands' dtype, accumulating in fp32 as cuBLAS does) and round on store.

**Variable batch.** The graph's shapes are a bucket. If rows are independent
(:func:`mirage_serve.codegen.analysis.row_info`), dim 0 of every input in the
row class (``CompiledGraph.row_inputs``) may be any size from 1 to the bucket;
every other dim must match exactly. Kernels mask rows >= ``n_rows``.
"""

from __future__ import annotations

import hashlib
import linecache
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mirage_serve.codegen.analysis import RowInfo, row_info
from mirage_serve.codegen.params import CodegenError, CodegenParams
from mirage_serve.codegen.triton_gen import KernelSource, generate_kernel
from mirage_serve.mugraph.graph import KernelGraph, MuGraphError
from mirage_serve.reference import TORCH_DTYPES, FloatAlgebra, apply_op

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Plan:
    rows: RowInfo
    storage: tuple[str, ...]  # storage dtype per kernel tensor
    kernels: tuple[KernelSource | None, ...]  # per kernel op


def _plan(graph: KernelGraph, params: CodegenParams) -> _Plan:
    try:
        info = graph.info
    except MuGraphError as e:
        raise CodegenError(f"the graph is not valid: {e}") from e
    rows = row_info(graph)
    rdims = rows.dims if rows.variable else (None,) * len(info)
    storage = [i.dtype for i in info]
    for i, op in enumerate(graph.ops):
        if op.kind == "customized":
            start = graph.tensor_producers.index((i, 0))
            for j, bo in enumerate(op.block.outputs):
                if any(g > 1 and bo.output_map[gd] == -1 for gd, g in enumerate(op.block.grid)):
                    storage[start + j] = "float32"
    kernels: list[KernelSource | None] = []
    n_kernels = 0
    for i, op in enumerate(graph.ops):
        if op.kind != "customized":
            kernels.append(None)
            continue
        start = graph.tensor_producers.index((i, 0))
        outs = list(range(start, start + op.num_outputs))
        kernels.append(
            generate_kernel(
                f"mirage_kernel_{n_kernels}",
                op,
                [info[t] for t in op.inputs],
                [storage[t] for t in op.inputs],
                [rdims[t] for t in op.inputs],
                [info[t] for t in outs],
                [storage[t] for t in outs],
                [rdims[t] for t in outs],
                params,
                f"kernel op {i}",
            )
        )
        n_kernels += 1
    return _Plan(rows, tuple(storage), tuple(kernels))


def supports(graph: KernelGraph, params: CodegenParams | None = None) -> tuple[bool, str]:
    """Whether this generator can compile ``graph``; the reason when it cannot."""
    try:
        _plan(graph, params or CodegenParams())
    except CodegenError as e:
        return False, str(e)
    return True, ""


def generate_source(graph: KernelGraph, params: CodegenParams | None = None) -> list[str]:
    """Deterministic Triton source, one kernel per customized operator, in graph order."""
    plan = _plan(graph, params or CodegenParams())
    return [k.text for k in plan.kernels if k is not None]


def load_kernel(source: KernelSource):
    """Turn generated source into a ``triton.jit`` function (source kept in linecache, no file)."""
    import triton
    import triton.language as tl

    digest = hashlib.sha256(source.text.encode()).hexdigest()[:16]
    filename = f"<mirage_serve-codegen-{source.name}-{digest}>"
    linecache.cache[filename] = (len(source.text), None, source.text.splitlines(True), filename)
    scope = {"triton": triton, "tl": tl}
    exec(compile(source.text, filename, "exec"), scope)  # our own generated source, never read from a file
    return scope[source.name]


def compile_for_target(source: KernelSource, arch: int = 90, warp_size: int = 32, params: CodegenParams | None = None) -> str:
    """PTX for a CUDA target of one generated kernel, compiled without a GPU."""
    from mirage_serve.codegen.aot import compile_to_ptx

    p = params or CodegenParams()
    return compile_to_ptx([source], arch, warp_size, p.num_warps, p.num_stages)[0]


def _torch_op(op, ins: list[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    if op.kind == "matmul":
        dt = torch.promote_types(ins[0].dtype, ins[1].dtype)
        b = ins[1].to(dt)
        y = ins[0].to(dt) @ (b.transpose(-1, -2) if op.attr("trans_b") else b)
        return y.to(out_dtype)
    return apply_op(FloatAlgebra(torch.float32), op, [x.float() for x in ins]).to(out_dtype).contiguous()


class CompiledGraph:
    """A kernel graph compiled for one bucket: ``CompiledGraph(*tensors) -> list[Tensor]``."""

    def __init__(self, graph: KernelGraph, params: CodegenParams | None = None) -> None:
        self.graph = graph
        self.params = params or CodegenParams()
        self._plan = _plan(graph, self.params)
        self.sources: list[str] = [k.text for k in self._plan.kernels if k is not None]
        self.kernel_sources: list[KernelSource] = [k for k in self._plan.kernels if k is not None]
        self._fns: dict[int, object] = {}
        info = graph.info
        self.input_shapes = tuple(info[t].shape for t in graph.input_ids)
        self.input_dtypes = tuple(info[t].dtype for t in graph.input_ids)
        self.output_shapes = tuple(info[t].shape for t in graph.outputs)
        self.output_dtypes = tuple(info[t].dtype for t in graph.outputs)

    @property
    def rows(self) -> RowInfo:
        return self._plan.rows

    @property
    def variable_batch(self) -> bool:
        return self._plan.rows.variable

    @property
    def row_inputs(self) -> tuple[int, ...]:
        """Positions of inputs whose dim 0 may be smaller than the bucket."""
        return self._plan.rows.row_inputs

    @property
    def bucket(self) -> int:
        return self._plan.rows.bucket

    def shapes_for(self, n_rows: int) -> list[tuple[int, ...]]:
        """Shape of every kernel tensor when the graph runs ``n_rows`` rows."""
        rows = self._plan.rows
        out = []
        for t, i in enumerate(self.graph.info):
            s = list(i.shape)
            d = rows.dims[t] if rows.variable else None
            if d is not None:
                s[d] = n_rows
            out.append(tuple(s))
        return out

    def output_shapes_for(self, n_rows: int) -> list[tuple[int, ...]]:
        shapes = self.shapes_for(n_rows)
        return [shapes[t] for t in self.graph.outputs]

    def n_rows_of(self, tensors: Sequence[torch.Tensor]) -> int:
        """Check shapes and dtypes; return the row count (the bucket unless variable)."""
        if len(tensors) != len(self.input_shapes):
            raise CodegenError(f"the compiled graph takes {len(self.input_shapes)} tensors, got {len(tensors)}")
        n = self.bucket
        if self.variable_batch and self.row_inputs:
            n = int(tensors[self.row_inputs[0]].shape[0])
            if not 1 <= n <= self.bucket:
                raise CodegenError(f"input {self.row_inputs[0]} has {n} rows; this kernel serves 1..{self.bucket} rows (the bucket)")
        want = self.shapes_for(n)
        for pos, (x, t) in enumerate(zip(tensors, self.graph.input_ids, strict=True)):
            if tuple(x.shape) != want[t]:
                what = f"rows 1..{self.bucket} in dim 0, " if pos in self.row_inputs else ""
                raise CodegenError(f"input {pos} has shape {list(x.shape)}, expected {list(want[t])} ({what}other dims exact)")
            if x.dtype != TORCH_DTYPES[self.input_dtypes[pos]]:
                raise CodegenError(f"input {pos} has dtype {x.dtype}, expected {self.input_dtypes[pos]}; cast it first")
        return n

    def _kernel(self, i: int, src: KernelSource):
        fn = self._fns.get(i)
        if fn is None:
            fn = self._fns[i] = load_kernel(src)
        return fn

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        n = self.n_rows_of(tensors)
        shapes = self.shapes_for(n)
        storage = self._plan.storage
        device = tensors[0].device if tensors else torch.device("cpu")
        vals: list[torch.Tensor] = []
        n_in = 0
        for i, op in enumerate(self.graph.ops):
            if op.kind == "input":
                x = tensors[n_in]
                vals.append(x if x.is_contiguous() else x.contiguous())
                n_in += 1
            elif op.kind == "customized":
                src = self._plan.kernels[i]
                start = len(vals)
                outs = [
                    torch.empty(shapes[start + j], dtype=TORCH_DTYPES[storage[start + j]], device=device) for j in range(op.num_outputs)
                ]
                grid = tuple(
                    -(-n // rp) if rp and self.variable_batch else g for g, rp in zip(src.grid, src.rows_per_program, strict=True)
                )
                args = [vals[t] for t in op.inputs] + outs
                if src.uses_n_rows:
                    args.append(n)
                self._kernel(i, src)[grid](*args, num_warps=self.params.num_warps, num_stages=self.params.num_stages)
                vals.extend(outs)
            else:
                t = len(vals)
                vals.append(_torch_op(op, [vals[x] for x in op.inputs], TORCH_DTYPES[storage[t]]))
        info = self.graph.info
        return [vals[t] if vals[t].dtype == TORCH_DTYPES[info[t].dtype] else vals[t].to(TORCH_DTYPES[info[t].dtype]) for t in self.graph.outputs]


def compile_graph(graph: KernelGraph, params: CodegenParams | None = None) -> CompiledGraph:
    """Generate, load lazily and wrap every kernel of ``graph`` (raises CodegenError if unsupported)."""
    return CompiledGraph(graph, params)
