"""Profile μGraph candidates on a GPU: float-check first, then time with CUDA graphs.

A candidate is a kernel graph and its codegen parameters. It is compiled with
:func:`mirage_serve.codegen.compile_graph`, run on fresh random inputs and
compared against the float64 reference of the *spec* (or of itself when no
spec is given) before it is timed; a candidate that fails the check is
reported with ``passed=False`` and can never win.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mirage_serve.mugraph.graph import KernelGraph
from mirage_serve.reference import TORCH_DTYPES, execute
from mirage_serve.tune.cost_model import floor_bytes
from mirage_serve.tune.timing import relative_error, sets_for, time_calls, tolerance_for

log = logging.getLogger(__name__)


@dataclass
class ProfileResult:
    """One candidate on one device: its float check and, if it passed, its timing."""

    passed: bool
    rel_error: float
    tolerance: float
    median_us: float = math.inf
    p20_us: float = math.inf
    p80_us: float = math.inf
    sets: int = 0
    compile_s: float = 0.0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("rel_error", "median_us", "p20_us", "p80_us"):
            if not math.isfinite(d[k]):
                d[k] = None
        return d


def make_params(params: Any) -> Any:
    """A ``CodegenParams`` from a dict (unknown keys dropped with a debug log), or the value unchanged."""
    if not isinstance(params, dict):
        return params
    from dataclasses import fields

    from mirage_serve.codegen import CodegenParams

    known = {f.name for f in fields(CodegenParams)}
    dropped = set(params) - known
    if dropped:
        log.debug("CodegenParams has no field(s) %s; ignored", sorted(dropped))
    return CodegenParams(**{k: v for k, v in params.items() if k in known})


def random_device_inputs(graph: KernelGraph, device: torch.device | str, generator: torch.Generator, scale: float = 1.0) -> list[torch.Tensor]:
    """Standard-normal inputs in the graph's declared dtypes, drawn on the device."""
    out = []
    for t in graph.input_ids:
        info = graph.info[t]
        x = torch.randn(info.shape, generator=generator, device=device, dtype=torch.float32) * scale
        out.append(x.to(TORCH_DTYPES[info.dtype]))
    return out


def check_outputs(outs: list[torch.Tensor], refs: list[torch.Tensor], dtype: torch.dtype) -> tuple[float, float]:
    """(worst relative error over the outputs, tolerance)."""
    err = max((relative_error(o, r) for o, r in zip(outs, refs, strict=True)), default=math.inf)
    return err, tolerance_for(dtype)


_INPUTS: dict[tuple, tuple[list[list[torch.Tensor]], list[torch.Tensor]]] = {}


def _inputs_and_reference(graph: KernelGraph, ref_graph: KernelGraph, device, seed: int):
    """Random input sets for the graph's signature (enough to defeat the L2) and the float64
    reference on the first; kept for the last signature, since every candidate of a spec shares them."""
    from mirage_serve.mugraph.serialize import content_hash

    sig = tuple((graph.info[t].shape, graph.info[t].dtype) for t in graph.input_ids)
    key = (sig, content_hash(ref_graph), str(device), seed)
    hit = _INPUTS.get(key)
    if hit is None:
        _INPUTS.clear()
        gen = torch.Generator(device=device).manual_seed(seed)
        n_sets = sets_for(floor_bytes(graph))
        sets = [random_device_inputs(graph, device, gen) for _ in range(n_sets)]
        hit = _INPUTS[key] = (sets, execute(ref_graph, sets[0], dtype=torch.float64))
    return hit


def clear_input_cache() -> None:
    """Free the input sets kept by :func:`profile_candidate`."""
    _INPUTS.clear()


def profile_candidate(
    graph: KernelGraph,
    params: Any = None,
    *,
    spec: KernelGraph | None = None,
    device: torch.device | str = "cuda",
    seed: int = 0,
    reps: int = 50,
    warmup: int = 5,
    cuda_graph: bool = True,
    variable_dims: tuple[tuple[int, int], ...] = (),
) -> ProfileResult:
    """Compile, float-check against the float64 reference and time one candidate.

    Timing rotates through enough random input sets to defeat the L2 (see
    :func:`mirage_serve.tune.timing.sets_for`) and reports the median per call. The
    sets are drawn once per input signature and seed and shared by the candidates
    of a spec (:func:`clear_input_cache` frees them)."""
    from mirage_serve.codegen import compile_graph

    ref_graph = spec if spec is not None else graph
    out_dtype = TORCH_DTYPES[graph.info[graph.outputs[0]].dtype]
    try:
        t0 = time.perf_counter()
        compiled = compile_graph(graph, make_params(params), variable_dims)
        arg_sets, refs = _inputs_and_reference(graph, ref_graph, device, seed)
        outs = compiled(*arg_sets[0], poison=True)  # outputs start as NaN: an element never written fails the check
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
    except Exception as e:  # a candidate that does not compile or launch loses, with the reason kept
        log.info("candidate failed to compile or run: %s", e)
        return ProfileResult(False, math.inf, tolerance_for(out_dtype), error=f"{type(e).__name__}: {e}")
    err, tol = check_outputs(list(outs), refs, out_dtype)
    if not err <= tol:
        return ProfileResult(False, err, tol, compile_s=compile_s, error=f"float check failed: relative error {err:.3g} > {tol:.3g}")
    t = time_calls(compiled, arg_sets, cuda_graph=cuda_graph, warmup=warmup, reps=reps)
    return ProfileResult(True, err, tol, t.median_us, t.p20_us, t.p80_us, t.sets, compile_s, extra={"kernels": compiled.kernel_stats()})
