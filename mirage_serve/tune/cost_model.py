"""An analytical cost model that ranks μGraph candidates without a GPU.

Decode-time kernels are memory-bound, so the model is built around bytes:

* **Bytes.** Every kernel reads its inputs and writes its outputs. For a
  customized operator each block loads its own tiles, so a tensor that several
  blocks replicate (X in a GEMV, A in a fused LoRA) is *loaded* once per block:
  ``loaded_bytes`` counts every load. The first pass over each input tensor
  comes from HBM (``hbm_bytes``); the re-reads beyond it come from L2 when the
  tensor fits there and from HBM otherwise.
* **Bandwidth and parallelism.** HBM streams at ``hbm_bytes_per_s`` (about
  4.2 TB/s on an H200, read + write counted) only with enough bytes in flight:
  by Little's law an SM must keep ``inflight_bytes_per_sm`` of HBM reads
  outstanding (96 KB: of 32-160 KB, the value whose picks came closest to the
  measured best schedules of the whole kernel tables of 2026-12-06 on an H200
  and 2026-12-07 on an H100; ``benchmarks/cost_model_check.py``). A block keeps
  its HBM share of one iteration's tiles in flight, times the depth of its
  software pipeline when its loop has more than one iteration: ``num_stages -
  1`` tiles ahead of the one a tensor-core matmul reads from shared memory,
  ``num_stages`` for GEMV math, which waits on its tiles in registers. How many
  blocks an SM holds at once is bounded by the blocks per SM, the warps
  (``max_warps_per_sm``) and the shared memory the pipelined tiles take
  (``num_stages`` copies of an iteration's tiles against ``smem_bytes_per_sm``).
  The fraction of the 132 SMs that get work, how well each is fed, and a
  partial last wave (its blocks stream at their own, lower rate) scale the
  bandwidth. A grid of 4 blocks therefore reaches a few percent of HBM
  bandwidth; 128 blocks (one an SM) with 24 KB weight tiles reach a quarter of
  it at 2 stages and three quarters at 4.
* **Arithmetic.** Tile matmuls run as codegen runs them: with ``matmul="auto"``
  those with fewer than ``dot_min_rows`` (16) rows whose broadcast product fits
  the registers, or whose ``tl.dot`` tiles would not fit shared memory
  (``codegen.params.gemv_fits``), are GEMV (multiply +
  ``tl.sum``) on the CUDA cores and the rest use ``tl.dot`` on tensor cores, padded to 16 in every dim (a 1-row ``tl.dot``
  wastes 15/16 of the unit). A kernel takes ``max(memory time, arithmetic time)``.
  Its loop runs in the steps codegen splits it into (``k_chunks``, and
  ``matmul="auto"``'s split of GEMV math that would spill), so an
  iteration's tiles and the choice of GEMV or ``tl.dot`` are those of a step.
* **Launches.** Each kernel costs ``launch_s`` (3-5 µs without a CUDA graph;
  the default, 3 µs, is what a captured decode step pays per kernel boundary,
  the gap plus the tail of a partly idle grid).

The numbers are estimates meant for *ranking*; every result says
``profiled: false``. Profiling on the target GPU (:mod:`mirage_serve.tune.profile`)
decides whenever one is available.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from mirage_serve.codegen.params import CodegenError, CodegenParams, dot_operand_bytes, gemv_fits
from mirage_serve.codegen.triton_gen import loop_split
from mirage_serve.mugraph.graph import KernelGraph, Op
from mirage_serve.mugraph.shapes import TensorInfo, block_tile_infos

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class GPUModel:
    """The few device numbers the model needs (defaults: one NVIDIA H200)."""

    name: str = "H200"
    sms: int = 132
    hbm_bytes_per_s: float = 4.2e12
    l2_bytes_per_s: float = 10e12
    l2_bytes: int = 50 * 2**20
    launch_s: float = 3e-6
    inflight_bytes_per_sm: int = 96 * 1024
    smem_bytes_per_sm: int = 228 * 1024
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    dot_flops_per_s: float = 650e12  # bf16/fp16 tensor cores, measured ~690 on 8192^3
    dot_flops_per_s_fp32: float = 320e12  # tf32
    cuda_core_flops_per_s: float = 60e12  # fp32 FMA, GEMV-style math
    dot_min_rows: int = 16  # codegen's default for matmul='auto'


H200 = GPUModel()
H100 = GPUModel(name="H100", hbm_bytes_per_s=3.0e12, l2_bytes=50 * 2**20)
GPU_MODELS = {"H200": H200, "H100": H100}


@dataclass
class KernelCost:
    """The model's view of one kernel launch."""

    kind: str
    blocks: int
    loaded_bytes: int  # every tile load of every block
    hbm_read_bytes: int  # reads served by HBM
    l2_read_bytes: int  # re-reads served by L2
    written_bytes: int
    flops: int
    matmul_mode: str  # "dot", "gemv", "library" or "none"
    bandwidth_fraction: float
    memory_s: float
    compute_s: float
    time_s: float


