"""What every model adapter shares: the fusable subgraphs of a decoder layer, their dims and sites.

An adapter reads a transformers config (a ``PretrainedConfig`` or its ``config.json`` dict; no
weights) and lists the subgraphs worth superoptimizing, each as a named spec of
``mirage_serve.specs`` with concrete dims per batch bucket, plus where those operators live in
the transformers module tree so the integration can patch them later. Nothing here imports
transformers: configs and LoRA configs are read by duck typing.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
# Decode attention kernels are shape-specialised in kv_len; these buckets are capped at the
# model's usable context (max_position_embeddings, or its sliding window when one is active).
DEFAULT_KV_LEN_BUCKETS: tuple[int, ...] = (1024, 4096, 16384)
# The cap is rounded up to a multiple of this (a kernel of a bucket serves every shorter kv_len): a
# window such as Phi-3's 2047 gets the bucket 2048, whose KV extent the search can split into tiles.
KV_LEN_CAP_ALIGN = 64
DEFAULT_DTYPE = "bfloat16"
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


class AdapterError(ValueError):
    """A config the adapter cannot map (missing field, indivisible tensor-parallel split, ...)."""


@dataclass
class Subgraph:
    """One fusable subgraph of a model at one shape.

    ``spec_name`` and ``dims`` name a spec of :mod:`mirage_serve.specs`; ``options`` are the
    spec's extra build arguments (RMSNorm eps, LoRA scale) that change the function computed;
    ``role`` says which part of the layer it is; ``sites`` lists every module path it covers
    (flattened), ``groups`` the same paths per occurrence in data-flow order; ``unfused`` names
    adjacent steps the kernel does not compute and a patch must keep running (biases, Qwen3's
    q/k norms).
    """

    spec_name: str
    dims: dict[str, int]
    role: str
    sites: list[str]
    dtype: str = DEFAULT_DTYPE
    options: dict[str, float] = field(default_factory=dict)
    groups: list[tuple[str, ...]] = field(default_factory=list)
    unfused: list[str] = field(default_factory=list)

    def signature(self) -> tuple:
        """What makes two subgraphs the same kernel: spec, dims, dtype and spec options."""
        return (self.spec_name, tuple(sorted(self.dims.items())), self.dtype, tuple(sorted(self.options.items())))

    def describe(self) -> str:
        """Short human-readable form, e.g. ``rmsnorm_linear(batch=1,hidden=4096,out=6144)``."""
        return f"{self.spec_name}({','.join(f'{k}={v}' for k, v in self.dims.items())})"

    def build_spec(self):
        """The reference kernel graph of this subgraph (``mirage_serve.specs.build_spec``)."""
        from mirage_serve.specs import build_spec

        return build_spec(self.spec_name, self.dims, self.dtype, **self.options)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec_name,
            "dims": dict(self.dims),
            "dtype": self.dtype,
            "options": dict(self.options),
            "role": self.role,
            "sites": list(self.sites),
            "unfused": list(self.unfused),
        }


@dataclass(frozen=True)
class Exclusion:
    """A subgraph the adapter deliberately does not emit, and why (correctness over coverage)."""

    role: str
    reason: str


@dataclass
class ArchDims:
    """The few numbers of a decoder-only config that kernel shapes depend on."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    max_positions: int
    sliding_window: int | None
    dtype: str
    hidden_act: str
    attention_bias: bool
    mlp_bias: bool


