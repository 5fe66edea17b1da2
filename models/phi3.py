"""Phi-3 (transformers ``model_type`` "phi3"): fused qkv_proj and gate_up_proj modules."""

from __future__ import annotations

from .base import ArchDims, Linear, ModelAdapter


class Phi3Adapter(ModelAdapter):
    """Phi-3's checkpoints already store QKV as one ``self_attn.qkv_proj`` ([(q + 2 kv) * head_dim, hidden])
    and gate/up as one ``mlp.gate_up_proj`` ([2 * intermediate, hidden], gate rows first: the model
    does ``gate, up = gate_up_proj(x).chunk(2, dim=-1)``), so a fused subgraph has one linear site.

    For gated_mlp, Wg and Wu are the first and second halves of ``gate_up_proj.weight``'s rows.
    Phi-3's ``sliding_window`` (2047 in the mini-4k checkpoints) is active in transformers and
    caps the kv_len buckets.
    """

    model_type = "phi3"
    family = "Phi-3 / Phi-3.5 (dense)"
    qkv_modules = ("self_attn.qkv_proj",)
    gate_up_modules = ("mlp.gate_up_proj",)

    def linears(self, arch: ArchDims) -> dict[str, Linear]:
        q, kv = arch.q_heads * arch.head_dim, arch.kv_heads * arch.head_dim
        return {
            "self_attn.qkv_proj": Linear("qkv_proj", q + 2 * kv, arch.hidden, "column"),
            "self_attn.o_proj": Linear("o_proj", arch.hidden, q, "row"),
            "mlp.gate_up_proj": Linear("gate_up_proj", 2 * arch.intermediate, arch.hidden, "column"),
            "mlp.down_proj": Linear("down_proj", arch.hidden, arch.intermediate, "row"),
        }

    def notes(self, arch: ArchDims) -> list[str]:
        notes = ["gated_mlp on Phi-3: Wg = gate_up_proj.weight[:intermediate], Wu = gate_up_proj.weight[intermediate:]",
                 "tensor parallel splits of qkv_proj/gate_up_proj must shard q, k, v (gate, up) separately, "
                 "as vLLM's merged column-parallel linears do"]
        if arch.sliding_window:
            notes.append(f"sliding window {arch.sliding_window}: kv_len buckets capped there; pass only that window of the KV cache")
        return notes
