"""Offline model-id resolution: local directory, HF cache layout, bundled configs, and the error."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mirage_serve.model_ids import (  # noqa: E402
    DEFAULT_MODEL_ID,
    ModelNotFoundError,
    bundled_model_ids,
    hf_cache_dirs,
    resolve_config,
)
from mirage_serve.models import adapter_for_config  # noqa: E402

REQUIRED_BUNDLED = {
    "meta-llama/Llama-3.1-8B-Instruct",
    "meta-llama/Llama-3.2-1B-Instruct",
    "Qwen/Qwen2.5-7B-Instruct",
    "Qwen/Qwen3-8B",
    "mistralai/Mistral-7B-Instruct-v0.3",
    "microsoft/Phi-3-mini-4k-instruct",
}


@pytest.fixture()
def isolated_hf(tmp_path, monkeypatch):
    """Point every HF cache variable into tmp so the real cache cannot leak into a test."""
    hub = tmp_path / "hf" / "hub"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    return hub


def fake_snapshot(hub, repo_id, config, rev="0123abcd", ref=True):
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(rev)
    return snap / "config.json"


def test_local_directory(tmp_path, isolated_hf):
    import transformers

    transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=1).save_pretrained(tmp_path / "m")
    config, source = resolve_config(str(tmp_path / "m"))
    assert config["model_type"] == "llama" and config["hidden_size"] == 32
    assert source.startswith("local:") and source.endswith("config.json")
    config2, _ = resolve_config(str(tmp_path / "m" / "config.json"))
    assert config2 == config


def test_hf_cache_with_refs(isolated_hf):
    path = fake_snapshot(isolated_hf, "acme/tiny-llama", {"model_type": "llama", "hidden_size": 48})
    config, source = resolve_config("acme/tiny-llama")
    assert config["hidden_size"] == 48 and source == f"hf-cache:{path}"


def test_hf_cache_without_refs_takes_a_snapshot(isolated_hf):
    path = fake_snapshot(isolated_hf, "acme/pinned", {"model_type": "qwen2", "hidden_size": 40}, ref=False)
    config, source = resolve_config("acme/pinned")
    assert config["hidden_size"] == 40 and source == f"hf-cache:{path}"


def test_hf_hub_cache_variable_wins(tmp_path, isolated_hf, monkeypatch):
    hub = tmp_path / "custom-hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert hf_cache_dirs()[0] == hub
    fake_snapshot(isolated_hf, "acme/both", {"model_type": "llama", "hidden_size": 1})
    fake_snapshot(hub, "acme/both", {"model_type": "llama", "hidden_size": 2})
    assert resolve_config("acme/both")[0]["hidden_size"] == 2


def test_hf_cache_beats_bundled(isolated_hf):
    fake_snapshot(isolated_hf, "Qwen/Qwen3-8B", {"model_type": "qwen3", "hidden_size": 8})
    config, source = resolve_config("Qwen/Qwen3-8B")
    assert source.startswith("hf-cache:") and config["hidden_size"] == 8


def test_bundled_configs_listed_and_mapped(isolated_hf):
    ids = bundled_model_ids()
    assert REQUIRED_BUNDLED <= set(ids)
    assert DEFAULT_MODEL_ID in ids
    for model_id in ids:
        config, source = resolve_config(model_id)
        assert source == f"bundled:{model_id}"
        plan = adapter_for_config(config).plan(config, [1])
        assert plan.arch.dtype == "bfloat16" and plan.subgraphs
    llama8b, _ = resolve_config("meta-llama/Llama-3.1-8B-Instruct")
    assert (llama8b["hidden_size"], llama8b["intermediate_size"], llama8b["num_key_value_heads"], llama8b["num_hidden_layers"]) == (4096, 14336, 8, 32)


def test_missing_id_lists_everything_checked(tmp_path, isolated_hf, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "custom-hub"))
    with pytest.raises(ModelNotFoundError) as e:
        resolve_config("nobody/nothing-7B")
    msg = str(e.value)
    assert str(tmp_path / "custom-hub" / "models--nobody--nothing-7B") in msg
    assert str(isolated_hf / "models--nobody--nothing-7B") in msg
    assert "nobody--nothing-7B.json" in msg and "local path" in msg
    assert "meta-llama/Llama-3.1-8B-Instruct" in msg  # the bundled ids are offered
    with pytest.raises(ModelNotFoundError):
        resolve_config("")


def test_no_network_is_attempted(isolated_hf, monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    fake_snapshot(isolated_hf, "acme/offline", {"model_type": "llama"})
    assert resolve_config("acme/offline")[1].startswith("hf-cache:")
    assert resolve_config("meta-llama/Llama-3.2-1B-Instruct")[1].startswith("bundled:")
    with pytest.raises(ModelNotFoundError):
        resolve_config("acme/absent")
