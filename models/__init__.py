"""Model adapters, one per architecture family, registered by model_type.

``get_adapter(model_type)`` returns the adapter; ``adapter_for_config(config)`` reads the
model_type from a transformers config or config.json dict.
"""

from __future__ import annotations

from typing import Any

from .base import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_KV_LEN_BUCKETS,
    AdapterError,
    AdapterPlan,
    ArchDims,
    Exclusion,
    LoraSpec,
    ModelAdapter,
    Subgraph,
    config_to_dict,
)
from .llama import LlamaAdapter
from .mistral import MistralAdapter
from .phi3 import Phi3Adapter
from .qwen2 import Qwen2Adapter
from .qwen3 import Qwen3Adapter

ADAPTERS: dict[str, type[ModelAdapter]] = {}


def register(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Register an adapter class under its ``model_type``."""
    if not cls.model_type:
        raise ValueError(f"{cls.__name__} has no model_type")
    ADAPTERS[cls.model_type] = cls
    return cls


for _cls in (LlamaAdapter, MistralAdapter, Qwen2Adapter, Qwen3Adapter, Phi3Adapter):
    register(_cls)


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def get_adapter(model_type: str) -> ModelAdapter:
    """The adapter for a transformers ``model_type``; an unknown one gets an error naming the supported ones."""
    cls = ADAPTERS.get(model_type)
    if cls is None:
        listing = ", ".join(f"{t} ({ADAPTERS[t].family})" for t in supported_model_types())
        raise AdapterError(f"no adapter for model_type {model_type!r}; supported architectures: {listing}")
    return cls()


def adapter_for_config(config: Any) -> ModelAdapter:
    """The adapter for a config's ``model_type``."""
    model_type = config_to_dict(config).get("model_type")
    if not model_type:
        raise AdapterError("config has no 'model_type'; pass a transformers config.json of a decoder-only model")
    return get_adapter(str(model_type))


__all__ = [
    "ADAPTERS",
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_KV_LEN_BUCKETS",
    "AdapterError",
    "AdapterPlan",
    "ArchDims",
    "Exclusion",
    "LoraSpec",
    "ModelAdapter",
    "Subgraph",
    "adapter_for_config",
    "get_adapter",
    "register",
    "supported_model_types",
]