@dataclass
class CostEstimate:
    """Estimated time of a whole kernel graph and the parts it came from."""

    time_s: float
    launches: int
    hbm_bytes: int  # read from and written to HBM
    loaded_bytes: int
    written_bytes: int
    flops: int
    kernels: list[KernelCost] = field(default_factory=list)
    profiled: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["time_us"] = self.time_s * 1e6
        return d


def _nbytes(info: TensorInfo) -> int:
    return info.numel * DTYPE_BYTES[info.dtype]


def _param(params: Any, name: str, default: Any) -> Any:
    if params is None:
        return default
    if isinstance(params, dict):
        return params.get(name, default)
    return getattr(params, name, default)


def _codegen_params(params: Any) -> CodegenParams:
    """``params`` (a ``CodegenParams``, a dict of its fields or None) as ``CodegenParams``; fields it
    does not know are left out, ``matmul="gemv"`` is ``"fma"``, and values codegen refuses give the
    defaults."""
    if isinstance(params, CodegenParams):
        return params
    if not isinstance(params, dict):
        return CodegenParams()
    d = {k: v for k, v in params.items() if k in CodegenParams.__dataclass_fields__}
    if d.get("matmul") == "gemv":
        d["matmul"] = "fma"
    try:
        return CodegenParams(**d)
    except (CodegenError, TypeError):
        return CodegenParams()


def _matmul_flops(a: tuple[int, ...], b: tuple[int, ...], trans_b: bool) -> tuple[int, int, int, int]:
    """(flops, rows m, cols n, inner k) of a (batched) matmul of shapes a and b."""
    m, k = a[-2], a[-1]
    n = b[-2] if trans_b else b[-1]
    batch = math.prod(a[:-2]) if len(a) > 2 else 1
    return 2 * batch * m * n * k, batch * m, n, k


