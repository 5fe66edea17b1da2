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

**Variable extents.** ``variable_dims`` names (input position, dim) pairs whose
size may also be anything from 1 to the graph's (e.g. decode attention's KV
length): every tensor dim of the same dim class varies with it
(:func:`mirage_serve.codegen.analysis.extent_info`). The tensors' actual sizes
give the strides; ``lengths`` (a device int32 tensor, one entry per extent) may
in addition say that only a prefix of each is valid, so a captured CUDA graph
can serve a KV cache that grows in place. Callers declare only dims along which
the spec is uniform (positions of a set, like softmax over keys); codegen
excludes the other positions from every reduction exactly like padding.
"""

from __future__ import annotations

import dataclasses
import hashlib
import linecache
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mirage_serve.codegen.analysis import ExtentInfo, RowInfo, extent_info, row_info
from mirage_serve.codegen.params import CodegenError, CodegenParams
from mirage_serve.codegen.triton_gen import KernelSource, generate_fused_combine, generate_kernel, interpreter_fast_max
from mirage_serve.mugraph.graph import KernelGraph, MuGraphError
from mirage_serve.reference import TORCH_DTYPES, FloatAlgebra, apply_op

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Plan:
    rows: RowInfo
    storage: tuple[str, ...]  # storage dtype per kernel tensor
    kernels: tuple[KernelSource | None, ...]  # per kernel op (None: a torch op, or a combine fused into the kernel before)
    extents: ExtentInfo
    fused: tuple[tuple[int, int], ...] = ()  # (partials kernel op, its combine op) run as one launch


@dataclass(frozen=True)
class CombineFusion:
    """How a partials kernel and its combine become one launch (see ``CodegenParams.fused_combine``)."""

    first: int  # kernel op index of the partials kernel
    second: int  # kernel op index of the combine
    links: dict[int, int]  # combine grid dim -> partials grid dim with the same program index
    free: dict[int, int]  # the combine's other grid dims (> 1) -> size: the last program of a group loops over them
    sources: tuple[int, ...]  # per combine input: which output of the partials kernel it is
    groups: tuple[int, ...]  # partials grid dims (> 1) that some output maps: one counter per index along them
    partial_programs: int  # programs of one group (the product of the grid dims no output maps)


def fusable_combine(graph: KernelGraph) -> tuple[CombineFusion | None, str]:
    """Whether ``graph`` is a partials kernel followed by a combine kernel that can run as one launch.

    It can when the graph's only kernels are two customized operators; the second reads only the
    first's outputs, which nothing else reads; the first's grid dims are either partial (no output
    maps them) or mapped by every output; and every combine program reads the partials of exactly one
    group (one index along the mapped dims): each mapped dim is matched by a combine grid dim of the
    same size that every combine input maps to the same tensor dim, no combine grid dim splits a
    partial dim, and its other grid dims split only dims the first kernel does not split."""
    ops = graph.ops
    kernels = [i for i, op in enumerate(ops) if op.kind == "customized"]
    if len(kernels) != 2 or any(op.kind not in ("input", "customized") for op in ops):
        return None, "fused_combine needs a graph of exactly two customized kernels (partials, then their combine) and no other kernel ops"
    i1, i2 = kernels
    op1, op2 = ops[i1], ops[i2]
    start1 = graph.tensor_producers.index((i1, 0))
    outs1 = list(range(start1, start1 + op1.num_outputs))
    if any(t not in outs1 for t in op2.inputs):
        return None, "fused_combine: the second kernel reads tensors other than the first kernel's outputs"
    if any(t in graph.outputs for t in outs1) or any(t in outs1 for op in ops if op is not op2 for t in op.inputs):
        return None, "fused_combine: the first kernel's outputs are read by something other than the combine"
    if graph.tensor_producers.index((i2, 0)) != start1 + op1.num_outputs:
        return None, "fused_combine: the combine's outputs must follow the first kernel's in tensor order"
    b1, b2 = op1.block, op2.block
    partial = [g for g, n in enumerate(b1.grid) if n > 1 and all(bo.output_map[g] == -1 for bo in b1.outputs)]
    groups = [g for g, n in enumerate(b1.grid) if n > 1 and g not in partial]
    if not partial:
        return None, "fused_combine: the first kernel writes no partial results (every grid dim is mapped by an output)"
    if any(bo.output_map[g] == -1 for bo in b1.outputs for g in groups):
        return None, "fused_combine: a grid dim of the first kernel is mapped by some outputs and not others"
    n_p = len(partial)
    links: dict[int, int] = {}
    free: dict[int, int] = {}
    sources = []
    for bi in b2.inputs:
        o = op2.inputs[bi.source] - start1
        sources.append(o)
        dim_of = {n_p + b1.outputs[o].output_map[g]: g for g in groups}  # tensor dim -> the first kernel's grid dim splitting it
        for g2, n in enumerate(b2.grid):
            if n <= 1:
                continue
            d = bi.input_map[g2]
            if d == -1:
                continue
            if d < n_p:
                return None, "fused_combine: a combine grid dim splits the partial dims"
            g1 = dim_of.get(d)
            if g1 is None:
                if g2 in links:
                    return None, f"fused_combine: combine grid dim {g2} splits different dims in different inputs"
                free[g2] = n
            elif b1.grid[g1] != n or links.get(g2, g1) != g1 or g2 in free:
                return None, f"fused_combine: combine grid dim {g2} does not line up with the first kernel's grid dim {g1}"
            else:
                links[g2] = g1
        mapped = {bi.input_map[g2] for g2 in links if b2.grid[g2] > 1}
        if any(d not in mapped for d in dim_of):
            return None, "fused_combine: a combine program reads the partials of more than one group"
    if set(links.values()) != set(groups):
        return None, "fused_combine: some grid dim of the first kernel has no combine grid dim to match"
    # a combine grid dim counted free must also be free (or replicated) in every input
    for g2 in free:
        if g2 in links:
            return None, f"fused_combine: combine grid dim {g2} splits different dims in different inputs"
    return CombineFusion(i1, i2, links, free, tuple(sources), tuple(groups), math.prod(b1.grid[g] for g in partial)), ""


def _plan(graph: KernelGraph, params: CodegenParams, variable_dims: tuple[tuple[int, int], ...] = ()) -> _Plan:
    try:
        info = graph.info
    except MuGraphError as e:
        raise CodegenError(f"the graph is not valid: {e}") from e
    rows = row_info(graph)
    ext = extent_info(graph, tuple(variable_dims), rows)
    rdims = rows.dims if rows.variable else (None,) * len(info)
    storage = [i.dtype for i in info]
    for i, op in enumerate(graph.ops):
        if op.kind == "customized":
            start = graph.tensor_producers.index((i, 0))
            for j, bo in enumerate(op.block.outputs):
                if any(g > 1 and bo.output_map[gd] == -1 for gd, g in enumerate(op.block.grid)):
                    storage[start + j] = "float32"
    fusion = None
    if params.fused_combine:
        fusion, why = fusable_combine(graph)
        if fusion is None:
            raise CodegenError(why)
    kernels: list[KernelSource | None] = []
    graph_inputs = set(graph.input_ids)
    n_kernels = 0

    def gen_args(i: int, op, first: bool) -> dict:
        start = graph.tensor_producers.index((i, 0))
        outs = list(range(start, start + op.num_outputs))
        return dict(op=op, arg_infos=[info[t] for t in op.inputs], arg_storage=[storage[t] for t in op.inputs],
                    arg_rows=[rdims[t] for t in op.inputs], out_infos=[info[t] for t in outs], out_storage=[storage[t] for t in outs],
                    out_rows=[rdims[t] for t in outs], where=f"kernel op {i}", arg_ext=[ext.dims[t] for t in op.inputs],
                    out_ext=[ext.dims[t] for t in outs],
                    # graph inputs, in kernels after the first: written before the kernel before this one passed its wait
                    early_inputs=frozenset(p for p, t in enumerate(op.inputs) if t in graph_inputs) if not first else frozenset(),
                    plain_launch=first and params.pdl == 2)

    for i, op in enumerate(graph.ops):
        if op.kind != "customized" or (fusion is not None and i == fusion.second):
            kernels.append(None)
            continue
        name = f"mirage_kernel_{n_kernels}"
        if fusion is not None and i == fusion.first:
            j = fusion.second
            kernels.append(generate_fused_combine(name, gen_args(i, op, n_kernels == 0), gen_args(j, graph.ops[j], False), fusion.links,
                                                  fusion.free, list(fusion.sources), fusion.groups, fusion.partial_programs, params))
        else:
            a = gen_args(i, op, n_kernels == 0)
            where = a.pop("where")
            kernels.append(generate_kernel(name, a.pop("op"), params=params, where=where, **a))
        n_kernels += 1
    return _Plan(rows, tuple(storage), tuple(kernels), ext, ((fusion.first, fusion.second),) if fusion else ())


def supports(graph: KernelGraph, params: CodegenParams | None = None, variable_dims: tuple[tuple[int, int], ...] = ()) -> tuple[bool, str]:
    """Whether this generator can compile ``graph``; the reason when it cannot."""
    try:
        _plan(graph, params or CodegenParams(), variable_dims)
    except CodegenError as e:
        return False, str(e)
    return True, ""


def generate_source(graph: KernelGraph, params: CodegenParams | None = None, variable_dims: tuple[tuple[int, int], ...] = ()) -> list[str]:
    """Deterministic Triton source, one kernel per customized operator, in graph order."""
    plan = _plan(graph, params or CodegenParams(), variable_dims)
    return [k.text for k in plan.kernels if k is not None]


_INTERPRETER_PATCHED = False


def _interpreter_bf16_dot() -> None:
    """Make Triton's CPU interpreter multiply bfloat16 dot operands as numbers.

    It stores bfloat16 as raw uint16 bits and its ``create_dot`` multiplies those
    bits as integers; GPU code is unaffected. Operands are widened to float32
    first (bfloat16 values are exact in float32), as the tensor cores do."""
    global _INTERPRETER_PATCHED
    if _INTERPRETER_PATCHED:
        return
    import triton.language as tl
    from triton.runtime import interpreter as it

    builder = it.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    _INTERPRETER_PATCHED = True


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_has_descriptors() -> bool:
    """Whether Triton's CPU interpreter runs tensor-descriptor loads (``tma``; Triton >= 3.4 or so)."""
    try:
        from triton.runtime import interpreter as it
    except ImportError:  # pragma: no cover
        return False
    return hasattr(getattr(it, "InterpreterBuilder", None), "create_make_tensor_descriptor")


