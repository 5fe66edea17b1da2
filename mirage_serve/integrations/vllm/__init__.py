"""The vLLM plugin: mirage-serve's kernel cache inside vLLM, enabled by installing the package.

vLLM calls :func:`register` (entry point group ``vllm.general_plugins``) in every
process it starts. Registration is idempotent and cheap (no model code is
imported): it tells vLLM's ``ModelRegistry`` to build the supported
architectures from subclasses (:mod:`mirage_serve.integrations.vllm.models`)
that patch the model right after its weights are loaded
(:func:`mirage_serve.integrations.vllm.patch.patch_vllm_model`). Any failure
logs a warning and leaves vLLM as it was.

Why a model-class override through ``ModelRegistry`` rather than the other two
extension points vLLM offers:

- ``CustomOp.register_oot`` replaces one op class (``RMSNorm``, a linear method)
  with another. The fusion we want crosses the boundary between two modules
  (RMSNorm → QKV / gate-up projection): an out-of-tree RMSNorm never sees the
  projection's weight, and an out-of-tree linear never sees the norm's input.
- A torch.compile / FX pass would see both, but it must pattern-match vLLM's
  internal graph (its ``vllm.ir`` ops, ``auto_functionalized`` wrappers, the
  custom-op splitting points), which changes from release to release, and it
  does nothing with ``enforce_eager=True`` (the usual mode on CPU).
- The override works on vLLM's own module tree after loading, where the sites
  are found by name, the same way in eager and compiled mode: the norm becomes
  :class:`~mirage_serve.integrations.vllm.patch.FusedNormProjection` (one fused
  (add →) RMSNorm → linear custom op, opaque to torch.compile and capturable
  in CUDA graphs), the projection a pass-through, and vLLM's forward code,
  sharding and weight loading stay as they are.

``MIRAGE_SERVE_DISABLE=1`` turns the plugin off; ``MIRAGE_SERVE_CACHE`` points
at the kernel cache (see :mod:`mirage_serve.cache.store`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

MODELS_MODULE = "mirage_serve.integrations.vllm.models"

# vLLM architecture name -> the vLLM module defining it; ours is models.Mirage<arch>
ARCHITECTURES = {
    "LlamaForCausalLM": "vllm.model_executor.models.llama",
    "MistralForCausalLM": "vllm.model_executor.models.mistral",
    "Qwen2ForCausalLM": "vllm.model_executor.models.qwen2",
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3",
}

_registered: list[str] | None = None


def disabled() -> bool:
    """True when ``MIRAGE_SERVE_DISABLE`` is set to anything but empty/0/false."""
    return os.environ.get("MIRAGE_SERVE_DISABLE", "0").strip().lower() not in ("", "0", "false", "no", "off")


def _log_to_stderr() -> None:
    """vLLM configures only its own logger: give ours a handler so the start-up report is seen."""
    lg = logging.getLogger("mirage_serve")
    if not lg.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s mirage-serve %(name)s: %(message)s"))
        lg.addHandler(h)
        lg.setLevel(logging.INFO)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _registered_module(entry: object) -> str:
    """The module a ModelRegistry entry builds its class from (lazy or imported)."""
    module = getattr(entry, "module_name", None)
    if module is None:
        module = getattr(getattr(entry, "model_cls", None), "__module__", "")
    return str(module)


def register() -> list[str]:
    """Entry point for ``vllm.general_plugins``: never raises. Returns the overridden architectures."""
    global _registered
    if _registered is not None:
        return list(_registered)
    if disabled():
        _registered = []
        with contextlib.suppress(Exception):
            _log_to_stderr()
        logger.info("mirage-serve: vLLM plugin disabled by MIRAGE_SERVE_DISABLE")
        return []
    previous: dict[str, object] = {}
    registry = None
    try:
        _log_to_stderr()
        from vllm import ModelRegistry as registry

        done, left = [], []
        for arch, vllm_module in ARCHITECTURES.items():
            current = registry.models.get(arch)
            owner = _registered_module(current) if current is not None else ""
            if owner == MODELS_MODULE:
                done.append(arch)
                continue
            if current is None or not owner.startswith("vllm.") or not _module_exists(vllm_module):
                # another plugin's class, or not in this vLLM: theirs wins, ours would drop it
                left.append(f"{arch} ({owner or 'not in this vLLM'})")
                continue
            previous[arch] = current
            registry.register_model(arch, f"{MODELS_MODULE}:Mirage{arch}")
            done.append(arch)
        _registered = done
        logger.info("mirage-serve: vLLM plugin registered for %s; other architectures run unmodified%s",
                    ", ".join(done) or "no architecture", f" (left as they are: {', '.join(left)})" if left else "")
        return list(done)
    except Exception as e:  # the plugin must never break vLLM: undo what was registered
        with contextlib.suppress(Exception):
            for arch, entry in previous.items():
                registry.models[arch] = entry
        logger.warning("mirage-serve: vLLM plugin not registered (%s: %s); vLLM runs unmodified", type(e).__name__, e)
        return []
