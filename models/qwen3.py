"""Qwen3 dense models (transformers ``model_type`` "qwen3"): per-head q/k RMSNorm."""

from __future__ import annotations

from typing import Any

from .base import ArchDims, ModelAdapter

QK_NORM_NOTE = ("per-head RMSNorm on q and k (self_attn.q_norm, self_attn.k_norm, weight [head_dim]) before RoPE: "
                "not fused; the fused QKV kernel stops at the projections and the model's own q_norm/k_norm, RoPE "
                "and KV-cache update run on its output")


class Qwen3Adapter(ModelAdapter):
    """Llama's module tree plus ``self_attn.q_norm`` / ``self_attn.k_norm``; head_dim is explicit in the config.

    The q/k norms sit between the QKV projection and RoPE, so they stay outside both the fused QKV
    subgraph (recorded there as ``unfused``) and decode attention (which reads already-normed,
    rotated q and cached k). ``attention_bias`` defaults to false.
    """

    model_type = "qwen3"
    family = "Qwen3 (dense)"

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        return int(config["sliding_window"]) if config.get("use_sliding_window") and config.get("sliding_window") else None

    def qkv_unfused(self, arch: ArchDims) -> list[str]:
        return [QK_NORM_NOTE, *super().qkv_unfused(arch)]

    def expected_weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_weight_shapes(config)
        arch = self.arch_dims(config)
        for i in range(arch.layers):
            shapes[f"{self.layer(i)}.self_attn.q_norm"] = (arch.head_dim,)
            shapes[f"{self.layer(i)}.self_attn.k_norm"] = (arch.head_dim,)
        return shapes

    def notes(self, arch: ArchDims) -> list[str]:
        return [QK_NORM_NOTE]
