"""Resolve a model id to its config.json without touching the network.

Three routes, tried in order:

1. a local path: a directory holding ``config.json`` (a ``save_pretrained`` output or a
   checkpoint) or a ``config.json`` file itself;
2. a Hugging Face id (``org/name``) already in the local HF cache: every cache directory of
   ``HF_HUB_CACHE``, ``HF_HOME/hub`` and ``~/.cache/huggingface/hub`` is searched for
   ``models--org--name/snapshots/<rev>/config.json`` (the ``refs/main`` snapshot first, via
   ``huggingface_hub.try_to_load_from_cache``; else the newest snapshot that has one);
3. a config bundled with mirage-serve (``mirage_serve/models/configs/<org>--<name>.json``; no
   weights), listed by :func:`bundled_model_ids`.

Nothing here downloads: a kernel build needs shapes, not weights, so an id that is not found
locally gets an error listing every place looked at and how to make it available.
"""

from __future__ import annotations

import json
import logging
import os
from importlib import resources
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The model ``mirage-serve build-cache`` builds when given no id: small (1.2B parameters,
#: hidden 2048, 16 layers) and bundled, so the default build needs no download.
DEFAULT_MODEL_ID = "meta-llama/Llama-3.2-1B-Instruct"

_BUNDLED_PACKAGE = "mirage_serve.models.configs"


class ModelNotFoundError(FileNotFoundError):
    """The model id resolved through none of the offline routes; the message lists what was checked."""


def hf_cache_dirs() -> list[Path]:
    """Hugging Face hub cache directories to search, most specific first, without duplicates."""
    candidates: list[Path] = []
    if os.environ.get("HF_HUB_CACHE"):
        candidates.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        candidates.append(Path(os.environ["HUGGINGFACE_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        candidates.append(Path(os.environ["HF_HOME"]) / "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    candidates.append((Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub")
    seen: list[Path] = []
    for c in candidates:
        c = c.expanduser()
        if c not in seen:
            seen.append(c)
    return seen


def _bundled_file(model_id: str) -> str:
    return model_id.replace("/", "--") + ".json"


def bundled_model_ids() -> list[str]:
    """Ids of the configs shipped with mirage-serve, e.g. ``meta-llama/Llama-3.1-8B-Instruct``."""
    root = resources.files(_BUNDLED_PACKAGE)
    return sorted(p.name[: -len(".json")].replace("--", "/", 1) for p in root.iterdir() if p.name.endswith(".json"))


def load_bundled_config(model_id: str) -> dict[str, Any] | None:
    """A bundled config by id (case-insensitive), or None."""
    wanted = {m.lower(): m for m in bundled_model_ids()}.get(model_id.lower())
    if wanted is None:
        return None
    return json.loads(resources.files(_BUNDLED_PACKAGE).joinpath(_bundled_file(wanted)).read_text())


def _looks_like_repo_id(model_id: str) -> bool:
    parts = model_id.split("/")
    return len(parts) == 2 and all(parts) and not model_id.startswith((".", "~")) and "\\" not in model_id


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-download or fix that config.json") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object; it is not a transformers config.json")
    return data


def find_in_hf_cache(repo_id: str, checked: list[str] | None = None) -> Path | None:
    """The cached ``config.json`` of ``repo_id`` in any local HF cache dir, or None. Never uses the network."""
    from huggingface_hub import try_to_load_from_cache

    checked = [] if checked is None else checked
    folder = "models--" + repo_id.replace("/", "--")
    for cache in hf_cache_dirs():
        repo_dir = cache / folder
        checked.append(f"HF cache: {repo_dir}/snapshots/*/config.json")
        if not repo_dir.is_dir():
            continue
        hit = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(cache))
        if isinstance(hit, str) and os.path.isfile(hit):
            return Path(hit)
        # no refs/main (e.g. a snapshot downloaded at a pinned revision): take the newest snapshot with a config
        snapshots = sorted((repo_dir / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        if snapshots:
            return snapshots[0]
    return None


def resolve_config(model_id: str) -> tuple[dict[str, Any], str]:
    """``(config_dict, source)`` for a local directory, a cached HF id or a bundled config.

    ``source`` says where the config came from ("local:<path>", "hf-cache:<path>",
    "bundled:<id>"). Raises :class:`ModelNotFoundError` listing every path checked.
    """
    if not model_id or not model_id.strip():
        raise ModelNotFoundError("empty model id; pass a directory with config.json, an org/name id, or one of: " + ", ".join(bundled_model_ids()))
    checked: list[str] = []
    path = Path(model_id).expanduser()
    checked.append(f"local path: {path.resolve()}/config.json")
    if path.is_dir() and (path / "config.json").is_file():
        return _read_json(path / "config.json"), f"local:{(path / 'config.json').resolve()}"
    if path.is_file() and path.suffix == ".json":
        return _read_json(path), f"local:{path.resolve()}"
    if _looks_like_repo_id(model_id):
        hit = find_in_hf_cache(model_id, checked)
        if hit is not None:
            logger.info("%s: config from the local HF cache at %s", model_id, hit)
            return _read_json(hit), f"hf-cache:{hit}"
    checked.append(f"bundled configs ({_BUNDLED_PACKAGE}): {_bundled_file(model_id)}")
    bundled = load_bundled_config(model_id)
    if bundled is not None:
        return bundled, f"bundled:{model_id}"
    lines = "\n  ".join(checked)
    raise ModelNotFoundError(
        f"model {model_id!r} not found offline; looked at:\n  {lines}\n"
        f"Bundled ids: {', '.join(bundled_model_ids())}.\n"
        f"To use another model, pass a directory holding its config.json, or fetch it into the HF cache first "
        f"(e.g. `huggingface-cli download {model_id} config.json`)."
    )
