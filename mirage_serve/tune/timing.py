"""GPU timing that every contender shares: warm-up, CUDA-graph replay, events, medians.

Each measurement rotates through several independent argument sets (so weights
and KV caches are not served from L2 on repeat) and reports the median time of
one call: the median over ``reps`` timed replays, divided by the number of sets.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class Timing:
    """Per-call times in microseconds."""

    median_us: float
    p20_us: float
    p80_us: float
    reps: int
    sets: int
    cuda_graph: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sets_for(bytes_per_set: int, l2_bytes: int = 60 * 2**20, min_sets: int = 2, max_sets: int = 64) -> int:
    """How many argument sets to rotate so that one pass over them is >= 3x the L2."""
    return max(min_sets, min(max_sets, math.ceil(3 * l2_bytes / max(1, bytes_per_set))))


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def time_calls(
    fn: Callable[..., Any],
    arg_sets: Sequence[Sequence[Any]],
    *,
    cuda_graph: bool = True,
    warmup: int = 5,
    reps: int = 50,
) -> Timing:
    """Time ``fn(*args)`` for each args in ``arg_sets``, back to back.

    With ``cuda_graph`` the whole rotation is captured once into a CUDA graph
    and replayed ``reps`` times; otherwise the rotation is issued eagerly.
    Either way device events bracket each rotation."""
    n = len(arg_sets)
    if n == 0:
        raise ValueError("time_calls needs at least one argument set")
    for _ in range(2):  # compile, autotune, allocate outside the timed region
        for args in arg_sets:
            fn(*args)
    torch.cuda.synchronize()
    if cuda_graph:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for args in arg_sets:  # warm the side stream too, as capture requires
                fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for args in arg_sets:
                fn(*args)

        def step() -> None:
            graph.replay()
    else:

        def step() -> None:
            for args in arg_sets:
                fn(*args)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        step()
        ends[i].record()
    torch.cuda.synchronize()
    per_call = [s.elapsed_time(e) * 1e3 / n for s, e in zip(starts, ends)]
    if cuda_graph:
        del graph
    return Timing(statistics.median(per_call), _percentile(per_call, 0.2), _percentile(per_call, 0.8), reps, n, cuda_graph)


def copy_bandwidth(nbytes: int = 2**30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_calls(lambda: dst.copy_(src), [()], cuda_graph=False, warmup=3, reps=reps)
    return 2 * src.numel() * src.element_size() / (t.median_us * 1e-6)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf for NaN/inf outputs or a shape mismatch."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    if not torch.isfinite(o).all():
        return math.inf
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-300))


# ||out - ref|| / ||ref|| a correct kernel stays under, by output dtype (bf16: 8 mantissa bits)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-3}


def tolerance_for(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, 2e-3)
