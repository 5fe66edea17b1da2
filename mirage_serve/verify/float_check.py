"""Floating-point check: the candidate in its working precision against the spec in float64.

The candidate runs on fresh random inputs either through the reference executor
computing in ``dtype`` (every intermediate rounded to it, which emulates a kernel
in that precision) or through any callable (a generated kernel). The spec runs
in float64 on the same, already rounded, inputs, so input rounding is not
counted as error. The error measure is relative to the output's norm,
``||cand - ref||_2 / ||ref||_2``, taken per output and maximised over outputs.

Tolerances (:data:`TOLERANCES`), about twice what faithful implementations
show on the shapes here (K up to 4096, softmax over 4096): float32 1e-5 (unit
roundoff 6e-8; measured < 1e-6), float16 4e-3 (unit roundoff 4.9e-4; measured up
to 1.7e-3 for upstream's gated MLP, where silu·mul amplifies the rounding of
both matmuls), bfloat16 2e-2 (unit roundoff 3.9e-3; measured 6.1e-3 for a gated
MLP).

Input scale: standard normal times ``scale``. Unless given, the scale starts at
1 and is halved (at most 12 times) until, in a float64 run of the spec, every
``exp`` argument is at most :data:`EXP_ARG_LIMIT` and every intermediate value is
below 1/4 of the dtype's largest finite number, so exp and sums of exps stay
finite in float16.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

import torch

from mirage_serve.mugraph.graph import KernelGraph, MuGraphError
from mirage_serve.reference import TORCH_DTYPES, FloatAlgebra, execute, run_graph
from mirage_serve.verify.finite_field import signature_mismatch

log = logging.getLogger(__name__)

TOLERANCES: dict[str, float] = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2, "float64": 1e-12}
EXP_ARG_LIMIT = 4.0
MAX_HALVINGS = 12

RunCandidate = Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]


@dataclass
class FloatReport:
    """One floating-point comparison (all errors against the float64 spec)."""

    dtype: str
    seed: int
    scale: float
    max_abs_error: float
    rel_error: float  # max over outputs of ||cand - ref|| / ||ref||
    tolerance: float
    passed: bool
    reason: str = ""
    conclusive: bool = True  # False: the spec's own float64 output is not finite, nothing was decided

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (non-finite errors as strings)."""
        d = asdict(self)
        for k in ("max_abs_error", "rel_error"):
            if not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d

    @staticmethod
    def from_dict(d: dict) -> FloatReport:
        """Inverse of :meth:`to_dict`; unknown or missing keys are rejected."""
        names = {f.name for f in fields(FloatReport)}
        if not isinstance(d, dict) or set(d) - names or names - set(d):
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"float report needs exactly the keys {sorted(names)}, got {got}")
        d = dict(d)
        for k in ("max_abs_error", "rel_error"):
            d[k] = float(d[k])
        return FloatReport(**d)


