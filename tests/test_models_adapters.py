"""Adapters against tiny random transformers models of each architecture."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

from mirage_serve.models import AdapterError, LoraSpec, adapter_for_config, get_adapter, supported_model_types  # noqa: E402
from mirage_serve.specs import SPECS, build_spec  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 256}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"num_key_value_heads": 2}),
}


def tiny(arch: str):
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    config = cfg_cls(**{**TINY, **extra})
    return config, model_cls(config).eval()


def test_every_registered_architecture_is_tested():
    assert set(supported_model_types()) == set(ARCHS)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_sites_exist_with_the_right_weight_shapes(arch):
    config, model = tiny(arch)
    adapter = adapter_for_config(config)
    assert adapter.model_type == arch
    modules = dict(model.named_modules())
    expected = adapter.expected_weight_shapes(config)
    assert len(expected) >= 6 * config.num_hidden_layers
    for path, shape in expected.items():
        assert path in modules, f"{arch}: {path} not in the model"
        assert tuple(modules[path].weight.shape) == shape, path
    plan = adapter.plan(config, [1, 4])
    assert plan.subgraphs
    for sg in plan.subgraphs:
        assert sg.sites and all(s in modules for s in sg.sites), (sg.role, sg.sites)
        assert [p for g in sg.groups for p in g] == sg.sites
    # the norm's eps attribute the adapter names exists and equals the config's eps
    norm = modules[f"model.layers.0.{adapter.input_norm}"]
    assert getattr(norm, adapter.norm_eps_attr) == pytest.approx(plan.arch.eps)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_subgraph_dims_agree_with_live_modules(arch):
    config, model = tiny(arch)
    adapter = adapter_for_config(config)
    modules = dict(model.named_modules())
    plan = adapter.plan(config, [1, 2, 8])
    roles = {sg.role for sg in plan.subgraphs}
    assert {"attn_norm_qkv", "mlp_norm_gate_up", "residual_attn_norm_qkv", "residual_mlp_norm_gate_up",
            "gated_mlp", "attention_decode"} <= roles
    attn = modules["model.layers.0.self_attn"]
    for sg in plan.subgraphs:
        assert sg.dims["batch"] in (1, 2, 8)
        if sg.spec_name in ("rmsnorm_linear", "add_rmsnorm_linear"):
            for group in sg.groups:
                norm, *linears = (modules[p] for p in group)
                assert sg.dims["hidden"] == norm.weight.shape[0]
                assert sg.dims["out"] == sum(lin.weight.shape[0] for lin in linears)
                assert all(lin.weight.shape[1] == sg.dims["hidden"] for lin in linears)
                assert sg.options["eps"] == pytest.approx(getattr(norm, adapter.norm_eps_attr))
        elif sg.spec_name == "gated_mlp":
            rows = sum(modules[p].weight.shape[0] for p in sg.groups[0])
            assert 2 * sg.dims["intermediate"] == rows
            assert modules[sg.groups[0][0].rsplit(".", 1)[0] + ".down_proj"].weight.shape[1] == sg.dims["intermediate"]
        elif sg.spec_name == "attention_decode":
            assert sg.dims["head_dim"] == attn.head_dim
            assert sg.dims["q_heads"] == config.num_attention_heads
            assert sg.dims["kv_heads"] == config.num_key_value_heads
            assert sg.dims["q_heads"] // sg.dims["kv_heads"] == attn.num_key_value_groups
            assert sg.dims["kv_len"] <= config.max_position_embeddings
        # every subgraph builds into a valid spec graph
        graph = build_spec(sg.spec_name, sg.dims, "float32", **sg.options)
        assert graph.info
    # residual add before layer 0's input norm does not exist
    res = next(sg for sg in plan.subgraphs if sg.role == "residual_attn_norm_qkv")
    assert not any(p.startswith("model.layers.0.") for p in res.sites)


def test_kv_len_buckets_are_capped_by_context_and_sliding_window():
    config, _ = tiny("mistral")  # max_position_embeddings 512, sliding window 256
    plan = get_adapter("mistral").plan(config, [1])
    assert plan.kv_len_buckets == [256]
    assert any("sliding window" in n for n in plan.notes)
    big = get_adapter("llama").plan({**transformers.LlamaConfig(**TINY).to_dict(), "max_position_embeddings": 131072}, [1])
    assert big.kv_len_buckets == [1024, 4096, 16384]
    mid = get_adapter("llama").plan({**transformers.LlamaConfig(**TINY).to_dict(), "max_position_embeddings": 8192}, [1])
    assert mid.kv_len_buckets == [1024, 4096, 8192]
    # a window that no tile divides (Phi-3-mini's 2047) gets the next multiple of 64: its kernel serves 2047 too
    odd = get_adapter("llama").plan({**transformers.LlamaConfig(**TINY).to_dict(), "max_position_embeddings": 2047}, [1])
    assert odd.kv_len_buckets == [1024, 2048]


def test_qwen3_qk_norms_are_recorded_as_unfused():
    config, model = tiny("qwen3")
    plan = get_adapter("qwen3").plan(config, [1])
    modules = dict(model.named_modules())
    assert modules["model.layers.0.self_attn.q_norm"].weight.shape == (32,)
    for sg in plan.subgraphs:
        if sg.role in ("attn_norm_qkv", "residual_attn_norm_qkv"):
            assert any("q_norm" in u and "not fused" in u for u in sg.unfused)
            assert sg.dims["out"] == (4 + 2 * 2) * 32  # head_dim comes from the config, not hidden / heads
    assert any("q_norm" in n for n in plan.notes)


def test_qwen2_qkv_biases_are_recorded_as_unfused():
    config, model = tiny("qwen2")
    modules = dict(model.named_modules())
    assert modules["model.layers.0.self_attn.q_proj"].bias is not None
    sg = next(s for s in get_adapter("qwen2").subgraphs(config, [1]) if s.role == "attn_norm_qkv")
    assert len([u for u in sg.unfused if "bias" in u]) == 3


def test_phi3_fused_modules_split_gate_first():
    config, model = tiny("phi3")
    x = torch.randn(3, config.hidden_size)
    mlp = dict(model.named_modules())["model.layers.0.mlp"]
    w = mlp.gate_up_proj.weight
    inter = config.intermediate_size
    expected = torch.nn.functional.silu(x @ w[:inter].T) * (x @ w[inter:].T)
    assert torch.allclose(expected @ mlp.down_proj.weight.T, mlp(x), atol=1e-5)
    sg = next(s for s in get_adapter("phi3").subgraphs(config, [1]) if s.role == "gated_mlp")
    assert sg.dims["intermediate"] == inter and sg.groups[0] == ("model.layers.0.mlp.gate_up_proj",)


def test_tensor_parallel_divides_heads_and_intermediate():
    config, _ = tiny("llama")
    plan = get_adapter("llama").plan(config, [1], tensor_parallel=2)
    by_role = {sg.role: sg for sg in plan.subgraphs}
    assert by_role["attn_norm_qkv"].dims["out"] == (2 + 2 * 1) * 16
    assert by_role["mlp_norm_gate_up"].dims["out"] == 96
    assert by_role["gated_mlp"].dims["intermediate"] == 48
    att = by_role["attention_decode"].dims
    assert (att["q_heads"], att["kv_heads"]) == (2, 1)
    with pytest.raises(AdapterError, match="tensor_parallel=4 does not divide num_key_value_heads=2"):
        get_adapter("llama").plan(config, [1], tensor_parallel=4)
    with pytest.raises(AdapterError, match="tensor_parallel must be >= 1"):
        get_adapter("llama").plan(config, [1], tensor_parallel=0)


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(AdapterError) as e:
        get_adapter("gpt2")
    for t in ARCHS:
        assert t in str(e.value)
    with pytest.raises(AdapterError, match="model_type"):
        adapter_for_config({"hidden_size": 8})
    with pytest.raises(AdapterError, match="hidden_size"):
        get_adapter("llama").plan({"model_type": "llama", "num_attention_heads": 4}, [1])


def test_config_dict_and_pretrained_config_agree(tmp_path):
    config, _ = tiny("llama")
    config.save_pretrained(tmp_path)
    import json

    as_dict = json.loads((tmp_path / "config.json").read_text())
    a = [s.to_dict() for s in get_adapter("llama").subgraphs(config, [1, 2])]
    b = [s.to_dict() for s in get_adapter("llama").subgraphs(as_dict, [1, 2])]
    assert a == b
    # dtype defaults to bfloat16 when the config names none, and follows torch_dtype otherwise
    assert {s["dtype"] for s in a} == {"bfloat16"}
    assert {s.dtype for s in get_adapter("llama").subgraphs({**as_dict, "torch_dtype": "float16"}, [1])} == {"float16"}


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_lora_subgraphs_match_peft_modules(arch, tmp_path):
    peft = pytest.importorskip("peft")
    config, model = tiny(arch)
    targets = ["q_proj", "v_proj", "down_proj"] if arch == "llama" else ["qkv_proj", "down_proj"]
    lora_cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    peft_model = peft.get_peft_model(model, lora_cfg)
    lora_cfg.save_pretrained(tmp_path)
    modules = {k.removeprefix("base_model.model."): v for k, v in peft_model.named_modules()}
    for source in (lora_cfg, tmp_path, tmp_path / "adapter_config.json"):
        plan = get_adapter(arch).plan(config, [2], lora=source)
        loras = [s for s in plan.subgraphs if s.spec_name == "lora_linear"]
        assert {s.role for s in loras} == {f"lora:{t}" for t in targets}
        covered = set()
        for sg in loras:
            assert sg.options["scale"] == pytest.approx(2.0)
            for path in sg.sites:
                mod = modules[path]
                assert sg.dims["rank"] == mod.lora_A["default"].weight.shape[0]
                assert sg.dims["in"] == mod.lora_A["default"].weight.shape[1]
                assert sg.dims["out"] == mod.lora_B["default"].weight.shape[0]
                covered.add(path)
        lora_paths = {k for k, v in modules.items() if hasattr(v, "lora_A") and "lora_" not in k.rsplit(".", 1)[-1]}
        assert covered == lora_paths


def test_lora_config_errors(tmp_path):
    config, _ = tiny("llama")
    with pytest.raises(AdapterError, match="adapter_config.json"):
        get_adapter("llama").plan(config, [1], lora=tmp_path / "nothing")
    with pytest.raises(AdapterError, match="match no projection"):
        get_adapter("llama").plan(config, [1], lora={"r": 4, "target_modules": ["c_attn"]})
    spec = LoraSpec.load({"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "use_rslora": True})
    assert spec.rank_and_scale("model.layers.0.self_attn.q_proj") == (8, pytest.approx(16 / 8**0.5))
    plan = get_adapter("llama").plan(config, [1], lora=spec)
    assert len({s.role for s in plan.subgraphs if s.spec_name == "lora_linear"}) == 7


def test_specs_cover_every_emitted_spec():
    config, _ = tiny("llama")
    names = {s.spec_name for s in get_adapter("llama").subgraphs(config, [1], lora={"r": 2, "target_modules": ["q_proj"]})}
    assert names <= set(SPECS)
