"""Swap vLLM's (residual add →) RMSNorm → QKV / gate-up projection for one fused kernel.

Per decoder layer and site, the norm module is replaced by
:class:`FusedNormProjection`, which returns what the projection would have
returned (and the new residual), and the projection by a pass-through. The fused
computation is one ``torch.library`` custom op, ``mirage_serve::norm_linear``, so
it is opaque to torch.compile (vLLM compiles the model) and capturable in CUDA
graphs. This module imports no vLLM code: it works on the module tree by names.

Cache keys from vLLM's view:

- A site's spec is ``add_rmsnorm_linear`` (vLLM fuses the residual add into the
  norm: two outputs, the new residual and the projection), except the first
  layer's input norm, which has no residual yet (``rmsnorm_linear``).
- Its dims come from the live weights: ``hidden`` from the norm, ``out`` from
  the projection's local weight, so a tensor-parallel rank looks up the
  shard's own spec (``out`` divided by TP), which is what
  ``mirage-serve build-cache MODEL_ID --tensor-parallel N`` builds.
- Rows are vLLM's tokens in the step (decode: one per sequence; CUDA graphs pad
  them to a capture size). The kernel for ``rows`` is the entry of the smallest
  cached batch bucket ``>= rows`` (inputs are padded or masked to it); the
  buckets searched are the default ones plus vLLM's capture sizes, so a cache
  built for those sizes is hit exactly. Steps with more rows than the largest
  cached bucket (prefill) run the same math unfused in torch.

A site whose specs have no usable entry at any bucket is not replaced at all:
vLLM's own code serves it, and the start-up report says why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from mirage_serve.integrations.kernels import DEFAULT_BUCKETS, KernelProvider

logger = logging.getLogger(__name__)

ROLES = {
    "norm_qkv": ("input_layernorm", "self_attn", "qkv_proj", "(add →) RMSNorm → QKV projection"),
    "norm_gate_up": ("post_attention_layernorm", "mlp", "gate_up_proj", "add → RMSNorm → gate/up projection"),
}
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class ServingContext:
    """What vLLM's config says about how the model will be run."""

    padded_sizes: tuple[int, ...] = ()  # CUDA-graph capture sizes (empty: eager)
    lora: bool = False
    tensor_parallel: int = 1


@dataclass
class _Site:
    role: str
    provider: KernelProvider
    dtype: str
    eps: float
    kernel_calls: int = 0
    fallback_calls: int = 0


@dataclass
class PluginReport:
    """What the plugin replaced in one model, and which cached kernels serve it."""

    replaced: dict[str, int] = field(default_factory=dict)  # role -> sites
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (site, reason)
    kernels: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # role -> spec description -> cached buckets
    padded_sizes: dict[int, int | None] = field(default_factory=dict)  # vLLM padded batch size -> bucket served by
    largest_bucket: int | None = None  # steps with more tokens than this run unfused (at some site)

    @property
    def total_sites(self) -> int:
        return sum(self.replaced.values()) + len(self.skipped)

    def summary(self) -> str:
        n = sum(self.replaced.values())
        reasons: dict[str, int] = {}
        for _, r in self.skipped:
            reasons[r] = reasons.get(r, 0) + 1
        text = f"replaced {n} of {self.total_sites} sites"
        if reasons:
            text += "; not replaced: " + "; ".join(f"{r} ({k} site{'s' * (k != 1)})" for r, k in sorted(reasons.items()))
        if self.largest_bucket is not None:
            text += f"; steps of more than {self.largest_bucket} tokens run the same math unfused"
        if self.padded_sizes:
            served = {s: b for s, b in self.padded_sizes.items() if b is not None}
            unserved = [s for s, b in self.padded_sizes.items() if b is None]
            if served:
                text += "; vLLM's CUDA-graph sizes -> buckets: " + ", ".join(f"{s}->{b}" for s, b in sorted(served.items()))
            if unserved:
                text += f"; sizes {_ranges(unserved)} have no cached bucket and run unfused"
        return text


SITES: list[_Site] = []
REPORTS: list[PluginReport] = []


def stats() -> dict[str, dict[str, int]]:
    """Kernel and fallback calls per role, over every patched model in this process.

    Under CUDA graphs the op's Python body runs only while a graph is captured,
    so calls are counted per capture, not per replay."""
    out: dict[str, dict[str, int]] = {}
    for s in SITES:
        d = out.setdefault(s.role, {"kernel_calls": 0, "fallback_calls": 0, "sites": 0})
        d["kernel_calls"] += s.kernel_calls
        d["fallback_calls"] += s.fallback_calls
        d["sites"] += 1
    return out