@dataclass
class LoraSpec:
    """The parts of a peft LoRA config that kernel shapes depend on."""

    r: int
    alpha: float
    target_modules: list[str] | str
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, source: Any) -> LoraSpec:
        """From a peft ``LoraConfig``, a dict, an ``adapter_config.json`` path or its directory."""
        if isinstance(source, LoraSpec):
            return source
        if isinstance(source, str | os.PathLike):
            path = Path(source)
            if path.is_dir():
                path = path / "adapter_config.json"
            if not path.is_file():
                raise AdapterError(f"LoRA config {str(source)!r} not found: expected adapter_config.json or a directory holding one")
            try:
                source = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise AdapterError(f"LoRA config {path} is not valid JSON: {e}") from e
        if not isinstance(source, Mapping):
            source = {k: getattr(source, k) for k in ("r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern", "peft_type")
                      if hasattr(source, k)}
        peft_type = source.get("peft_type")
        if peft_type is not None and str(getattr(peft_type, "value", peft_type)).upper() != "LORA":
            raise AdapterError(f"adapter config has peft_type={peft_type!r}; only LORA adapters map to lora_linear")
        if "r" not in source or not source.get("target_modules"):
            raise AdapterError("LoRA config needs 'r' and 'target_modules' (as in peft's adapter_config.json)")
        targets = source["target_modules"]
        if not isinstance(targets, str):
            targets = sorted(targets)
        r = int(source["r"])
        return cls(
            r=r,
            alpha=float(source.get("lora_alpha") or r),
            target_modules=targets,
            use_rslora=bool(source.get("use_rslora", False)),
            rank_pattern=dict(source.get("rank_pattern") or {}),
            alpha_pattern=dict(source.get("alpha_pattern") or {}),
        )

    def targets(self, path: str, name: str, all_linear: bool) -> bool:
        """Does peft put a LoRA on the module at ``path`` (short name ``name``)? ``all_linear`` excludes lm_head."""
        if isinstance(self.target_modules, str):
            if self.target_modules == "all-linear":
                return all_linear
            return re.fullmatch(self.target_modules, path) is not None
        return name in self.target_modules or path in self.target_modules

    def rank_and_scale(self, path: str) -> tuple[int, float]:
        """The rank and scaling peft uses for this module (rank_pattern/alpha_pattern keys match a path suffix)."""
        r, alpha = self.r, self.alpha
        for key, value in self.rank_pattern.items():
            if re.search(rf"(^|\.){key}$", path):
                r = int(value)
        for key, value in self.alpha_pattern.items():
            if re.search(rf"(^|\.){key}$", path):
                alpha = float(value)
        return r, (alpha / r**0.5 if self.use_rslora else alpha / r)


