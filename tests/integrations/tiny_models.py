"""Tiny random models of every supported architecture, built offline with transformers."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"head_dim": 16, "sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"pad_token_id": 0}),
}


def tiny_model(arch: str, tmp_path, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Build, save and reload (offline) a tiny random model of ``arch``."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra))
    with torch.no_grad():  # norms start at ones: randomise so a wrong weight would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    path = tmp_path / arch
    model.save_pretrained(path)
    return model_cls.from_pretrained(path, dtype=dtype).eval(), path
