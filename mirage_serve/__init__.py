"""mirage-serve: a superoptimizer for the kernels of LLM inference.

``mirage_serve.from_pretrained(model_id)`` loads a transformers model patched with
verified kernels from the kernel cache; ``mirage_serve.patch_model(model)`` patches
one you have; ``mirage_serve.generate(model, input_ids, n)`` decodes greedily with a
static KV cache and a captured decode step.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "from_pretrained": "mirage_serve.integrations.hf",
    "patch_model": "mirage_serve.integrations.hf",
    "PatchReport": "mirage_serve.integrations.hf",
    "generate": "mirage_serve.integrations.decode",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mirage_serve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["PatchReport", "__version__", "from_pretrained", "generate", "patch_model"]