class _RangeAlgebra(FloatAlgebra):
    """float64 that records the largest intermediate and the largest exp argument."""

    def __init__(self) -> None:
        super().__init__(torch.float64)
        self.largest = 0.0
        self.largest_exp_arg = -math.inf

    def _seen(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel():
            self.largest = max(self.largest, float(x.abs().max()))
        return x

    def matmul(self, a, b, trans_b: bool = False):
        return self._seen(super().matmul(a, b, trans_b))

    def binary(self, fn: str, a, b):
        return self._seen(super().binary(fn, a, b))

    def unary(self, fn: str, x, scalar: float | None = None):
        if fn == "exp" and x.numel():
            self.largest_exp_arg = max(self.largest_exp_arg, float(x.max()))
        return self._seen(super().unary(fn, x, scalar))

    def sum(self, x, dim: int, keepdim: bool = True):
        return self._seen(super().sum(x, dim, keepdim))

    def rms_norm(self, x, w, eps: float):
        return self._seen(super().rms_norm(x, w, eps))


class RoundingAlgebra(FloatAlgebra):
    """Low precision as CPU torch runs it, faster: each operator computes in
    float32 and its result is rounded to ``dtype`` (torch's CPU half-precision
    kernels also accumulate in float32; its float16 matmul is just slow)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(torch.float32)
        self.low = dtype

    def _r(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.low).to(torch.float32)

    def lift(self, x):
        return self._r(x.to(torch.float32))

    def matmul(self, a, b, trans_b: bool = False):
        return self._r(super().matmul(a, b, trans_b))

    def binary(self, fn: str, a, b):
        return self._r(super().binary(fn, a, b))

    def unary(self, fn: str, x, scalar: float | None = None):
        return self._r(super().unary(fn, x, scalar))

    def sum(self, x, dim: int, keepdim: bool = True):
        return self._r(super().sum(x, dim, keepdim))

    def scale_by_count(self, x, n: int):
        return self._r(super().scale_by_count(x, n))

    def rms_norm(self, x, w, eps: float):
        return self._r(super().rms_norm(x, w, eps))


def run_in_precision(graph: KernelGraph, inputs: Sequence[torch.Tensor], dtype: str) -> list[torch.Tensor]:
    """Outputs of ``graph`` computed in ``dtype``: :func:`mirage_serve.reference.execute`
    for float32/float64, :class:`RoundingAlgebra` for float16 and bfloat16."""
    work = TORCH_DTYPES.get(dtype, torch.float64)
    if work in (torch.float32, torch.float64):
        return execute(graph, inputs, dtype=work)
    alg = RoundingAlgebra(work)
    return [o.to(work) for o in run_graph(graph, [alg.lift(x) for x in inputs], alg)]


def graph_dtype(graph: KernelGraph) -> str:
    """The dtype a graph computes in: that of its first input."""
    return graph.info[graph.input_ids[0]].dtype


def _normal_draws(graph: KernelGraph, seed: int) -> list[torch.Tensor]:
    """The standard-normal float64 draws behind :func:`float_inputs` (before scaling and rounding)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(graph.info[t].shape, generator=g, dtype=torch.float64) for t in graph.input_ids]


def _scaled(graph: KernelGraph, draws: Sequence[torch.Tensor], scale: float, dtype: str | None) -> list[torch.Tensor]:
    return [(x * scale).to(TORCH_DTYPES[dtype or graph.info[t].dtype]) for x, t in zip(draws, graph.input_ids, strict=True)]


def float_inputs(graph: KernelGraph, seed: int, scale: float, dtype: str | None = None) -> list[torch.Tensor]:
    """Standard-normal inputs times ``scale``, rounded to ``dtype`` (default: each input's declared dtype)."""
    return _scaled(graph, _normal_draws(graph, seed), scale, dtype)


def _scaled_reference(spec: KernelGraph, seed: int, dtype: str) -> tuple[float, list[torch.Tensor], list[torch.Tensor]]:
    """(scale, inputs rounded to ``dtype``, the spec's float64 outputs on them) for the scale
    :func:`choose_scale` picks. The inputs are drawn once and rescaled at each halving, and the
    range-tracking run at the chosen scale is the float64 reference itself (it computes in float64)."""
    limit = torch.finfo(TORCH_DTYPES.get(dtype, torch.float64)).max / 4
    draws = _normal_draws(spec, seed)
    scale = 1.0
    for _ in range(MAX_HALVINGS):
        alg = _RangeAlgebra()
        ins = _scaled(spec, draws, scale, dtype)
        outs = run_graph(spec, [alg.lift(x.to(torch.float64)) for x in ins], alg)
        if alg.largest_exp_arg <= EXP_ARG_LIMIT and alg.largest < limit:
            return scale, ins, outs
        scale /= 2
    log.warning("float check: no input scale down to %g keeps the spec's exp arguments and values in range for %s", scale * 2, dtype)
    ins = _scaled(spec, draws, scale, dtype)
    return scale, ins, execute(spec, [x.to(torch.float64) for x in ins])


def choose_scale(spec: KernelGraph, seed: int, dtype: str) -> float:
    """Largest power-of-two input scale <= 1 keeping exp arguments and intermediates in range (see module docstring)."""
    return _scaled_reference(spec, seed, dtype)[0]


@dataclass
class FloatReference:
    """The spec's float64 outputs on one draw of inputs (reusable across candidates)."""

    dtype: str
    seed: int
    scale: float
    inputs: list[torch.Tensor]  # rounded to dtype
    outputs: list[torch.Tensor]  # float64


