"""Swap vLLM's (residual add →) RMSNorm → QKV / gate-up projection for one fused kernel.

Per decoder layer and site, the norm module is replaced by
:class:`FusedNormProjection`, which returns what the projection would have
returned (and the new residual), and the projection by a pass-through. The fused
computation is one ``torch.library`` custom op, ``mirage_serve::norm_linear``, so
it is opaque to torch.compile (vLLM compiles the model) and capturable in CUDA
graphs; inside it picks the cache entry for the current number of tokens (vLLM's
padded batch sizes map to the smallest batch bucket that holds them) and falls
back to the same math in torch on a miss, logged once per reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from mirage_serve.integrations.kernels import KernelProvider

logger = logging.getLogger(__name__)


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
    """What the plugin replaced in one model, and how often its kernels ran."""

    replaced: dict[str, int] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def total_sites(self) -> int:
        return sum(self.replaced.values()) + len(self.skipped)


SITES: list[_Site] = []
REPORTS: list[PluginReport] = []


def stats() -> dict[str, dict[str, int]]:
    """Kernel and fallback calls per role, over every patched model in this process."""
    out: dict[str, dict[str, int]] = {}
    for s in SITES:
        d = out.setdefault(s.role, {"kernel_calls": 0, "fallback_calls": 0, "sites": 0})
        d["kernel_calls"] += s.kernel_calls
        d["fallback_calls"] += s.fallback_calls
        d["sites"] += 1
    return out


def _rms_norm(h: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * g


@torch.library.custom_op("mirage_serve::norm_linear", mutates_args=())
def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, g: torch.Tensor, w: torch.Tensor, eps: float, site: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = x [+ residual], y = rms_norm(h, g, eps) @ w^T, by a cached kernel when one covers the shape."""
    s = SITES[site]
    rows = x.shape[0]
    res = None
    if residual is None:
        kernel = s.provider.get("rmsnorm_linear", {"hidden": x.shape[1], "out": w.shape[0]}, s.dtype, {"eps": eps}, rows, x.device)
        if kernel is not None:
            out = kernel([x, g, w])
            res = None if out is None else (x.clone(), out[0])
    else:
        kernel = s.provider.get("add_rmsnorm_linear", {"hidden": x.shape[1], "out": w.shape[0]}, s.dtype, {"eps": eps}, rows, x.device)
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
        h, y = torch.ops.mirage_serve.norm_linear(x, residual, self.weight, self.linear.weight, self.eps, self.site)
        bias = getattr(self.linear, "bias", None)
        if bias is not None and not getattr(self.linear, "skip_bias_add", False):
            y = y + bias
        return y if residual is None else (y, h)


class ProjectedPassThrough(nn.Module):
    """Where the projection was: its input already is its output (computed by the fused norm)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.weight = linear.weight  # keeps the projection's parameter name
        if getattr(linear, "bias", None) is not None:
            self.bias = linear.bias

    def forward(self, x: torch.Tensor):
        return x, None


def _why_not(norm: nn.Module, linear: nn.Module) -> str | None:
    if type(norm).__name__ != "RMSNorm" or not hasattr(norm, "variance_epsilon") or getattr(norm, "weight", None) is None:
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
    if getattr(linear, "weight", None) is None or linear.weight.dim() != 2:
        return "projection has no 2-D weight"
    return None


def patch_vllm_model(model: nn.Module, cache=None) -> PluginReport:
    """Replace the norm→projection sites of a loaded vLLM decoder-only model; logs the report."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no model.layers: not a decoder-only model mirage-serve knows")
    provider = KernelProvider(cache)
    report = PluginReport()
    dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[next(model.parameters()).dtype]
    for i, layer in enumerate(layers):
        for role, norm_name, owner_name, proj_name in (
            ("norm_qkv", "input_layernorm", "self_attn", "qkv_proj"),
            ("norm_gate_up", "post_attention_layernorm", "mlp", "gate_up_proj"),
        ):
            norm = getattr(layer, norm_name, None)
            owner = getattr(layer, owner_name, None)
            linear = getattr(owner, proj_name, None) if owner is not None else None
            if norm is None or linear is None:
                report.skipped.append((f"layer {i} {role}", f"no {norm_name} / {owner_name}.{proj_name}"))
                continue
            why = _why_not(norm, linear)
            if why:
                report.skipped.append((f"layer {i} {role}", why))
                continue
            linear._cpu_skip_gemm_dispatch = True  # keep the plain [out, in] weight we read (CPU builds would repack it)
            SITES.append(_Site(role, provider, dtype, float(norm.variance_epsilon)))
            setattr(layer, norm_name, FusedNormProjection(norm, linear, len(SITES) - 1))
            setattr(owner, proj_name, ProjectedPassThrough(linear))
            report.replaced[role] = report.replaced.get(role, 0) + 1
    REPORTS.append(report)
    for role, n in sorted(report.replaced.items()):
        logger.info("mirage-serve: replaced %d %s sites ((add →) RMSNorm → projection, one fused kernel)", n, role)
    reasons = sorted({r for _, r in report.skipped})
    logger.info("mirage-serve: replaced %d of %d sites%s", sum(report.replaced.values()), report.total_sites,
                f"; not replaced: {'; '.join(reasons)}" if reasons else "")
    return report
