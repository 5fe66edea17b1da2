"""Qwen2 and Qwen2.5 (transformers ``model_type`` "qwen2")."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .base import ArchDims, Linear, ModelAdapter


class Qwen2Adapter(ModelAdapter):
    """Llama's layer, but q/k/v projections always carry a bias (transformers builds them with bias=True).

    The rmsnorm_linear / add_rmsnorm_linear specs have no bias, so the QKV subgraphs list the bias
    adds as ``unfused``: a patch must add ``q_proj.bias``, ``k_proj.bias``, ``v_proj.bias`` to the
    kernel's output. The sliding window is only active when ``use_sliding_window`` is true.
    """

    model_type = "qwen2"
    family = "Qwen2 / Qwen2.5"

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        return int(config["sliding_window"]) if config.get("use_sliding_window") and config.get("sliding_window") else None

    def linears(self, arch: ArchDims) -> dict[str, Linear]:
        ls = super().linears(arch)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            ls[m] = replace(ls[m], bias=True)
        ls["self_attn.o_proj"] = replace(ls["self_attn.o_proj"], bias=False)
        return ls

    def notes(self, arch: ArchDims) -> list[str]:
        return ["q/k/v biases are not fused: patches add them after the fused QKV kernel"]