class _WorkspaceRing:
    """Triton's allocator for the global workspace of kernels that make tensor descriptors (``tma``):
    launches take per-device buffers in turn from a ring, kept for the process's lifetime. A buffer
    the caching allocator handed out and took back after the launch could be handed to the next
    kernel, whose programs may write their descriptors into it while this kernel still runs under
    programmatic dependent launch; the ring keeps the workspaces of eight consecutive launches
    apart, and stays valid in CUDA graphs captured with it."""

    SLOTS = 8

    def __init__(self) -> None:
        self.bufs: dict[tuple[int, int], torch.Tensor] = {}
        self.keep: list[torch.Tensor] = []  # outgrown buffers a captured graph may still use
        self.turn: dict[int, int] = {}

    def __call__(self, size: int, alignment: int, stream):
        dev = torch.cuda.current_device()
        slot = self.turn.get(dev, 0)
        self.turn[dev] = (slot + 1) % self.SLOTS
        buf = self.bufs.get((dev, slot))
        if buf is None or buf.numel() < size + alignment:
            if buf is not None:
                self.keep.append(buf)
            buf = self.bufs[(dev, slot)] = torch.empty(max(size + alignment, 1 << 16), dtype=torch.int8, device=f"cuda:{dev}")
        pad = -buf.data_ptr() % alignment
        return buf[pad:pad + size]


