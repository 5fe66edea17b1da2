"""The analytical cost model that ranks candidates (no GPU needed).

The estimate of one kernel graph, in seconds, is the sum over its kernels of::

    launch_s + max(bytes / (bandwidth * util), flops / (peak_flops * util))

* **bytes** moved through device memory: every input tile a block loads (each
  block loads its own tiles, so a tensor replicated over ``b`` blocks is read
  ``b`` times; re-reads beyond the tensor's own size are charged at
  ``REREAD_WEIGHT`` because part of them hit L2), plus every output written. An
  intermediate tensor between two kernels is therefore paid twice: written by
  one, read back by the next.
* **flops** of matmuls (2·m·n·k per product; element-wise work is ignored).
* **util** = min(1, blocks / SMs): a kernel with fewer blocks than SMs leaves
  bandwidth idle because each block streams more than its share. Pre-defined
  operators are assumed to be library kernels that fill the GPU (util 1).

The codegen/tune packages may replace this ranking with GPU profiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirage_serve.mugraph.graph import BlockGraph, KernelGraph, Op
from mirage_serve.mugraph.shapes import TensorInfo, block_tile_infos
from mirage_serve.search.config import GpuTarget

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
REREAD_WEIGHT = 0.5


@dataclass(frozen=True)
class KernelCost:
    """The estimate of one kernel: what it moves and computes, and how long that takes."""

    kind: str
    blocks: int
    bytes_read: float
    bytes_written: float
    flops: float
    util: float
    seconds: float


@dataclass(frozen=True)
class GraphCost:
    """The estimate of a whole kernel graph (``seconds`` is what ranks candidates)."""

    seconds: float
    kernels: tuple[KernelCost, ...]

    @property
    def bytes_moved(self) -> float:
        return sum(k.bytes_read + k.bytes_written for k in self.kernels)

    def to_dict(self) -> dict:
        return {
            "seconds": self.seconds,
            "bytes_moved": self.bytes_moved,
            "kernels": [k.__dict__.copy() for k in self.kernels],
        }


def _nbytes(info: TensorInfo) -> int:
    return info.numel * DTYPE_BYTES.get(info.dtype, 4)


def _matmul_flops(out: TensorInfo, a: TensorInfo) -> float:
    return 2.0 * out.numel * a.shape[-1]


def _time(target: GpuTarget, nbytes: float, flops: float, util: float) -> float:
    util = max(util, 1e-6)
    return target.launch_s + max(nbytes / (target.dram_bandwidth * util), flops / (target.flops * util))


def block_smem_bytes(block: BlockGraph, arg_infos: list[TensorInfo]) -> int:
    """Upper bound of the shared memory one block needs: every tile it loads per
    iteration and every tile it computes, at the inputs' element size."""
    tiles = block_tile_infos(block, arg_infos)
    return sum(_nbytes(t) for t in tiles)


def customized_cost(op: Op, arg_infos: list[TensorInfo], out_infos: list[TensorInfo], target: GpuTarget) -> KernelCost:
    block = op.block
    tiles = block_tile_infos(block, arg_infos)
    blocks = block.num_blocks
    rng = block.forloop_range
    per_tensor: dict[int, float] = {}
    for j, bi in enumerate(block.inputs):
        loaded = _nbytes(tiles[j]) * (rng if bi.forloop_dim != -1 else 1) * blocks
        per_tensor[bi.source] = per_tensor.get(bi.source, 0.0) + loaded
    read = 0.0
    for src, loaded in per_tensor.items():
        size = _nbytes(arg_infos[src])
        read += min(loaded, size) + REREAD_WEIGHT * max(0.0, loaded - size)
    flops = 0.0
    n_in = len(block.inputs)
    for j, o in enumerate(block.ops):
        if o.kind == "matmul":
            info = tiles[n_in + j]
            per_iter = _matmul_flops(info, tiles[o.inputs[0]])
            flops += per_iter * (rng if info.phase == "loop" else 1) * blocks
    written = float(sum(_nbytes(i) for i in out_infos))
    util = min(1.0, blocks / target.num_sms)
    return KernelCost("customized", blocks, read, written, flops, util, _time(target, read + written, flops, util))


def graph_cost(graph: KernelGraph, target: GpuTarget | None = None) -> GraphCost:
    """Estimate the run time of ``graph`` on ``target`` (H100 by default)."""
    target = target or GpuTarget()
    info = graph.info
    kernels: list[KernelCost] = []
    first = 0
    for op in graph.ops:
        n_out = op.num_outputs
        if op.kind != "input":
            args = [info[t] for t in op.inputs]
            outs = list(info[first : first + n_out])
            if op.kind == "customized":
                kernels.append(customized_cost(op, args, outs, target))
            else:
                read = float(sum(_nbytes(a) for a in args))
                written = float(sum(_nbytes(o) for o in outs))
                flops = _matmul_flops(outs[0], args[0]) if op.kind == "matmul" else 0.0
                kernels.append(KernelCost(op.kind, target.num_sms, read, written, flops, 1.0, _time(target, read + written, flops, 1.0)))
        first += n_out
    return GraphCost(sum(k.seconds for k in kernels), tuple(kernels))
