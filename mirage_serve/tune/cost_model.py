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
  by Little's law an SM must keep ``inflight_bytes_per_sm`` (~32 KB) outstanding.
  A block keeps at most ``bytes_per_thread_inflight`` per thread (or its whole
  per-iteration tile, if smaller) in flight, and at most ``max_warps_per_sm``
  warps fit on an SM; the fraction of the 132 SMs that get work, and how well
  each is fed, scales the bandwidth. A grid of 4 blocks therefore reaches a few
  percent of HBM bandwidth; a grid of 768 GEMV blocks reaches all of it.
* **Arithmetic.** Tile matmuls run as codegen runs them: with ``matmul="auto"``
  those with fewer than ``dot_min_rows`` (16) rows are GEMV (multiply +
  ``tl.sum``) on the CUDA cores and the rest use ``tl.dot`` on tensor cores, padded to 16 in every dim (a 1-row ``tl.dot``
  wastes 15/16 of the unit). A kernel takes ``max(memory time, arithmetic time)``.
* **Launches.** Each kernel costs ``launch_s`` (3-5 µs without a CUDA graph;
  the default, 3 µs, is what a captured decode step pays per kernel boundary,
  the gap plus the tail of a partly idle grid).

The numbers are estimates meant for *ranking*; every result says
``profiled: false``. Profiling on the target GPU (:mod:`mirage_serve.tune.profile`)
decides whenever one is available.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

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
    inflight_bytes_per_sm: int = 32 * 1024
    bytes_per_thread_inflight: int = 64
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


def _matmul_flops(a: tuple[int, ...], b: tuple[int, ...], trans_b: bool) -> tuple[int, int, int, int]:
    """(flops, rows m, cols n, inner k) of a (batched) matmul of shapes a and b."""
    m, k = a[-2], a[-1]
    n = b[-2] if trans_b else b[-1]
    batch = math.prod(a[:-2]) if len(a) > 2 else 1
    return 2 * batch * m * n * k, batch * m, n, k


def _bandwidth_fraction(gpu: GPUModel, blocks: int, warps: int, tile_bytes_per_iter: int) -> float:
    """Fraction of HBM bandwidth a grid of ``blocks`` blocks can draw."""
    warps = max(1, warps)
    per_sm = min(math.ceil(blocks / gpu.sms), gpu.max_blocks_per_sm, max(1, gpu.max_warps_per_sm // warps))
    busy_sms = min(blocks, gpu.sms)
    per_block = min(tile_bytes_per_iter, warps * 32 * gpu.bytes_per_thread_inflight)
    fed = min(1.0, per_sm * per_block / gpu.inflight_bytes_per_sm)
    # a grid that does not divide into whole waves leaves SMs idle in its last wave
    waves = math.ceil(blocks / (gpu.sms * per_sm))
    wave_eff = blocks / (waves * gpu.sms * per_sm)
    return max(1e-3, fed * busy_sms / gpu.sms * (wave_eff if waves > 1 else 1.0))


def _customized_cost(op: Op, ins: list[TensorInfo], outs: list[TensorInfo], gpu: GPUModel, params: Any) -> KernelCost:
    block = op.block
    assert block is not None
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
            use_dot = m >= int(_param(params, "dot_min_rows", gpu.dot_min_rows))
        if use_dot:
            mode = "dot"
            pad = (max(16, m) * max(16, n) * max(16, k)) / (m * n * k)
            rate = gpu.dot_flops_per_s if a.dtype != "float32" else gpu.dot_flops_per_s_fp32
            compute_s += f * pad / rate
        else:
            mode = "gemv" if mode == "none" else mode
            compute_s += f / gpu.cuda_core_flops_per_s
    frac = _bandwidth_fraction(gpu, nb, int(_param(params, "num_warps", 4)), tile_iter)
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
    ``num_warps`` (default 4), ``matmul`` ("auto" / "dot" / "fma") and ``dot_min_rows``."""
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
