"""Patch Hugging Face transformers models with mirage-serve's kernels.

``patch_model(model)`` walks the sites that the model's adapter names and
replaces, per decoder layer:

* the input RMSNorm and the q/k/v projections by one fused RMSNorm→linear over
  the concatenated weight ``[Wq; Wk; Wv]`` (the norm module becomes a pass-through,
  each projection returns its slice of the fused output, computed once);
* the post-attention RMSNorm and gate/up projections the same way;
* decode attention through transformers' ``AttentionInterface`` (``"mirage"``):
  one query token runs the kernel of the smallest cached kv_len bucket at least
  the current KV length (one kernel serves every length up to its bucket);
* peft LoRA-augmented linears (one active adapter, not merged) by ``lora_linear``.

The model's own forward code is untouched, so the patch follows transformers
across versions. Weights are concatenated once; the projections keep views
into the concatenation as their ``weight``, so nothing is stored twice. Shapes
the cache does not cover run the original math (one GEMM on the concatenated
weight), logged once per reason; a kernel that fails is disabled with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mirage_serve.integrations.kernels import KernelProvider, log_once

logger = logging.getLogger(__name__)

ATTENTION_NAME = "mirage"


@dataclass
class PatchRecord:
    """One site of the model: what was patched there, or why not."""

    layer: int | None
    role: str
    sites: list[str]
    patched: bool
    reason: str = ""
    spec: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "role": self.role, "sites": self.sites, "patched": self.patched, "reason": self.reason, "spec": self.spec}


@dataclass
class PatchReport:
    """What :func:`patch_model` did: patched sites, skipped sites and why, kernel misses at run time."""

    model_type: str
    records: list[PatchRecord] = field(default_factory=list)
    provider: KernelProvider | None = None

    @property
    def patched(self) -> list[PatchRecord]:
        return [r for r in self.records if r.patched]

    @property
    def skipped(self) -> list[PatchRecord]:
        return [r for r in self.records if not r.patched]

    @property
    def misses(self) -> dict[str, str]:
        """Shapes that ran the original code so far (filled while the model runs)."""
        return self.provider.misses if self.provider else {}

    def kernel_calls(self) -> dict[str, int]:
        """Calls served by each cache entry so far."""
        calls: dict[str, int] = {}
        if self.provider is not None:
            for k in self.provider.kernels():
                calls[k.entry_id] = calls.get(k.entry_id, 0) + k.calls
        return calls

    def kernel_lengths(self) -> dict[str, dict[int, int]]:
        """Calls per KV length of each decode-attention entry so far (lengths known on the host)."""
        if self.provider is None:
            return {}
        return {k.entry_id: dict(k.calls_by_length) for k in self.provider.kernels() if k.extent is not None}

    def summary(self) -> str:
        by_role: dict[str, int] = {}
        for r in self.patched:
            by_role[r.role] = by_role.get(r.role, 0) + 1
        parts = [f"{n} {role}" for role, n in sorted(by_role.items())]
        return f"mirage-serve patched {self.model_type}: {len(self.patched)} sites ({', '.join(parts) or 'none'}); {len(self.skipped)} not patched"

    def __str__(self) -> str:
        lines = [self.summary()]
        for r in self.skipped:
            lines.append(f"  not patched: layer {r.layer} {r.role}: {r.reason}")
        return "\n".join(lines)


class FusedNormLinear(nn.Module):
    """Stands where an RMSNorm was; owns the concatenated weight of the projections after it.

    Its forward passes the input through unchanged: each projection module after it
    (a :class:`_FusedSlice`) asks for its slice of ``rms_norm(x) @ W_cat^T``, which
    is computed once per input (kernel, or the original norm and one GEMM on a miss)
    and kept until every slice was handed out.
    """

    def __init__(self, norm: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, splits: list[int], eps: float,
                 provider: KernelProvider, dtype: str, role: str) -> None:
        super().__init__()
        self.original = norm
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.splits = splits
        self.offsets = [sum(splits[:i]) for i in range(len(splits) + 1)]
        self.eps = eps
        self.provider = provider
        self.dtype = dtype
        self.role = role
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None
        self._pending: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self._x is not x or index not in self._pending:
            self._y = self._compute(x)
            self._x = x
            self._pending = set(range(len(self.splits)))
        y = self._y[..., self.offsets[index] : self.offsets[index + 1]]
        self._pending.discard(index)
        if not self._pending:
            self._x = self._y = None
        return y

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = None
        if torch.is_grad_enabled() and x.requires_grad:
            log_once(f"grad:{self.role}", "mirage-serve: %s runs the original code while gradients are needed", self.role)
        else:
            kernel = self.provider.get("rmsnorm_linear", {"hidden": x.shape[-1], "out": self.weight.shape[0]}, self.dtype,
                                       {"eps": self.eps}, flat.shape[0], x.device)
            if kernel is not None:
                res = kernel([flat.contiguous(), self.original.weight, self.weight])
                out = res[0] if res is not None else None
        if out is None:
            out = nn.functional.linear(self.original(flat), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.weight.shape[0])


class _FusedSlice(nn.Module):
    """A projection whose output is slice ``index`` of a :class:`FusedNormLinear`'s output."""

    def __init__(self, fused: FusedNormLinear, index: int, original: nn.Linear) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a child: the fused module lives at the norm's place
        self.index = index
        self.in_features, self.out_features = original.in_features, original.out_features

    @property
    def weight(self) -> torch.Tensor:
        """This projection's rows of the concatenated weight (a view, not a copy)."""
        return self.fused.weight[self.fused.offsets[self.index] : self.fused.offsets[self.index + 1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)


def _module(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


def _set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, new)


def _is_plain_linear(m: nn.Module) -> bool:
    return type(m) is nn.Linear


def _norm_eps(norm: nn.Module, default: float) -> float:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(norm, attr):
            return float(getattr(norm, attr))
    return default


def _is_llama_rmsnorm(norm: nn.Module) -> str | None:
    """None if ``norm`` computes weight * x * rsqrt(mean(x^2) + eps) (in fp32, cast back), else why not."""
    if not hasattr(norm, "weight") or norm.weight is None or norm.weight.dim() != 1:
        return f"{type(norm).__name__} has no [hidden] weight"
    x = torch.randn(3, norm.weight.shape[0], dtype=torch.float32, device=norm.weight.device)
    with torch.no_grad():
        want = norm.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _norm_eps(norm, 1e-6)))
        got = norm(x.to(norm.weight.dtype)).float()
    err = float((got - want).norm() / want.norm())
    return None if err < 2e-2 else f"{type(norm).__name__} is not a plain RMSNorm (relative difference {err:.2g}; e.g. Gemma's 1+w)"


