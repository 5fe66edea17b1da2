"""Greedy decoding with a static KV cache and the decode step captured in a CUDA graph.

In the manner of gpt-fast: the model's own modules (patched or not) run a
decoder-only forward that we drive directly, with a KV cache of fixed size that
this module owns, so every decode step has the same shapes and addresses and
can be captured once per batch size and replayed per token. Positions live on
the device; the step also picks the next token and advances the position
inside the graph, so a token costs one graph replay.

On a model patched by :func:`mirage_serve.integrations.hf.patch_model`, a
decode step's attention runs the cached kernel of the smallest kv_len bucket
that holds the whole static cache, over all of it, with the valid length as a
device tensor (so the captured step serves every position); prefill and
shapes without a kernel use SDPA.

Supported: the Llama family's module tree (Llama, Mistral, Qwen2, Qwen3) with
unpadded prompts. Anything else raises :class:`UnsupportedModel`; use
``model.generate`` for it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

logger = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModel(ValueError):
    """The static decode path does not know this model's layout: use ``model.generate``."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@dataclass
class GenerateStats:
    """Timings of one :func:`generate` call (seconds; per-token times exclude prefill)."""

    prefill_s: float
    decode_s: float
    new_tokens: int
    capture_s: float
    cuda_graph: bool

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.decode_s / max(self.new_tokens - 1, 1)