def _bandwidth_fraction(gpu: GPUModel, blocks: int, warps: int, hbm_bytes_in_flight: int, smem_bytes: int) -> float:
    """Fraction of HBM bandwidth a grid of ``blocks`` blocks can draw, each keeping
    ``hbm_bytes_in_flight`` of HBM reads outstanding and taking ``smem_bytes`` of shared memory."""
    warps = max(1, warps)
    fit = min(gpu.max_blocks_per_sm, max(1, gpu.max_warps_per_sm // warps), max(1, gpu.smem_bytes_per_sm // max(1, smem_bytes)))
    per_sm = max(1, min(math.ceil(blocks / gpu.sms), fit))

    def drawn(n: int) -> float:  # one wave of n blocks, spread over the SMs
        k = math.ceil(n / gpu.sms)
        return min(1.0, k * hbm_bytes_in_flight / gpu.inflight_bytes_per_sm) * min(n, gpu.sms) / gpu.sms

    # blocks move equal bytes: full waves stream at one rate, a partial last wave at its own
    full, last = divmod(blocks, gpu.sms * per_sm)
    spent = full * gpu.sms * per_sm / drawn(gpu.sms * per_sm) + (last / drawn(last) if last else 0.0)
    return max(1e-3, blocks / spent)


def _customized_cost(op: Op, ins: list[TensorInfo], outs: list[TensorInfo], gpu: GPUModel, params: Any) -> KernelCost:
    block = op.block
    assert block is not None
    split = loop_split(op, ins, outs, _codegen_params(params))
    if split > 1:  # each iteration runs in smaller steps (k_chunks, or matmul="auto" keeping GEMV math in registers)
        block = replace(block, forloop_range=block.forloop_range * split)
    tiles = block_tile_infos(block, ins)
    nb, rng = block.num_blocks, block.forloop_range
    loaded = 0
    hbm = 0
    l2 = 0
    tile_iter = 0
    seen: dict[int, int] = {}
    for j, bi in enumerate(block.inputs):
        per_block = _nbytes(tiles[j]) * (rng if bi.forloop_dim != -1 else 1)
        tile_iter += _nbytes(tiles[j])
        total = per_block * nb
        loaded += total
        tensor_bytes = _nbytes(ins[bi.source])
        first = min(total, tensor_bytes - seen.get(bi.source, 0))
        seen[bi.source] = seen.get(bi.source, 0) + first
        again = total - first
        hbm += first
        if tensor_bytes <= gpu.l2_bytes:
            l2 += again
        else:
            hbm += again
    written = sum(_nbytes(o) for o in outs)
    flops = 0
    mode = "none"
    compute_s = 0.0
    n_in = len(block.inputs)
    low = any(ins[bi.source].dtype in ("bfloat16", "float16") for bi in block.inputs)
    prec = _param(params, "dot_precision", "auto")
    # codegen's exact 16-bit operands: 16-bit inputs that only tile matmuls read
    exact16 = {j for j, bi in enumerate(block.inputs) if ins[bi.source].dtype in ("bfloat16", "float16")
               and all(bop.kind == "matmul" for bop in block.ops if j in bop.inputs)}
    for i, bop in enumerate(block.ops):
        if bop.kind != "matmul":
            continue
        a, b = tiles[bop.inputs[0]], tiles[bop.inputs[1]]
        f, m, n, k = _matmul_flops(a.shape, b.shape, bool(bop.attr("trans_b")))
        times = rng if tiles[n_in + i].phase == "loop" else 1
        f *= times * nb
        flops += f
        # codegen's CodegenParams.matmul: "dot", "fma" (GEMV), or "auto" = tl.dot from dot_min_rows rows
        forced = _param(params, "matmul", "auto")
        if forced in ("dot", "fma", "gemv"):
            use_dot = forced == "dot"
        else:
            use_dot = m >= int(_param(params, "dot_min_rows", gpu.dot_min_rows)) or not gemv_fits(
                m, n, k, int(_param(params, "num_warps", 4)), dot_operand_bytes(prec, low, set(bop.inputs) <= exact16))
        if use_dot:
            mode = "dot"
            pad = (max(16, m) * max(16, n) * max(16, k)) / (m * n * k)
            rate = gpu.dot_flops_per_s if a.dtype != "float32" else gpu.dot_flops_per_s_fp32
            compute_s += f * pad / rate
        else:
            mode = "gemv" if mode == "none" else mode
            compute_s += f / gpu.cuda_core_flops_per_s
    stages = int(_param(params, "num_stages", 2))
    # a pipelined loop keeps num_stages - 1 tiles in flight ahead of the one its MMA reads from shared
    # memory; GEMV math reads its tiles from registers, so the tile being waited for is in flight too
    depth = (max(1, stages - 1) if mode == "dot" else stages) if rng > 1 else 1
    hbm_iter = tile_iter * hbm / loaded if loaded else 0
    frac = _bandwidth_fraction(gpu, nb, int(_param(params, "num_warps", 4)), int(hbm_iter * depth), tile_iter * (stages if rng > 1 else 1))
    memory_s = (hbm + written) / (gpu.hbm_bytes_per_s * frac) + l2 / (gpu.l2_bytes_per_s * frac)
    # one SM's arithmetic share also shrinks when few SMs have blocks
    compute_s /= min(1.0, nb / gpu.sms)
    return KernelCost(
        "customized", nb, loaded, hbm, l2, written, flops, mode, frac, memory_s, compute_s, gpu.launch_s + max(memory_s, compute_s)
    )


def _predefined_cost(op: Op, ins: list[TensorInfo], out: TensorInfo, gpu: GPUModel) -> KernelCost:
    """A library kernel (cuBLAS, a torch element-wise op): reads each input once, well parallelised."""
    read = sum(_nbytes(t) for t in ins)
    written = _nbytes(out)
    flops = 0
    compute_s = 0.0
    mode = "none"
    if op.kind == "matmul":
        f, m, n, k = _matmul_flops(ins[0].shape, ins[1].shape, bool(op.attr("trans_b")))
        flops = f
        mode = "library"
        compute_s = f / gpu.dot_flops_per_s
    else:
        flops = out.numel
        compute_s = flops / gpu.cuda_core_flops_per_s
    memory_s = (read + written) / gpu.hbm_bytes_per_s
    return KernelCost(op.kind, gpu.sms, read, read, 0, written, flops, mode, 1.0, memory_s, compute_s, gpu.launch_s + max(memory_s, compute_s))


def estimate(graph: KernelGraph, params: Any = None, gpu: GPUModel = H200) -> CostEstimate:
    """Estimate the run time of ``graph`` compiled with ``params`` on ``gpu``.

    ``params`` may be a ``CodegenParams``, a dict or None; the model reads
    ``num_warps`` (default 4), ``num_stages`` (default 2), ``matmul`` ("auto" / "dot" / "fma"),
    ``dot_min_rows``, ``dot_precision`` and ``k_chunks``."""
    info = graph.info
    kernels: list[KernelCost] = []
    t = 0
    for op in graph.ops:
        n_out = op.num_outputs
        ins = [info[i] for i in op.inputs]
        outs = list(info[t : t + n_out])
        t += n_out
        if op.kind == "input":
            continue
        if op.kind == "customized":
            kernels.append(_customized_cost(op, ins, outs, gpu, params))
        else:
            kernels.append(_predefined_cost(op, ins, outs[0], gpu))
    return CostEstimate(
        time_s=sum(k.time_s for k in kernels),
        launches=len(kernels),
        hbm_bytes=sum(k.hbm_read_bytes + k.written_bytes for k in kernels),
        loaded_bytes=sum(k.loaded_bytes for k in kernels),
        written_bytes=sum(k.written_bytes for k in kernels),
        flops=sum(k.flops for k in kernels),
        kernels=kernels,
    )


def floor_bytes(graph: KernelGraph) -> int:
    """The fewest bytes any implementation must move: every graph input read once, every output written once."""
    info = graph.info
    return sum(_nbytes(info[i]) for i in graph.input_ids) + sum(_nbytes(info[o]) for o in graph.outputs)