def _fuse_group(model: nn.Module, layer: int, role: str, norm_path: str, proj_paths: list[str], provider: KernelProvider,
                dtype: str, eps: float) -> PatchRecord:
    sites = [norm_path, *proj_paths]
    norm = _module(model, norm_path)
    if isinstance(norm, FusedNormLinear):
        return PatchRecord(layer, role, sites, False, "already patched", "rmsnorm_linear")
    why = _is_llama_rmsnorm(norm)
    if why:
        return PatchRecord(layer, role, sites, False, why, "rmsnorm_linear")
    projs = [_module(model, p) for p in proj_paths]
    for p, m in zip(proj_paths, projs, strict=True):
        if not _is_plain_linear(m):
            return PatchRecord(layer, role, sites, False, f"{p} is a {type(m).__name__} (e.g. a LoRA wrapper), not nn.Linear", "rmsnorm_linear")
    with torch.no_grad():
        weight = torch.cat([m.weight for m in projs], 0) if len(projs) > 1 else projs[0].weight.data
        has_bias = [m.bias is not None for m in projs]
        if any(has_bias) and not all(has_bias):
            return PatchRecord(layer, role, sites, False, "only some projections have a bias", "rmsnorm_linear")
        bias = torch.cat([m.bias for m in projs], 0) if all(has_bias) else None
    fused = FusedNormLinear(norm, weight, bias, [m.out_features for m in projs], _norm_eps(norm, eps), provider, dtype, role)
    _set_module(model, norm_path, fused)
    for i, (p, m) in enumerate(zip(proj_paths, projs, strict=True)):
        _set_module(model, p, _FusedSlice(fused, i, m))
    return PatchRecord(layer, role, sites, True, "", "rmsnorm_linear")