@dataclass(frozen=True)
class Linear:
    """One projection of a decoder layer: its module name, weight shape [out, in], and TP split."""

    name: str
    out: int
    inp: int
    parallel: str  # "column" (output sharded) or "row" (input sharded)
    bias: bool = False

    def shard(self, tp: int) -> tuple[int, int]:
        return (self.out // tp, self.inp) if self.parallel == "column" else (self.out, self.inp // tp)


@dataclass
class AdapterPlan:
    """Everything an adapter says about one model: its subgraphs, exclusions and notes."""

    model_type: str
    arch: ArchDims
    subgraphs: list[Subgraph]
    excluded: list[Exclusion]
    notes: list[str]
    kv_len_buckets: list[int]


def config_to_dict(config: Any) -> dict[str, Any]:
    """A transformers ``PretrainedConfig`` (or anything with ``to_dict``) or a mapping, as a plain dict."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    raise AdapterError(f"expected a transformers config or a config.json dict, got {type(config).__name__}")


def normalize_dtype(value: Any) -> str:
    """Config dtype (``torch_dtype``/``dtype``: "bfloat16", "torch.float16", a torch.dtype) as a μGraph dtype name."""
    if value is None or value == "auto":
        return DEFAULT_DTYPE
    name = str(value).removeprefix("torch.")
    name = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name)
    if name not in SUPPORTED_DTYPES:
        raise AdapterError(f"dtype {value!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)} (e.g. --dtype bfloat16)")
    return name


def kv_len_buckets(arch: ArchDims, buckets: Iterable[int] = DEFAULT_KV_LEN_BUCKETS) -> list[int]:
    """kv_len buckets for decode attention: each default bucket capped at the usable context length,
    rounded up to a multiple of :data:`KV_LEN_CAP_ALIGN`."""
    cap = arch.max_positions
    if arch.sliding_window:
        cap = min(cap, arch.sliding_window)
    cap = -(-cap // KV_LEN_CAP_ALIGN) * KV_LEN_CAP_ALIGN
    return sorted({min(int(b), cap) for b in buckets})


def parse_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``, with a clear error on anything else."""
    try:
        sizes = [int(p) for p in text.split(",") if p.strip()]
    except ValueError as e:
        raise AdapterError(f"expected comma-separated positive integers such as 1,2,4,8, got {text!r}") from e
    if not sizes or any(s < 1 for s in sizes):
        raise AdapterError(f"expected comma-separated positive integers such as 1,2,4,8, got {text!r}")
    return sorted(set(sizes))


class ModelAdapter:
    """Maps one architecture family's config to subgraphs and module sites.

    Subclasses set the class attributes below and may override :meth:`arch_dims`,
    :meth:`linears`, :meth:`exclusions` and :meth:`notes`. Module paths are relative to the
    ``*ForCausalLM`` model (``model.layers.{i}...``).
    """

    model_type: ClassVar[str] = ""
    family: ClassVar[str] = ""
    layers_path: ClassVar[str] = "model.layers"
    input_norm: ClassVar[str] = "input_layernorm"
    post_attention_norm: ClassVar[str] = "post_attention_layernorm"
    attention: ClassVar[str] = "self_attn"
    mlp: ClassVar[str] = "mlp"
    norm_eps_attr: ClassVar[str] = "variance_epsilon"
    # names (relative to the layer) of the projections that read the attention / MLP norm's output
    qkv_modules: ClassVar[tuple[str, ...]] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    gate_up_modules: ClassVar[tuple[str, ...]] = ("mlp.gate_proj", "mlp.up_proj")
    o_module: ClassVar[str] = "self_attn.o_proj"
    down_module: ClassVar[str] = "mlp.down_proj"

    # ---- config -> numbers -------------------------------------------------------------
    def arch_dims(self, config: Any) -> ArchDims:
        """Read the kernel-relevant numbers from a config, with errors naming the missing field."""
        c = config_to_dict(config)
        model_type = c.get("model_type")
        if model_type != self.model_type:
            raise AdapterError(f"{type(self).__name__} handles model_type {self.model_type!r}, got {model_type!r}; use get_adapter({model_type!r})")

        def need(key: str) -> Any:
            if c.get(key) is None:
                raise AdapterError(f"{self.model_type} config lacks {key!r}; is this a complete config.json?")
            return c[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise AdapterError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        return ArchDims(
            model_type=self.model_type,
            hidden=hidden,
            intermediate=int(need("intermediate_size")),
            layers=int(need("num_hidden_layers")),
            q_heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            eps=float(c.get("rms_norm_eps") or 1e-6),
            max_positions=int(c.get("max_position_embeddings") or 4096),
            sliding_window=self.sliding_window(c),
            dtype=normalize_dtype(c.get("torch_dtype") or c.get("dtype")),
            hidden_act=str(c.get("hidden_act") or "silu"),
            attention_bias=bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
        )

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        """The sliding window the attention actually uses (None: full attention)."""
        w = config.get("sliding_window")
        return int(w) if w else None

    def linears(self, arch: ArchDims) -> dict[str, Linear]:
        """Every projection of one layer, keyed by its path relative to the layer."""
        q, kv = arch.q_heads * arch.head_dim, arch.kv_heads * arch.head_dim
        return {
            "self_attn.q_proj": Linear("q_proj", q, arch.hidden, "column", arch.attention_bias),
            "self_attn.k_proj": Linear("k_proj", kv, arch.hidden, "column", arch.attention_bias),
            "self_attn.v_proj": Linear("v_proj", kv, arch.hidden, "column", arch.attention_bias),
            "self_attn.o_proj": Linear("o_proj", arch.hidden, q, "row", arch.attention_bias),
            "mlp.gate_proj": Linear("gate_proj", arch.intermediate, arch.hidden, "column", arch.mlp_bias),
            "mlp.up_proj": Linear("up_proj", arch.intermediate, arch.hidden, "column", arch.mlp_bias),
            "mlp.down_proj": Linear("down_proj", arch.hidden, arch.intermediate, "row", arch.mlp_bias),
        }

    def exclusions(self, arch: ArchDims) -> list[Exclusion]:
        """Subgraphs of this family that are deliberately not emitted, with the reason."""
        out = []
        if arch.hidden_act not in ("silu", "swish"):
            out.append(Exclusion("gated_mlp", f"hidden_act={arch.hidden_act!r}: the gated_mlp spec computes silu(gate) * up only"))
        return out

    def notes(self, arch: ArchDims) -> list[str]:
        """Facts a patch must respect that are not visible in the subgraph list."""
        return []

    def qkv_unfused(self, arch: ArchDims) -> list[str]:
        """Steps right after the fused QKV projection that the kernel leaves to the model's code."""
        ls = self.linears(arch)
        return [f"bias add of {m} (the spec has no bias)" for m in self.qkv_modules if ls[m].bias]

    def gate_up_unfused(self, arch: ArchDims) -> list[str]:
        ls = self.linears(arch)
        return [f"bias add of {m} (the spec has no bias)" for m in self.gate_up_modules if ls[m].bias]

    # ---- module tree -------------------------------------------------------------------
    def layer(self, i: int) -> str:
        return f"{self.layers_path}.{i}"

    def expected_weight_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """Every module path an adapter names, with its weight shape in the unsharded model."""
        arch = self.arch_dims(config)
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(arch.layers):
            base = self.layer(i)
            shapes[f"{base}.{self.input_norm}"] = (arch.hidden,)
            shapes[f"{base}.{self.post_attention_norm}"] = (arch.hidden,)
            for rel, lin in self.linears(arch).items():
                shapes[f"{base}.{rel}"] = (lin.out, lin.inp)
        return shapes

    # ---- subgraphs ---------------------------------------------------------------------
    def plan(
        self,
        config: Any,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        *,
        tensor_parallel: int = 1,
        lora: Any = None,
        kv_lens: Iterable[int] = DEFAULT_KV_LEN_BUCKETS,
        dtype: str | None = None,
    ) -> AdapterPlan:
        """All subgraphs of the model for every batch bucket (rows = batch for decode), per TP shard."""
        arch = self.arch_dims(config)
        if dtype is not None:
            arch.dtype = normalize_dtype(dtype)
        tp = int(tensor_parallel)
        if tp < 1:
            raise AdapterError(f"tensor_parallel must be >= 1, got {tp}")
        for what, n in (("num_attention_heads", arch.q_heads), ("num_key_value_heads", arch.kv_heads), ("intermediate_size", arch.intermediate)):
            if n % tp:
                raise AdapterError(f"tensor_parallel={tp} does not divide {what}={n}; pick a tensor-parallel size that divides it")
        if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
            raise AdapterError(f"batch sizes must be positive integers, got {list(batch_sizes)}")
        lora_spec = LoraSpec.load(lora) if lora is not None else None
        excluded = self.exclusions(arch)
        skip = {e.role for e in excluded}
        buckets = kv_len_buckets(arch, kv_lens)
        linears = self.linears(arch)
        qkv_out = sum(linears[m].shard(tp)[0] for m in self.qkv_modules)
        gate_up_out = sum(linears[m].shard(tp)[0] for m in self.gate_up_modules)
        layers = range(arch.layers)
        norm_opts = {"eps": arch.eps}

        def groups(*parts: str, start: int = 0) -> list[tuple[str, ...]]:
            return [tuple(f"{self.layer(i)}.{p}" for p in parts) for i in layers if i >= start]

        templates: list[tuple[str, str, dict[str, int], dict[str, float], list[tuple[str, ...]], list[str]]] = [
            ("rmsnorm_linear", "attn_norm_qkv", {"hidden": arch.hidden, "out": qkv_out}, norm_opts,
             groups(self.input_norm, *self.qkv_modules), self.qkv_unfused(arch)),
            ("rmsnorm_linear", "mlp_norm_gate_up", {"hidden": arch.hidden, "out": gate_up_out}, norm_opts,
             groups(self.post_attention_norm, *self.gate_up_modules), self.gate_up_unfused(arch)),
            # the residual add before layer i's input norm closes layer i-1, so layer 0 has none
            ("add_rmsnorm_linear", "residual_attn_norm_qkv", {"hidden": arch.hidden, "out": qkv_out}, norm_opts,
             groups(self.input_norm, *self.qkv_modules, start=1), self.qkv_unfused(arch)),
            ("add_rmsnorm_linear", "residual_mlp_norm_gate_up", {"hidden": arch.hidden, "out": gate_up_out}, norm_opts,
             groups(self.post_attention_norm, *self.gate_up_modules), self.gate_up_unfused(arch)),
            ("gated_mlp", "gated_mlp", {"hidden": arch.hidden, "intermediate": arch.intermediate // tp}, {},
             groups(*self.gate_up_modules), self.gate_up_unfused(arch)),
        ]
        subgraphs: list[Subgraph] = []
        for batch in sorted({int(b) for b in batch_sizes}):
            for spec, role, dims, opts, grps, unfused in templates:
                if role in skip or not grps:
                    continue
                subgraphs.append(self._subgraph(spec, role, {"batch": batch, **dims}, arch.dtype, opts, grps, unfused))
            if "attention_decode" not in skip:
                for kv_len in buckets:
                    dims = {"batch": batch, "q_heads": arch.q_heads // tp, "kv_heads": arch.kv_heads // tp,
                            "head_dim": arch.head_dim, "kv_len": kv_len}
                    subgraphs.append(self._subgraph("attention_decode", "attention_decode", dims, arch.dtype, {},
                                                    groups(self.attention), []))
            if lora_spec is not None:
                subgraphs.extend(self._lora_subgraphs(arch, lora_spec, batch, tp, linears))
        if lora_spec is not None and not any(s.spec_name == "lora_linear" for s in subgraphs):
            raise AdapterError(f"LoRA target_modules={lora_spec.target_modules!r} match no projection of {self.model_type}; "
                               f"its projections are {', '.join(lin.name for lin in linears.values())}")
        return AdapterPlan(self.model_type, arch, subgraphs, excluded, self.notes(arch), buckets)

    def subgraphs(self, config: Any, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, **kwargs: Any) -> list[Subgraph]:
        """The subgraphs of :meth:`plan` (same arguments)."""
        return self.plan(config, batch_sizes, **kwargs).subgraphs

    def _subgraph(self, spec: str, role: str, dims: dict[str, int], dtype: str, options: dict[str, float],
                  grps: list[tuple[str, ...]], unfused: list[str]) -> Subgraph:
        return Subgraph(spec, dims, role, [p for g in grps for p in g], dtype, dict(options), list(grps), list(unfused))

    def _lora_subgraphs(self, arch: ArchDims, lora: LoraSpec, batch: int, tp: int, linears: dict[str, Linear]) -> list[Subgraph]:
        out: dict[tuple, Subgraph] = {}
        for rel, lin in linears.items():
            for i in range(arch.layers):
                path = f"{self.layer(i)}.{rel}"
                if not lora.targets(path, lin.name, all_linear=True):
                    continue
                rank, scale = lora.rank_and_scale(path)
                o, k = lin.shard(tp)
                sg = self._subgraph("lora_linear", f"lora:{lin.name}", {"batch": batch, "in": k, "out": o, "rank": rank},
                                    arch.dtype, {"scale": scale}, [(path,)],
                                    [f"bias add of {rel} (the spec has no bias)"] if lin.bias else [])
                key = (sg.role, sg.signature())
                if key in out:
                    out[key].sites.append(path)
                    out[key].groups.append((path,))
                else:
                    out[key] = sg
        return list(out.values())
