"""Llama 2, 3, 3.1 and 3.2 (transformers ``model_type`` "llama")."""

from __future__ import annotations

from .base import ModelAdapter


class LlamaAdapter(ModelAdapter):
    """Pre-norm decoder: RMSNorm -> q/k/v -> GQA attention -> o_proj; RMSNorm -> silu(gate) * up -> down.

    ``attention_bias`` / ``mlp_bias`` in the config add biases, which the specs leave to the
    model's own code (recorded per subgraph as ``unfused``). RoPE scaling (Llama 3.1's "llama3"
    rope type) happens outside every emitted subgraph.
    """

    model_type = "llama"
    family = "Llama 2 / 3 / 3.1 / 3.2"