class _LoraKernelLinear(nn.Module):
    """A peft ``lora.Linear`` with one active, unmerged adapter, run as ``lora_linear``."""

    def __init__(self, original: nn.Module, adapter: str, provider: KernelProvider, dtype: str) -> None:
        super().__init__()
        self.original = original
        self.adapter = adapter
        self.provider = provider
        self.dtype = dtype
        self.train(original.training)  # a new module starts in training mode; ``o.training`` decides below

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        o = self.original
        if o.training or args or kwargs or o.merged or list(o.active_adapters) != [self.adapter] or torch.is_grad_enabled() and x.requires_grad:
            return o(x, *args, **kwargs)
        base = o.base_layer
        a, b = o.lora_A[self.adapter].weight, o.lora_B[self.adapter].weight
        scale = float(o.scaling[self.adapter])
        flat = x.reshape(-1, x.shape[-1])
        kernel = self.provider.get("lora_linear", {"in": a.shape[1], "out": b.shape[0], "rank": a.shape[0]}, self.dtype,
                                   {"scale": scale}, flat.shape[0], x.device)
        res = kernel([flat.contiguous(), base.weight, a, b]) if kernel is not None else None
        if res is None:
            return o(x, *args, **kwargs)
        out = res[0]
        if base.bias is not None:
            out = out + base.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _patch_lora(model: nn.Module, provider: KernelProvider, dtype: str) -> list[PatchRecord]:
    records = []
    for path, m in list(model.named_modules()):
        if not (hasattr(m, "lora_A") and hasattr(m, "base_layer") and hasattr(m, "active_adapters")):
            continue
        layer = _layer_index(path)
        adapters = list(m.active_adapters)
        if len(adapters) != 1 or adapters[0] not in m.lora_A:
            records.append(PatchRecord(layer, "lora_linear", [path], False, f"{len(adapters)} active adapters; one is supported", "lora_linear"))
            continue
        drop = m.lora_dropout[adapters[0]] if hasattr(m, "lora_dropout") else None
        if not _is_plain_linear(m.base_layer) or getattr(m, "use_dora", {}).get(adapters[0], False):
            records.append(PatchRecord(layer, "lora_linear", [path], False, "base layer is not nn.Linear or DoRA is on", "lora_linear"))
            continue
        if drop is not None and not isinstance(drop, nn.Identity) and getattr(drop, "p", 0.0) > 0:
            logger.debug("LoRA dropout at %s is only active in training mode; the kernel runs in eval mode only", path)
        _set_module(model, path, _LoraKernelLinear(m, adapters[0], provider, dtype))
        records.append(PatchRecord(layer, "lora_linear", [path], True, "", "lora_linear"))
    return records


def _layer_index(path: str) -> int | None:
    parts = path.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32")