_WORKSPACE = _WorkspaceRing()


def ensure_workspace_allocator() -> None:
    """Install :class:`_WorkspaceRing` as Triton's allocator unless one is set (in this context)."""
    import triton

    try:
        from triton.runtime import _allocation

        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # pragma: no cover - another Triton layout: set ours
        pass
    triton.set_allocator(_WORKSPACE)


def load_kernel(source: KernelSource):
    """Turn generated source into a ``triton.jit`` function (source kept in linecache, no file)."""
    import os

    import triton
    import triton.language as tl

    text = source.text
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        _interpreter_bf16_dot()
        interpreter_fast_max()
        # the interpreter runs launches one after the other and has no programmatic dependent launch:
        # its waits and triggers are no-ops there (same lines, so tracebacks still point at the source)
        text = text.replace("tl.extra.cuda.gdc_wait()", "pass").replace("tl.extra.cuda.gdc_launch_dependents()", "pass")

    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    filename = f"<mirage_serve-codegen-{source.name}-{digest}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    scope = {"triton": triton, "tl": tl}
    exec(compile(text, filename, "exec"), scope)  # our own generated source, never read from a file
    return scope[source.name]


def compile_for_target(source: KernelSource, arch: int = 90, warp_size: int = 32, params: CodegenParams | None = None) -> str:
    """PTX for a CUDA target of one generated kernel, compiled without a GPU."""
    from mirage_serve.codegen.aot import compile_to_ptx

    p = params or CodegenParams()
    return compile_to_ptx([source], arch, warp_size, p.num_warps, p.num_stages, launch_pdl=source.pdl)[0]


