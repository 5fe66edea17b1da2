"""Mistral (transformers ``model_type`` "mistral"): Llama's layer plus an optional sliding window."""

from __future__ import annotations

from .base import ArchDims, ModelAdapter


class MistralAdapter(ModelAdapter):
    """Same module tree as Llama; ``sliding_window`` (v0.1: 4096, v0.2/v0.3: null) caps the kv_len buckets."""

    model_type = "mistral"
    family = "Mistral 7B (v0.1 - v0.3)"

    def notes(self, arch: ArchDims) -> list[str]:
        if arch.sliding_window:
            return [f"sliding window {arch.sliding_window}: decode attention only ever sees the last {arch.sliding_window} "
                    "keys, so kv_len buckets are capped there and a patch must pass only that window of the KV cache"]
        return []