def _ranges(sizes: Sequence[int]) -> str:
    s = sorted(sizes)
    return ", ".join(map(str, s)) if len(s) <= 4 else f"{s[0]}..{s[-1]}"


def _rms_norm(h: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * g


@torch.library.custom_op("mirage_serve::norm_linear", mutates_args=())
def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, g: torch.Tensor, w: torch.Tensor, eps: float, site: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = x [+ residual], y = rms_norm(h, g, eps) @ w^T, by a cached kernel when one covers the shape."""
    s = SITES[site]
    rows = x.shape[0]
    res = None
    dims = {"hidden": x.shape[1], "out": w.shape[0]}
    if residual is None:
        kernel = s.provider.get("rmsnorm_linear", dims, s.dtype, {"eps": eps}, rows, x.device)
        if kernel is not None:
            out = kernel([x, g, w])
            res = None if out is None else (x.clone(), out[0])
    else:
        kernel = s.provider.get("add_rmsnorm_linear", dims, s.dtype, {"eps": eps}, rows, x.device)
        if kernel is not None:
            out = kernel([x, residual, g, w])
            res = None if out is None else (out[0], out[1])
    if res is not None:
        s.kernel_calls += 1
        return res
    s.fallback_calls += 1
    h = x.clone() if residual is None else (x.float() + residual.float()).to(x.dtype)
    return h, F.linear(_rms_norm(h, g, eps), w)


@norm_linear.register_fake
def _(x, residual, g, w, eps, site):
    return torch.empty_like(x), x.new_empty((x.shape[0], w.shape[0]))


class FusedNormProjection(nn.Module):
    """Where the RMSNorm was: returns the projection's output (and the new residual)."""

    def __init__(self, norm: nn.Module, linear: nn.Module, site: int) -> None:
        super().__init__()
        self.weight = norm.weight  # same parameter name as the norm had: checkpoints and weight tracking still match
        object.__setattr__(self, "linear", linear)  # owned by the ProjectedPassThrough at the projection's place
        self.site = site
        self.eps = float(norm.variance_epsilon)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        r2 = None if residual is None else residual.reshape(-1, shape[-1])
        h, y = torch.ops.mirage_serve.norm_linear(x2, r2, self.weight, self.linear.weight, self.eps, self.site)
        bias = getattr(self.linear, "bias", None)
        if bias is not None and not getattr(self.linear, "skip_bias_add", False):
            y = y + bias
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y if residual is None else (y, h.reshape(shape))


class ProjectedPassThrough(nn.Module):
    """Where the projection was: its input already is its output (computed by the fused norm)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.weight = linear.weight  # keeps the projection's parameter name
        self.skip_bias_add = bool(getattr(linear, "skip_bias_add", False))
        if getattr(linear, "bias", None) is not None:
            self.bias = linear.bias

    def forward(self, x: torch.Tensor):
        return x, (self.bias if self.skip_bias_add and hasattr(self, "bias") else None)


def _why_not(norm: nn.Module, linear: nn.Module) -> str | None:
    if type(norm).__name__ != "RMSNorm" or not hasattr(norm, "variance_epsilon") or not isinstance(getattr(norm, "weight", None), nn.Parameter):
        return f"{type(norm).__name__} is not vLLM's RMSNorm with a weight"
    if getattr(norm, "variance_size_override", None) is not None:
        return "RMSNorm with variance_size_override"
    if not getattr(norm, "has_weight", True):
        return "RMSNorm without weight"
    if "LoRA" in type(linear).__name__:
        return f"{type(linear).__name__}: LoRA-wrapped projections are not fused (LoRA kernels inside vLLM are not built yet)"
    qm = getattr(linear, "quant_method", None)
    if qm is not None and type(qm).__name__ != "UnquantizedLinearMethod":
        return f"quantized projection ({type(qm).__name__})"
    if getattr(linear, "gather_output", False) and getattr(linear, "tp_size", 1) > 1:
        return "projection gathers its output across tensor-parallel ranks"
    w = getattr(linear, "weight", None)
    if w is None or w.dim() != 2 or w.shape[1] != norm.weight.shape[0]:
        return "projection has no 2-D weight over the norm's hidden size"
    return None


def _local_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index, layer) for the decoder layers this rank holds (pipeline parallel leaves the others as placeholders)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no model.layers: not a decoder-only model mirage-serve knows")
    start = int(getattr(inner, "start_layer", 0) or 0)
    end = int(getattr(inner, "end_layer", len(layers)) or len(layers))
    return [(i, layers[i]) for i in range(start, end)]


def _cached_buckets(provider: KernelProvider, spec: str, dims: dict[str, int], dtype: str, eps: float, device: torch.device) -> list[int]:
    from mirage_serve.cache import CacheKey, current_gpu_arch

    arch = current_gpu_arch() if device.type == "cuda" else "unprofiled"
    return [b for b in provider.buckets
            if provider.cache.lookup(CacheKey(spec, {**dims, "batch": b}, dtype, gpu_arch=arch, options={"eps": eps})) is not None]


def patch_vllm_model(model: nn.Module, cache: Any = None, *, context: ServingContext | None = None) -> PluginReport:
    """Replace the norm→projection sites of a loaded vLLM decoder-only model; logs the start-up report.

    ``cache``: a :class:`~mirage_serve.cache.KernelCache` or its directory (default:
    ``MIRAGE_SERVE_CACHE``, else the user cache). Patching a model twice returns
    the first report."""
    previous = getattr(model, "_mirage_serve_report", None)
    if previous is not None:
        return previous
    context = context or ServingContext()
    layers = _local_layers(model)
    report = PluginReport()
    param = next(model.parameters())
    dtype = _DTYPES.get(param.dtype)
    blocker = None
    if context.lora:
        blocker = "vLLM runs LoRA adapters: its LoRA manager wraps the projections after loading (fused LoRA kernels inside vLLM are not built yet)"
    elif dtype is None:
        blocker = f"model dtype {param.dtype} has no kernels"
    provider = None
    if blocker is None:
        provider = KernelProvider(cache, buckets=sorted({*DEFAULT_BUCKETS, *context.padded_sizes}))
        if not provider.cache.root.exists():
            logger.warning("mirage-serve: kernel cache %s does not exist (set MIRAGE_SERVE_CACHE, or build it with "
                           "`mirage-serve build-cache MODEL_ID%s`); sites without kernels run vLLM's own code",
                           provider.cache.root, f" --tensor-parallel {context.tensor_parallel}" if context.tensor_parallel > 1 else "")
    coverage: dict[tuple, list[int]] = {}
    served: set[int] = set()
    for i, layer in layers:
        for role, (norm_name, owner_name, proj_name, _) in ROLES.items():
            where = f"layer {i} {role}"
            norm = getattr(layer, norm_name, None)
            owner = getattr(layer, owner_name, None)
            linear = getattr(owner, proj_name, None) if owner is not None else None
            if norm is None or linear is None:
                report.skipped.append((where, f"no {norm_name} / {owner_name}.{proj_name}"))
                continue
            why = blocker or _why_not(norm, linear)
            if why is None:
                spec = "rmsnorm_linear" if role == "norm_qkv" and i == 0 else "add_rmsnorm_linear"
                dims = {"hidden": int(linear.weight.shape[1]), "out": int(linear.weight.shape[0])}
                eps = float(norm.variance_epsilon)
                what = f"{spec}(hidden={dims['hidden']}, out={dims['out']}, {dtype}, eps={eps:g})"
                ck = (spec, dims["hidden"], dims["out"], eps)
                if ck not in coverage:
                    coverage[ck] = _cached_buckets(provider, spec, dims, dtype, eps, param.device)
                buckets = coverage[ck]
                if not buckets:
                    tp = f" --tensor-parallel {context.tensor_parallel}" if context.tensor_parallel > 1 else ""
                    why = f"no usable cache entry for {what} at any batch bucket (build it with `mirage-serve build-cache MODEL_ID{tp}`)"
                else:
                    report.kernels.setdefault(role, {})[what] = buckets
                    served.update(buckets)
            if why:
                report.skipped.append((where, why))
                continue
            SITES.append(_Site(role, provider, dtype, float(norm.variance_epsilon)))
            setattr(layer, norm_name, FusedNormProjection(norm, linear, len(SITES) - 1))
            # the projection leaves the module tree, so vLLM's post-load repacking (CPU gemm dispatch) never sees it
            setattr(owner, proj_name, ProjectedPassThrough(linear))
            report.replaced[role] = report.replaced.get(role, 0) + 1
    report.largest_bucket = min((max(b) for b in coverage.values() if b), default=None)
    if context.padded_sizes:
        report.padded_sizes = {s: min((b for b in served if b >= s), default=None) for s in sorted(set(context.padded_sizes))}
    object.__setattr__(model, "_mirage_serve_report", report)  # a plain attribute, not a submodule
    REPORTS.append(report)
    for role, n in report.replaced.items():
        kernels = "; ".join(f"{w} at buckets {','.join(map(str, b))}" for w, b in report.kernels[role].items())
        logger.info("mirage-serve: %s: replaced %d sites by one fused kernel each (%s)", ROLES[role][3], n, kernels)
    replaced = sum(report.replaced.values())
    level = logging.WARNING if report.total_sites and not replaced else logging.INFO
    logger.log(level, "mirage-serve: %s", report.summary())
    return report
