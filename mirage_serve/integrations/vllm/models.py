"""vLLM model classes that patch themselves with mirage-serve kernels after loading weights.

Each class subclasses vLLM's own and only adds :meth:`load_weights`'s epilogue,
so vLLM builds, shards and serves the model as usual.
"""

from __future__ import annotations

import logging

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from mirage_serve.integrations.vllm.patch import patch_vllm_model

logger = logging.getLogger(__name__)


class _PatchAfterLoad:
    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        try:
            patch_vllm_model(self)
        except Exception as e:  # a failed patch leaves the model as vLLM built it
            logger.warning("mirage-serve: patching failed (%s: %s); the model runs unmodified", type(e).__name__, e)
        return loaded


class MirageLlamaForCausalLM(_PatchAfterLoad, LlamaForCausalLM):
    pass


class MirageMistralForCausalLM(_PatchAfterLoad, MistralForCausalLM):
    pass


class MirageQwen2ForCausalLM(_PatchAfterLoad, Qwen2ForCausalLM):
    pass


class MirageQwen3ForCausalLM(_PatchAfterLoad, Qwen3ForCausalLM):
    pass
