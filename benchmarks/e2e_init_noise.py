"""How fragile greedy decisions of a random model are, per weight initialisation (CPU, minutes).

A scaled-down Llama (hidden 1024, 8 layers, 32k vocabulary, GQA 8/2, bf16) decodes
64 tokens greedily from a random prompt; then one forward over prompt + those
tokens is repeated with every linear layer's output perturbed by bf16-ulp-sized
noise (x * (1 + 2^-9 n), n ~ N(0, 1)), which is what a different kernel's
rounding does. Printed per initialisation: the share of positions whose argmax
flips, the top-1/top-2 logit margin over the logits' std (1st, 10th, 50th
percentile), and the share of positions where the layers change the argmax
from the embedding-only prediction (norm(embedding) through lm_head).

Initialisations (``mode:std:emb``): ``base`` every matrix N(0, std); ``resid``
also o_proj and down_proj scaled by 1/sqrt(2 * layers) (GPT-2); ``perm`` sets
lm_head to the token embeddings of a random permutation (each token gets a
designated successor) and ``emb`` scales the embedding by that factor.
Usage: ``python benchmarks/e2e_init_noise.py [--layers=N] base:0.02:1 resid:0.02:1 resid-perm:0.02:3``
(default 8 layers).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

LAYERS = 8
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=LAYERS, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128, max_position_embeddings=512, rms_norm_eps=1e-5)


def initialise(model: nn.Module, mode: str, std: float, emb: float) -> None:
    layers = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.empty(p.shape).uniform_(0.8, 1.2, generator=g))
            else:
                p.copy_(torch.empty(p.shape).normal_(0, std, generator=g))
            if "resid" in mode and ("o_proj" in name or "down_proj" in name):
                p.mul_((2 * layers) ** -0.5)
        model.model.embed_tokens.weight.mul_(emb)
        if "perm" in mode:
            e = model.model.embed_tokens.weight.float()
            perm = torch.randperm(e.shape[0], generator=g)
            model.lm_head.weight.copy_(e[perm] / e[perm].norm(dim=-1, keepdim=True))


def main(specs: list[str], layers: int = LAYERS) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "num_hidden_layers": layers})).to(torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")
    noisy = [False]

    def perturb(mod, inp, out):
        if noisy[0]:
            return out * (1 + 2**-9 * torch.randn_like(out, dtype=torch.float32)).to(out.dtype)
        return None

    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(perturb)
    prompt = torch.randint(0, CONFIG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    for spec in specs:
        mode, std, emb = spec.split(":")
        initialise(model, mode, float(std), float(emb))
        with torch.no_grad():
            seq = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False, pad_token_id=0)
            logits = model(seq).logits[:, 31:-1].float()
            noisy[0] = True
            perturbed = model(seq).logits[:, 31:-1].float()
            noisy[0] = False
            embedding_only = model.lm_head(model.model.norm(model.model.embed_tokens(seq)))[:, 31:-1].float()
        top2 = logits.topk(2, -1).values
        margin = ((top2[..., 0] - top2[..., 1]) / logits.std(-1)).flatten()
        flips = float((logits.argmax(-1) != perturbed.argmax(-1)).float().mean())
        decide = float((logits.argmax(-1) != embedding_only.argmax(-1)).float().mean())
        q = [float(margin.quantile(x)) for x in (0.01, 0.1, 0.5)]
        print(f"{spec:22s} flips {flips:.3f}  margin/std p1 {q[0]:.3f} p10 {q[1]:.3f} p50 {q[2]:.3f}  layers decide {decide:.2f}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    n = next((int(a.split("=", 1)[1]) for a in args if a.startswith("--layers=")), LAYERS)
    args = [a for a in args if not a.startswith("--layers=")]
    main(args or ["base:0.02:1", "base:0.05:1", "base:0.1:1", "resid:0.02:1", "resid-perm:0.02:2", "resid-perm:0.02:3"], n)
