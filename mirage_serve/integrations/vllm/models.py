"""vLLM model classes that patch themselves with mirage-serve kernels after loading weights.

Each class subclasses vLLM's own and only adds two things: it remembers the
serving facts the patch needs from the ``VllmConfig`` it is built with (CUDA-graph
batch sizes, LoRA, tensor-parallel size), and it patches the model at the end
of :meth:`load_weights`, so vLLM builds, shards, loads and serves the model as
usual. vLLM imports this module by name (``ModelRegistry`` lazy entries); an
architecture whose vLLM module is missing simply gets no class here.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from mirage_serve.integrations.vllm import ARCHITECTURES
from mirage_serve.integrations.vllm.patch import ServingContext, patch_vllm_model

logger = logging.getLogger(__name__)


def _serving_context(vllm_config: Any) -> ServingContext:
    compilation = getattr(vllm_config, "compilation_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    return ServingContext(
        padded_sizes=tuple(int(s) for s in (getattr(compilation, "cudagraph_capture_sizes", None) or ())),
        lora=getattr(vllm_config, "lora_config", None) is not None,
        tensor_parallel=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
    )


class _PatchAfterLoad:
    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        try:
            self._mirage_serve_context = _serving_context(vllm_config)
        except Exception as e:  # unknown config layout: patch with defaults
            logger.warning("mirage-serve: could not read vLLM's config (%s: %s); using default batch buckets", type(e).__name__, e)
            self._mirage_serve_context = ServingContext()

    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        try:
            patch_vllm_model(self, context=self._mirage_serve_context)
        except Exception as e:  # a failed patch leaves the model as vLLM built it
            logger.warning("mirage-serve: patching failed (%s: %s); the model runs unmodified", type(e).__name__, e)
        return loaded


def _subclass(arch: str, vllm_module: str) -> type:
    base = getattr(importlib.import_module(vllm_module), arch)
    return type(f"Mirage{arch}", (_PatchAfterLoad, base),
                {"__module__": __name__, "__qualname__": f"Mirage{arch}",
                 "__doc__": f"vLLM's {arch}, patched with mirage-serve kernels after its weights are loaded."})


for _arch, _module in ARCHITECTURES.items():
    try:
        globals()[f"Mirage{_arch}"] = _subclass(_arch, _module)
    except (ImportError, AttributeError) as _e:
        logger.info("mirage-serve: %s not available in this vLLM (%s); it runs unmodified", _arch, _e)