def _base_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The transformers model under any peft wrappers, and the path prefix to its modules.

    A ``PeftModel`` holds its tuner (``LoraModel``) as the submodule ``base_model``, the tuner holds the
    transformers model as ``model``; both also forward attribute reads to what they wrap, so the walk
    follows registered submodules only, and stops at the first transformers model."""
    from transformers import PreTrainedModel

    root, prefix = model, ""
    while hasattr(root, "peft_config") and not isinstance(root, PreTrainedModel):
        children = root._modules
        name = "base_model" if "base_model" in children else "model" if "model" in children else None
        if name is None:
            break
        root = children[name]
        prefix += name + "."
    return root, prefix


def patch_model(model: nn.Module, cache: Any = None, *, provider: KernelProvider | None = None, attention: bool = True,
                kv_buckets: Sequence[int] | None = None) -> PatchReport:
    """Patch a transformers causal LM in place with kernels from ``cache``.

    ``cache`` is a :class:`mirage_serve.cache.KernelCache`, a cache directory, or
    None for the default (``MIRAGE_SERVE_CACHE`` or the user cache dir). Decode
    attention uses the entry of the smallest kv_len bucket >= the current length;
    ``kv_buckets`` are the buckets the cache was built with (``build-cache
    --kv-lens``; default its 1024,4096,16384), capped at the model's context as
    ``build-cache`` caps them. Returns a :class:`PatchReport` of what was patched
    and what was not, and why.
    """
    from mirage_serve.models import AdapterError, get_adapter
    from mirage_serve.models.base import DEFAULT_KV_LEN_BUCKETS, kv_len_buckets

    root, _ = _base_model(model)
    config = getattr(root, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise TypeError(f"patch_model expects a transformers model with a config, got {type(model).__name__}")
    try:
        adapter = get_adapter(model_type)
    except AdapterError as e:
        raise AdapterError(f"cannot patch this model: {e}") from None
    provider = provider or KernelProvider(cache)
    arch = adapter.arch_dims(config)
    provider.add_kv_buckets(kv_len_buckets(arch, DEFAULT_KV_LEN_BUCKETS if kv_buckets is None else kv_buckets))
    dtype = _dtype_name(next(root.parameters()).dtype)
    report = PatchReport(model_type, provider=provider)
    for i in range(arch.layers):
        base = adapter.layer(i)
        report.records.append(_fuse_group(root, i, "attn_norm_qkv", f"{base}.{adapter.input_norm}",
                                          [f"{base}.{m}" for m in adapter.qkv_modules], provider, dtype, arch.eps))
        report.records.append(_fuse_group(root, i, "mlp_norm_gate_up", f"{base}.{adapter.post_attention_norm}",
                                          [f"{base}.{m}" for m in adapter.gate_up_modules], provider, dtype, arch.eps))
    report.records.extend(_patch_lora(model, provider, dtype))
    if attention:
        report.records.append(_patch_attention(root, provider, dtype))
    logger.info("%s", report.summary())
    return report


# ---- decode attention ---------------------------------------------------------------

_PROVIDERS: dict[int, tuple[KernelProvider, str]] = {}


def attention_provider(config: Any) -> tuple[KernelProvider, str] | None:
    """(provider, dtype) of a model patched for decode attention (``config._attn_implementation == "mirage"``), else None."""
    if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        return None
    return _PROVIDERS.get(id(config))


def decode_attention(provider: KernelProvider, dtype: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     lengths: torch.Tensor | None = None) -> torch.Tensor | None:
    """Attention of one query token ``[b, q_heads, 1, d]`` over ``key``/``value`` ``[b, kv_heads, L, d]``
    by the cached kernel of the smallest kv_len bucket >= L (scale 1/sqrt(d), no mask).

    ``lengths``: a one-element int32 device tensor, the valid prefix of the L positions
    (a static KV cache). Returns ``[b, q_heads, 1, d]``, or None: run your own code."""
    b, hq, _, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    kernel = provider.get("attention_decode", {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "kv_len": kv_len}, dtype, {}, b, query.device)
    if kernel is None:
        return None
    q = query.reshape(b * hkv, hq // hkv, d).contiguous()
    k = key.reshape(b * hkv, kv_len, d).contiguous()
    v = value.reshape(b * hkv, kv_len, d).contiguous()
    res = kernel([q, k, v], lengths) if lengths is not None else kernel([q, k, v])
    return None if res is None else res[0].reshape(b, hq, 1, d)


def _mirage_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any):
    """AttentionInterface function: the decode kernel for one query token, SDPA otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    entry = _PROVIDERS.get(id(module.config))
    q_len, d = query.shape[2], query.shape[3]
    usable = entry is not None and q_len == 1 and dropout == 0.0 and (attention_mask is None or bool(attention_mask.all()))
    if usable and scaling is not None and abs(scaling - d**-0.5) > 1e-12:
        log_once(f"attn-scale:{scaling}", "mirage-serve: attention scale %s is not 1/sqrt(head_dim); using SDPA", scaling)
        usable = False
    if usable:
        out = decode_attention(entry[0], entry[1], query, key, value)
        if out is not None:
            return out.transpose(1, 2), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register_attention() -> None:
    """Register ``"mirage"`` with transformers' AttentionInterface (and SDPA's mask format). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _mirage_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def _patch_attention(root: nn.Module, provider: KernelProvider, dtype: str) -> PatchRecord:
    register_attention()
    _PROVIDERS[id(root.config)] = (provider, dtype)
    try:
        root.set_attn_implementation(ATTENTION_NAME)
    except Exception as e:  # some architectures refuse custom attention: keep theirs
        return PatchRecord(None, "attention_decode", ["config._attn_implementation"], False, f"set_attn_implementation refused: {e}", "attention_decode")
    return PatchRecord(None, "attention_decode", ["config._attn_implementation"], True, "", "attention_decode")


def from_pretrained(model_id_or_path: str, *, cache: Any = None, kv_buckets: Sequence[int] | None = None, **kwargs: Any) -> nn.Module:
    """Load a causal LM with transformers' ``AutoModelForCausalLM.from_pretrained`` and patch it.

    The report of :func:`patch_model` is attached as ``model.mirage_report``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_id_or_path, **kwargs)
    model.eval()
    model.mirage_report = patch_model(model, cache, kv_buckets=kv_buckets)
    return model