class StaticDecoder:
    """Drives a causal LM's modules over a static KV cache ``[layers, batch, kv_heads, max_len, head_dim]``."""

    def __init__(self, model: nn.Module, batch: int, max_len: int) -> None:
        from mirage_serve.integrations.hf import _base_model, attention_provider

        root, _ = _base_model(model)
        cfg = root.config
        if cfg.model_type not in SUPPORTED:
            raise UnsupportedModel(f"static decoding supports {', '.join(SUPPORTED)}, not {cfg.model_type!r}; use model.generate")
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", cfg.model_type == "mistral"):
            if cfg.sliding_window < max_len:
                raise UnsupportedModel(f"sliding window {cfg.sliding_window} < {max_len} positions is not supported; use model.generate")
        self.model = root
        self.inner = root.model
        self.cfg = cfg
        self.layers = list(self.inner.layers)
        p = next(root.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.batch, self.max_len = batch, max_len
        shape = (len(self.layers), batch, self.kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.scale = self.head_dim**-0.5
        self._arange = torch.arange(max_len, device=self.device)
        self.attention = attention_provider(cfg)  # (provider, dtype) when patched for decode attention

    def _kernel_attention(self, q: torch.Tensor, layer: int, length: torch.Tensor) -> torch.Tensor | None:
        """One query token over layer ``layer``'s whole static cache, the first ``length`` positions valid; None: use SDPA."""
        from mirage_serve.integrations.hf import decode_attention

        provider, dtype = self.attention
        return decode_attention(provider, dtype, q, self.k_cache[layer], self.v_cache[layer], length)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits of the last position for tokens ``ids [b, s]`` at positions ``pos [s]`` (device tensor)."""
        b, s = ids.shape
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, pos[None].expand(b, s))
        cos, sin = cos[:, None], sin[:, None]
        mask = self._arange[None, :] <= pos[:, None]  # [s, max_len]: causal over the static cache
        length = (pos[-1:] + 1).to(torch.int32) if s == 1 and self.attention is not None else None  # valid cache prefix
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, s, self.heads, self.head_dim)
            k = attn.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(b, s, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k_cache[i].index_copy_(2, pos, k)
            self.v_cache[i].index_copy_(2, pos, v)
            o = None if length is None else self._kernel_attention(q, i, length)
            if o is None:
                o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask, scale=self.scale,
                                                   enable_gqa=self.kv_heads != self.heads)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.inner.norm(h[:, -1:])
        return self.model.lm_head(h)[:, -1]


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int = 32, *, cuda_graph: bool | None = None,
             return_stats: bool = False, forced_tokens: torch.Tensor | None = None, return_logits: bool = False):
    """Greedy decoding of ``max_new_tokens`` tokens after ``input_ids [b, prompt]`` (no padding).

    With ``cuda_graph`` (default: on when the model is on a GPU) the decode step is
    captured once and replayed per token. Returns the tokens ``[b, prompt + new]``,
    then the logits ``[b, new, vocab]`` (float32) with ``return_logits``, then
    :class:`GenerateStats` with ``return_stats``. The result equals
    ``model.generate(input_ids, do_sample=False, max_new_tokens=...)`` up to
    floating-point ties.

    ``forced_tokens [b, new]`` scores a given continuation instead (teacher forcing):
    the token fed at position ``prompt + i`` is ``forced_tokens[:, i]``, and the
    returned token ``i`` is the model's greedy choice after ``prompt + forced[:, :i]``,
    by the same decode step (captured the same way). Two models compared this way
    see the same context at every position.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    b, prompt = input_ids.shape
    if forced_tokens is not None and tuple(forced_tokens.shape) != (b, max_new_tokens):
        raise ValueError(f"forced_tokens must be [batch, max_new_tokens] = {[b, max_new_tokens]}, got {list(forced_tokens.shape)}")
    dec = StaticDecoder(model, b, prompt + max_new_tokens)
    ids = input_ids.to(dec.device)
    use_graph = (dec.device.type == "cuda") if cuda_graph is None else cuda_graph
    if use_graph and dec.device.type != "cuda":
        raise ValueError("cuda_graph=True needs the model on a CUDA device")
    sync = torch.cuda.synchronize if dec.device.type == "cuda" else (lambda: None)
    chosen = torch.empty(b, max_new_tokens, dtype=ids.dtype, device=dec.device)  # greedy choice at each new position
    forced = None if forced_tokens is None else forced_tokens.to(device=dec.device, dtype=ids.dtype).contiguous()
    t0 = time.perf_counter()
    logits = dec.forward(ids, torch.arange(prompt, device=dec.device))
    logits_buf = None
    if return_logits:
        logits_buf = torch.empty(max_new_tokens, b, logits.shape[-1], dtype=torch.float32, device=dec.device)
        logits_buf[0] = logits
    tok = logits.argmax(-1, keepdim=True)
    chosen[:, :1] = tok
    sync()
    t1 = time.perf_counter()
    tok_buf = (tok if forced is None else forced[:, :1]).clone()
    pos_buf = torch.full((1,), prompt, device=dec.device, dtype=torch.long)

    def step() -> None:
        step_logits = dec.forward(tok_buf, pos_buf)
        nxt = step_logits.argmax(-1, keepdim=True)
        j = pos_buf - (prompt - 1)  # index of this token among the new ones (0 came from the prompt)
        chosen.index_copy_(1, j, nxt)
        if logits_buf is not None:
            logits_buf.index_copy_(0, j, step_logits[None].float())
        tok_buf.copy_(nxt if forced is None else forced.index_select(1, j))
        pos_buf.add_(1)

    capture_s = 0.0
    run = step
    if use_graph and max_new_tokens > 1:
        tc = time.perf_counter()
        saved_tok, saved_pos = tok_buf.clone(), pos_buf.clone()
        k_saved, v_saved = dec.k_cache.clone(), dec.v_cache.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: autotuning, lazy init, allocator
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        tok_buf.copy_(saved_tok)
        pos_buf.copy_(saved_pos)
        dec.k_cache.copy_(k_saved)
        dec.v_cache.copy_(v_saved)
        del k_saved, v_saved
        run = graph.replay
        sync()
        capture_s = time.perf_counter() - tc
        t1 += capture_s
    for _ in range(1, max_new_tokens):
        run()
    sync()
    t2 = time.perf_counter()
    out = torch.cat([ids, chosen], 1)
    stats = GenerateStats(t1 - t0 - capture_s, t2 - t1, max_new_tokens, capture_s, use_graph)
    logger.info("mirage-serve generate: %d tokens, %.2f ms/token (cuda graph: %s, capture %.2f s)", max_new_tokens,
                stats.ms_per_token, use_graph, capture_s)
    result: tuple = (out,)
    if return_logits:
        result += (logits_buf.transpose(0, 1),)
    if return_stats:
        result += (stats,)
    return result[0] if len(result) == 1 else result
