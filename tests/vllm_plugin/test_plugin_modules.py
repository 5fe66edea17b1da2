"""The vLLM plugin's registration and patching, without vLLM: a module tree shaped like vLLM's Llama.

These run in the main test suite (vLLM not installed); the real vLLM runs are in
test_vllm_plugin.py.
"""

import logging
import shutil
import sys
import time
import types

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from vllm_tiny_models import fill_cache

import mirage_serve.integrations.vllm as plugin
from mirage_serve.integrations.vllm import patch
from mirage_serve.integrations.vllm.patch import FusedNormProjection, ServingContext, patch_vllm_model

HIDDEN, QKV, INTER, EPS = 32, 64, 64, 1e-5
BUCKETS = (1, 2, 4)


class RMSNorm(nn.Module):
    """vLLM's RMSNorm contract: with a residual, returns (norm(x + residual), x + residual)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)
        self.variance_epsilon = EPS

    def forward(self, x, residual=None):
        h = x if residual is None else x + residual
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * self.weight
        return y if residual is None else (y, h)


class Linear(nn.Module):
    """vLLM's linear contract: returns (output, output bias)."""

    def __init__(self, inp: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, inp) / inp**0.5)

    def forward(self, x):
        return F.linear(x, self.weight), None


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = Linear(HIDDEN, QKV), Linear(QKV, HIDDEN)

    def forward(self, h):
        qkv, _ = self.qkv_proj(h)
        return self.o_proj(torch.tanh(qkv))[0]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = Linear(HIDDEN, 2 * INTER), Linear(INTER, HIDDEN)

    def forward(self, h):
        gu, _ = self.gate_up_proj(h)
        g, u = gu.chunk(2, -1)
        return self.down_proj(F.silu(g) * u)[0]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(HIDDEN), Attn()
        self.post_attention_layernorm, self.mlp = RMSNorm(HIDDEN), MLP()

    def forward(self, h, residual):  # vLLM's LlamaDecoderLayer.forward
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Inner(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.norm = RMSNorm(HIDDEN)

    def forward(self, h):
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual)
        return self.norm(h, residual)[0]


class Model(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Inner(layers)

    def forward(self, h):
        return self.model(h)


SHAPES = (("rmsnorm_linear", HIDDEN, QKV), ("add_rmsnorm_linear", HIDDEN, QKV), ("add_rmsnorm_linear", HIDDEN, 2 * INTER))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return fill_cache(tmp_path_factory.mktemp("cache"), SHAPES, BUCKETS, eps=EPS)


def _calls() -> dict[str, int]:
    return {role: d["kernel_calls"] for role, d in patch.stats().items()}


def test_patched_tree_matches_and_runs_the_cached_kernels(cache_dir, caplog):
    model = Model()
    names = [n for n, _ in model.named_parameters()]
    x = torch.randn(3, HIDDEN)
    want = model(x)
    before = len(patch.SITES)
    with caplog.at_level(logging.INFO, logger="mirage_serve"):
        report = patch_vllm_model(model, cache_dir)
    assert report.replaced == {"norm_qkv": 2, "norm_gate_up": 2} and report.skipped == []
    assert isinstance(model.model.layers[0].input_layernorm, FusedNormProjection)
    assert [n for n, _ in model.named_parameters()] == names  # vLLM's weight tracking sees the same names
    got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    sites = patch.SITES[before:]
    assert [s.kernel_calls for s in sites] == [1, 1, 1, 1] and all(s.fallback_calls == 0 for s in sites)
    text = caplog.text
    assert "(add →) RMSNorm → QKV projection: replaced 2 sites" in text and "gate/up projection: replaced 2 sites" in text
    assert "replaced 4 of 4 sites; steps of more than 4 tokens run the same math unfused" in text
    model(torch.randn(7, HIDDEN))  # more rows than any bucket: the same math in torch
    assert all(s.fallback_calls == 1 for s in sites)
    assert patch_vllm_model(model, cache_dir) is report and len(patch.SITES) == before + 4  # patching twice is a no-op


def test_padded_batch_sizes_map_to_cached_buckets(tmp_path):
    partial = fill_cache(tmp_path / "c", SHAPES, (2,), eps=EPS)
    model = Model(layers=1)
    report = patch_vllm_model(model, partial, context=ServingContext(padded_sizes=(1, 2, 4, 8)))
    assert report.padded_sizes == {1: 2, 2: 2, 4: None, 8: None}
    assert "1->2, 2->2" in report.summary() and "sizes 4, 8 have no cached bucket" in report.summary()
    x = torch.randn(1, HIDDEN)
    want = Model(layers=1)(x)
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)  # 1 row runs the bucket-2 kernel, padded
    assert patch.SITES[-1].kernel_calls == 1