def float_reference(spec: KernelGraph, *, dtype: str, seed: int = 0, scale: float | None = None) -> FloatReference:
    """Draw inputs (choosing the scale unless given) and run the spec in float64 on them."""
    if dtype not in TOLERANCES:
        raise ValueError(f"float check dtype {dtype!r} is not supported; use one of {sorted(TOLERANCES)}")
    if scale is None:
        return FloatReference(dtype, seed, *_scaled_reference(spec, seed, dtype))
    ins = float_inputs(spec, seed, scale, dtype)
    return FloatReference(dtype, seed, scale, ins, execute(spec, [x.to(torch.float64) for x in ins]))


def float_check(
    candidate: KernelGraph,
    spec: KernelGraph,
    *,
    dtype: str | None = None,
    seed: int = 0,
    outputs: Sequence[int] | None = None,
    run_candidate: RunCandidate | None = None,
    scale: float | None = None,
    tolerance: float | None = None,
    reference: FloatReference | None = None,
) -> FloatReport:
    """Compare the candidate in ``dtype`` (default: its declared dtype) with the spec in float64.

    ``outputs``: indices of the outputs to compare (default: all). ``run_candidate``:
    runs the candidate instead of the reference executor, e.g. a compiled kernel;
    it gets the inputs in their declared dtypes (rounded from the same draw) and
    returns the outputs in order. ``reference``: a :func:`float_reference` of this
    spec, dtype and seed to reuse. Never raises for a bad candidate: a failure is
    a report with ``passed=False`` and a reason."""
    dtype = dtype or graph_dtype(candidate)
    if dtype not in TOLERANCES:
        raise ValueError(f"float check dtype {dtype!r} is not supported; use one of {sorted(TOLERANCES)}")
    tol = TOLERANCES[dtype] if tolerance is None else tolerance
    mismatch = signature_mismatch(candidate, spec)
    if mismatch:
        return FloatReport(dtype, seed, 0.0 if scale is None else scale, math.inf, math.inf, tol, False, mismatch)
    if reference is None or (reference.dtype, reference.seed) != (dtype, seed) or (scale is not None and scale != reference.scale):
        reference = float_reference(spec, dtype=dtype, seed=seed, scale=scale)
    scale, ins, ref = reference.scale, reference.inputs, reference.outputs

    def report(max_abs: float, rel: float, passed: bool, reason: str, conclusive: bool = True) -> FloatReport:
        r = FloatReport(dtype, seed, scale, max_abs, rel, tol, passed, reason, conclusive)
        log.info("float check %s: rel %.3g (tol %.3g), max abs %.3g: %s", dtype, rel, tol, max_abs, "pass" if passed else f"FAIL ({reason})")
        return r

    for j, r in enumerate(ref):
        if not bool(torch.isfinite(r).all()):
            return report(math.inf, math.inf, False, f"the spec's float64 output {j} is not finite at input scale {scale}; the float check cannot decide", False)
    try:
        if run_candidate is not None:
            declared = [x.to(TORCH_DTYPES[candidate.info[t].dtype]) for x, t in zip(ins, candidate.input_ids)]
            got = [torch.as_tensor(o) for o in run_candidate(declared)]
        else:
            got = run_in_precision(candidate, ins, dtype)
    except (MuGraphError, RuntimeError, ValueError) as e:
        return report(math.inf, math.inf, False, f"running the candidate failed: {e}")
    if len(got) != len(ref):
        return report(math.inf, math.inf, False, f"candidate returned {len(got)} outputs, the spec {len(ref)}")
    idx = range(len(ref)) if outputs is None else outputs
    max_abs, rel = 0.0, 0.0
    for j in idx:
        c, r = got[j].detach().to("cpu", torch.float64), ref[j]
        if tuple(c.shape) != tuple(r.shape):
            return report(math.inf, math.inf, False, f"output {j} has shape {list(c.shape)}, the spec's {list(r.shape)}")
        if not bool(torch.isfinite(c).all()):
            n = int((~torch.isfinite(c)).sum())
            return report(math.inf, math.inf, False, f"output {j} has {n} non-finite values in {dtype} (scale {scale})")
        err = c - r
        max_abs = max(max_abs, float(err.abs().max()) if err.numel() else 0.0)
        norm = float(r.norm())
        rel = max(rel, float(err.norm()) / norm if norm > 0 else float(err.norm()))
    passed = rel <= tol
    return report(max_abs, rel, passed, "" if passed else f"relative error {rel:.3g} exceeds the {dtype} tolerance {tol:g}")