def _torch_op(op, ins: list[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    if op.kind == "matmul":
        dt = torch.promote_types(ins[0].dtype, ins[1].dtype)
        b = ins[1].to(dt)
        y = ins[0].to(dt) @ (b.transpose(-1, -2) if op.attr("trans_b") else b)
        return y.to(out_dtype)
    return apply_op(FloatAlgebra(torch.float32), op, [x.float() for x in ins]).to(out_dtype).contiguous()


class CompiledGraph:
    """A kernel graph compiled for one bucket: ``CompiledGraph(*tensors) -> list[Tensor]``."""

    def __init__(self, graph: KernelGraph, params: CodegenParams | None = None, variable_dims: tuple[tuple[int, int], ...] = ()) -> None:
        self.graph = graph
        self.params = params or CodegenParams()
        self.variable_dims = tuple(tuple(x) for x in variable_dims)
        gen_params = self.params
        if gen_params.tma and _interpreting() and not interpreter_has_descriptors():
            gen_params = dataclasses.replace(gen_params, tma=0)  # this interpreter has no descriptor loads: ordinary ones
        self._plan = _plan(graph, gen_params, self.variable_dims)
        self.sources: list[str] = [k.text for k in self._plan.kernels if k is not None]
        self.kernel_sources: list[KernelSource] = [k for k in self._plan.kernels if k is not None]
        self._fns: dict[int, object] = {}
        self._len_tensors: dict[tuple, torch.Tensor] = {}
        self._launched: dict[int, object] = {}  # kernel op -> Triton's compiled kernel, after its first launch
        self._counters: dict[str, torch.Tensor] = {}  # device -> the group counters of a fused combine (zero between launches)
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

    @property
    def extent_buckets(self) -> tuple[int, ...]:
        """Largest size of each variable extent (its size in the graph)."""
        return self._plan.extents.bucket

    def shapes_for(self, n_rows: int, extents: Sequence[int] | None = None) -> list[tuple[int, ...]]:
        """Shape of every kernel tensor when the graph runs ``n_rows`` rows (and these extent sizes)."""
        rows = self._plan.rows
        ext = self._plan.extents
        out = []
        for t, i in enumerate(self.graph.info):
            s = list(i.shape)
            d = rows.dims[t] if rows.variable else None
            if d is not None:
                s[d] = n_rows
            if extents is not None:
                for dd, e in ext.dims[t].items():
                    s[dd] = extents[e]
            out.append(tuple(s))
        return out

    def output_shapes_for(self, n_rows: int, extents: Sequence[int] | None = None) -> list[tuple[int, ...]]:
        shapes = self.shapes_for(n_rows, extents)
        return [shapes[t] for t in self.graph.outputs]

    def extents_of(self, tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """The size of each variable extent in these inputs (the first input that has it)."""
        ext = self._plan.extents
        sizes: list[int | None] = [None] * len(ext.bucket)
        for x, t in zip(tensors, self.graph.input_ids, strict=False):
            for d, e in ext.dims[t].items():
                if sizes[e] is None and d < x.dim():
                    sizes[e] = int(x.shape[d])
        out = tuple(b if s is None else s for s, b in zip(sizes, ext.bucket, strict=True))
        for e, (n, b) in enumerate(zip(out, ext.bucket, strict=True)):
            if not 1 <= n <= b:
                raise CodegenError(f"variable extent {e} is {n}; this kernel serves 1..{b}")
        return out

    def n_rows_of(self, tensors: Sequence[torch.Tensor]) -> int:
        """Check shapes and dtypes; return the row count (the bucket unless variable)."""
        if len(tensors) != len(self.input_shapes):
            raise CodegenError(f"the compiled graph takes {len(self.input_shapes)} tensors, got {len(tensors)}")
        n = self.bucket
        if self.variable_batch and self.row_inputs:
            n = int(tensors[self.row_inputs[0]].shape[0])
            if not 1 <= n <= self.bucket:
                raise CodegenError(f"input {self.row_inputs[0]} has {n} rows; this kernel serves 1..{self.bucket} rows (the bucket)")
        extents = self.extents_of(tensors) if self._plan.extents.bucket else None
        want = self.shapes_for(n, extents)
        for pos, (x, t) in enumerate(zip(tensors, self.graph.input_ids, strict=True)):
            if tuple(x.shape) != want[t]:
                what = f"rows 1..{self.bucket} in dim 0, " if pos in self.row_inputs else ""
                if self._plan.extents.dims[t]:
                    what += f"dims {sorted(self._plan.extents.dims[t])} variable and equal across inputs, "
                raise CodegenError(f"input {pos} has shape {list(x.shape)}, expected {list(want[t])} ({what}other dims exact)")
            if x.dtype != TORCH_DTYPES[self.input_dtypes[pos]]:
                raise CodegenError(f"input {pos} has dtype {x.dtype}, expected {self.input_dtypes[pos]}; cast it first")
        return n

    def _kernel(self, i: int, src: KernelSource):
        fn = self._fns.get(i)
        if fn is None:
            fn = self._fns[i] = load_kernel(src)
        return fn

    def kernel_stats(self) -> list[dict]:
        """Registers, spilled bytes and shared memory of each kernel launched so far (GPU only)."""
        def num(k, name):
            v = getattr(k, name, None)
            return v if isinstance(v, int) else None

        return [{"kernel": self._plan.kernels[i].name, "registers": num(k, "n_regs"), "spills": num(k, "n_spills"),
                 "shared_bytes": num(getattr(k, "metadata", None), "shared")} for i, k in sorted(self._launched.items())]

    def _counter(self, device: torch.device, n: int) -> torch.Tensor:
        """The fused combine's group counters on ``device``: zeroed once, reset by the kernel after each use."""
        c = self._counters.get(str(device))
        if c is None or c.numel() < n:
            c = self._counters[str(device)] = torch.zeros(max(n, 1), dtype=torch.int32, device=device)
        return c

    def _lengths_for(self, sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A device int32 tensor of the extent sizes (all positions valid), kept per size."""
        key = (sizes, str(device))
        x = self._len_tensors.get(key)
        if x is None:
            if len(self._len_tensors) >= 256:
                self._len_tensors.clear()
            x = self._len_tensors[key] = torch.tensor(sizes, dtype=torch.int32, device=device)
        return x

    def __call__(self, *tensors: torch.Tensor, lengths: torch.Tensor | None = None, poison: bool = False) -> list[torch.Tensor]:
        """Run the graph. ``lengths``: int32 tensor on the inputs' device, the valid length of each
        variable extent (default: the inputs' sizes); entries above a size are clamped to it.
        ``poison``: fill every kernel output with NaN before the launch (checks that all is written)."""
        n = self.n_rows_of(tensors)
        ext = self._plan.extents
        sizes = self.extents_of(tensors) if ext.bucket else ()
        shapes = self.shapes_for(n, sizes if ext.bucket else None)
        storage = self._plan.storage
        device = tensors[0].device if tensors else torch.device("cpu")
        if ext.bucket:
            if lengths is None:
                lengths = self._lengths_for(sizes, device)
            elif lengths.dtype != torch.int32 or lengths.numel() != len(sizes) or lengths.device != device:
                raise CodegenError(f"lengths must be an int32 tensor of {len(sizes)} element(s) on {device}")
        elif lengths is not None:
            raise CodegenError("this graph has no variable extents; compile it with variable_dims to pass lengths")
        launch = {"num_warps": self.params.num_warps, "num_stages": self.params.num_stages}
        vals: list[torch.Tensor] = []
        n_in = 0
        fused_into = {b: a for a, b in self._plan.fused}
        pending: list[torch.Tensor] = []  # outputs of a combine fused into the kernel before, allocated for its launch
        for i, op in enumerate(self.graph.ops):
            if op.kind == "input":
                x = tensors[n_in]
                vals.append(x if x.is_contiguous() else x.contiguous())
                n_in += 1
            elif op.kind == "customized" and i in fused_into:
                vals.extend(pending)
                pending = []
            elif op.kind == "customized":
                src = self._plan.kernels[i]
                start = len(vals)
                make = (lambda shape, dt: torch.full(shape, float("nan"), dtype=dt, device=device)) if poison else (
                    lambda shape, dt: torch.empty(shape, dtype=dt, device=device))
                outs = [make(shapes[start + j], TORCH_DTYPES[storage[start + j]]) for j in range(op.num_outputs)]
                extra: list[torch.Tensor] = []
                if src.combine_outputs:
                    nxt = start + op.num_outputs  # the combine's outputs follow these in tensor order
                    pending = [make(shapes[nxt + j], TORCH_DTYPES[storage[nxt + j]]) for j in range(src.combine_outputs)]
                    extra = [*pending, self._counter(device, src.counters)]
                grid = tuple(
                    -(-n // rp) if rp and self.variable_batch else g for g, rp in zip(src.grid, src.rows_per_program, strict=True)
                )
                ins = [vals[t] for t in op.inputs]
                if src.tma and device.type == "cuda":
                    ensure_workspace_allocator()
                    # a descriptor's base must be 16-byte aligned (a contiguous view may start anywhere)
                    ins = [x.clone() if x.data_ptr() % 16 else x for x in ins]
                args = ins + outs + extra
                if src.uses_n_rows:
                    args.append(n)
                for e in src.extents:
                    args += [sizes[e], lengths[e:e + 1] if len(sizes) > 1 else lengths]
                launched = self._kernel(i, src)[grid](*args, **launch, **({"launch_pdl": True} if src.pdl else {}))
                if i not in self._launched:
                    self._launched[i] = launched
                vals.extend(outs)
            else:
                t = len(vals)
                vals.append(_torch_op(op, [vals[x] for x in op.inputs], TORCH_DTYPES[storage[t]]))
        info = self.graph.info
        return [vals[t] if vals[t].dtype == TORCH_DTYPES[info[t].dtype] else vals[t].to(TORCH_DTYPES[info[t].dtype]) for t in self.graph.outputs]


def compile_graph(graph: KernelGraph, params: CodegenParams | None = None, variable_dims: tuple[tuple[int, int], ...] = ()) -> CompiledGraph:
    """Generate, load lazily and wrap every kernel of ``graph`` (raises CodegenError if unsupported).

    ``variable_dims``: (input position, dim) pairs whose size may vary up to the graph's at run time."""
    return CompiledGraph(graph, params, variable_dims)