def test_missing_cache_leaves_every_site_with_a_warning(tmp_path, caplog):
    model = Model()
    with caplog.at_level(logging.INFO, logger="mirage_serve"):
        report = patch_vllm_model(model, tmp_path / "no-such-cache", context=ServingContext(tensor_parallel=2))
    assert report.replaced == {} and len(report.skipped) == 4
    assert not any(isinstance(m, FusedNormProjection) for m in model.modules())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("does not exist" in w and "--tensor-parallel 2" in w for w in warnings), warnings
    assert any("replaced 0 of 4 sites; not replaced: no usable cache entry" in w for w in warnings), warnings


def test_corrupt_cache_entries_are_rejected_and_sites_left(cache_dir, tmp_path, caplog):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(cache_dir, corrupt)
    for f in (corrupt / "entries").glob("*.json"):
        f.write_bytes(f.read_bytes()[:-40])
    model = Model()
    x = torch.randn(2, HIDDEN)
    want = model(x)
    with caplog.at_level(logging.INFO, logger="mirage_serve"):
        report = patch_vllm_model(model, corrupt)
    assert report.replaced == {}
    assert "kernel cache: rejected" in caplog.text and "replaced 0 of 4 sites" in caplog.text
    torch.testing.assert_close(model(x), want)


def test_lora_and_unknown_norms_are_not_replaced(cache_dir):
    report = patch_vllm_model(Model(), cache_dir, context=ServingContext(lora=True))
    assert report.replaced == {} and all("LoRA" in why for _, why in report.skipped)
    model = Model(layers=1)
    model.model.layers[0].input_layernorm = nn.LayerNorm(HIDDEN)
    report = patch_vllm_model(model, cache_dir)
    assert report.replaced == {"norm_gate_up": 1}
    assert report.skipped == [("layer 0 norm_qkv", "LayerNorm is not vLLM's RMSNorm with a weight")]


def test_models_read_the_serving_context_from_vllm_config():
    pytest.importorskip("vllm.model_executor.models.llama")
    from mirage_serve.integrations.vllm.models import _serving_context

    cfg = types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24]),
                                parallel_config=types.SimpleNamespace(tensor_parallel_size=2), lora_config=None)
    assert _serving_context(cfg) == ServingContext(padded_sizes=(1, 2, 4, 8, 16, 24), lora=False, tensor_parallel=2)


class _Registry:
    def __init__(self, models: dict[str, str]) -> None:
        self.models = {a: types.SimpleNamespace(module_name=m, class_name=a) for a, m in models.items()}
        self.calls = 0

    def register_model(self, arch: str, target: str) -> None:
        self.calls += 1
        module, cls = target.split(":")
        self.models[arch] = types.SimpleNamespace(module_name=module, class_name=cls)


@pytest.fixture
def fake_vllm(monkeypatch):
    registry = _Registry({a: m for a, m in plugin.ARCHITECTURES.items() if a != "Qwen3ForCausalLM"}
                         | {"Qwen3ForCausalLM": "someone_else.models"})
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(ModelRegistry=registry))
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setattr(plugin, "_module_exists", lambda name: True)
    monkeypatch.delenv("MIRAGE_SERVE_DISABLE", raising=False)
    return registry


def test_register_is_idempotent_cheap_and_leaves_other_plugins_classes(fake_vllm, caplog):
    t = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="mirage_serve"):
        first = plugin.register()
    assert time.perf_counter() - t < 0.5
    assert first == ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]
    assert fake_vllm.models["LlamaForCausalLM"].module_name == plugin.MODELS_MODULE
    assert fake_vllm.models["Qwen3ForCausalLM"].module_name == "someone_else.models"
    assert "left as they are: Qwen3ForCausalLM (someone_else.models)" in caplog.text
    assert plugin.register() == first and fake_vllm.calls == 3
    plugin._registered = None  # a second plugin load in the same process finds its own classes registered
    assert plugin.register() == first and fake_vllm.calls == 3


def test_register_disabled_touches_nothing(fake_vllm, monkeypatch):
    monkeypatch.setenv("MIRAGE_SERVE_DISABLE", "1")
    assert plugin.register() == [] and fake_vllm.calls == 0


def test_register_never_raises(fake_vllm, monkeypatch, caplog):
    real = fake_vllm.register_model

    def broken(arch, target):
        if arch == "MistralForCausalLM":
            raise RuntimeError("registry is read-only")
        real(arch, target)

    monkeypatch.setattr(fake_vllm, "register_model", broken)
    with caplog.at_level(logging.WARNING, logger="mirage_serve"):
        assert plugin.register() == []
    assert "vLLM plugin not registered (RuntimeError: registry is read-only); vLLM runs unmodified" in caplog.text
    assert fake_vllm.models["LlamaForCausalLM"].module_name == plugin.ARCHITECTURES["LlamaForCausalLM"]  # undone
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails
    assert plugin.register() == []
    assert "vLLM plugin not registered (ModuleNotFoundError" in caplog.text
