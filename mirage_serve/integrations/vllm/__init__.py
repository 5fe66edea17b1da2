"""The vLLM plugin: mirage-serve's kernel cache inside vLLM, enabled by installing the package.

vLLM calls :func:`register` (entry point group ``vllm.general_plugins``) in every
process it starts. Registration is idempotent and cheap: it only tells vLLM's
``ModelRegistry`` to build the supported architectures from subclasses (in
:mod:`mirage_serve.integrations.vllm.models`) that patch the model right after
its weights are loaded. Any failure logs a warning and leaves vLLM as it was.

Why a model-class override rather than ``CustomOp.register_oot`` or an FX pass:
the fusion crosses a module boundary (RMSNorm → QKV / gate-up projection), which
an out-of-tree op for one layer cannot see, and an FX pattern would have to match
vLLM's internal IR ops, which change from release to release. The override swaps
two modules per site — the norm becomes the fused add→RMSNorm→linear, the
projection it fed becomes a pass-through — and leaves vLLM's forward code as is.

``MIRAGE_SERVE_DISABLE=1`` turns the plugin off; ``MIRAGE_SERVE_CACHE`` points at
the kernel cache.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# vLLM architecture name -> our subclass (imported lazily by vLLM, by string)
ARCHITECTURES = {
    "LlamaForCausalLM": "mirage_serve.integrations.vllm.models:MirageLlamaForCausalLM",
    "MistralForCausalLM": "mirage_serve.integrations.vllm.models:MirageMistralForCausalLM",
    "Qwen2ForCausalLM": "mirage_serve.integrations.vllm.models:MirageQwen2ForCausalLM",
    "Qwen3ForCausalLM": "mirage_serve.integrations.vllm.models:MirageQwen3ForCausalLM",
}

_registered = False


def disabled() -> bool:
    return os.environ.get("MIRAGE_SERVE_DISABLE", "0") not in ("", "0", "false", "False")


def _log_to_stderr() -> None:
    """vLLM configures only its own logger: give ours a handler so the start-up report is seen."""
    lg = logging.getLogger("mirage_serve")
    if not lg.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s mirage-serve %(name)s: %(message)s"))
        lg.addHandler(h)
        lg.setLevel(logging.INFO)


def register() -> None:
    """Entry point for ``vllm.general_plugins``: never raises."""
    global _registered
    if _registered:
        return
    if disabled():
        logger.info("mirage-serve: vLLM plugin disabled by MIRAGE_SERVE_DISABLE")
        _registered = True
        return
    try:
        from vllm import ModelRegistry

        for arch, target in ARCHITECTURES.items():
            ModelRegistry.register_model(arch, target)
        _registered = True
        _log_to_stderr()
        logger.info("mirage-serve: vLLM plugin registered for %s; other architectures run unmodified", ", ".join(ARCHITECTURES))
    except Exception as e:  # the plugin must never break vLLM
        logger.warning("mirage-serve: vLLM plugin not registered (%s: %s); vLLM runs unmodified", type(e).__name__, e)
