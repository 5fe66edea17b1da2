import torch
from handwritten import fused_gated_mlp, fused_lora, fused_rmsnorm_linear, split_kv_attention

from mirage_serve.reference import execute, random_inputs
from mirage_serve.specs import build_spec


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _torch_rmsnorm_linear(x, gn, w, eps=1e-6):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gn) @ w.T


def test_spec_rmsnorm_linear_matches_torch():
    spec = build_spec("rmsnorm_linear", {"batch": 3, "hidden": 64, "out": 40})
    ins = random_inputs(spec, torch.Generator().manual_seed(0), dtype=torch.float64)
    (y,) = execute(spec, ins)
    assert _rel(y, _torch_rmsnorm_linear(*ins)) < 1e-12


def test_fused_rmsnorm_linear_accumulates_rms_in_loop():
    g = fused_rmsnorm_linear(4, 64, 48, n_blocks=6, loop=4)
    ins = random_inputs(g, torch.Generator().manual_seed(1), dtype=torch.float64)
    (y,) = execute(g, ins)
    assert _rel(y, _torch_rmsnorm_linear(*ins)) < 1e-12


def test_split_kv_attention_two_kernels():
    g = split_kv_attention(2, 8, 2, 16, 96, splits=3, loop=4)
    assert len(g.customized_ops) == 2
    ins = random_inputs(g, torch.Generator().manual_seed(2), dtype=torch.float64, scale=3.0)
    (o,) = execute(g, ins)
    q, k, v = ins
    ref = torch.softmax((q @ k.transpose(-1, -2)) / 4.0, -1) @ v
    assert _rel(o, ref) < 1e-12
    spec = build_spec("attention_decode", {"batch": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 16, "kv_len": 96})
    assert _rel(execute(spec, ins)[0], ref) < 1e-12


def test_fused_lora_and_gated_mlp():
    g = fused_lora(5, 64, 32, 8, n_blocks=4, loop=2)
    ins = random_inputs(g, torch.Generator().manual_seed(3), dtype=torch.float64)
    x, w, a, b = ins
    assert _rel(execute(g, ins)[0], x @ w.T + 2.0 * (x @ a.T) @ b.T) < 1e-12
    g = fused_gated_mlp(3, 64, 32, n_blocks=2, loop=8)
    ins = random_inputs(g, torch.Generator().manual_seed(4), dtype=torch.float64)
    x, wg, wu = ins
    assert _rel(execute(g, ins)[0], torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) < 1e-12
