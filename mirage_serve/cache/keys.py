"""Cache keys: what a kernel-cache entry is for, and the stable hash that names its file.

A key is (spec name, dims, spec options, dtype, GPU architecture) plus the
versions that decide whether a stored μGraph can still be turned into the same
kernel: the entry schema, the code generator and Triton. Every field is plain
data, so the key's canonical JSON (sorted keys, no whitespace) and its sha256
are the same in every process and on every machine.

Shape buckets: a bucketed dim (a batch size or a KV length rounded up to its
bucket) is stored in ``dims`` as the bucket's value, i.e. the concrete size the
μGraph was generated for; the key does not know which dims were bucketed.

GPU architectures are strings ``sm<major><minor>[a]`` (``sm80``, ``sm90``,
``sm90a``) or ``unprofiled`` for entries whose tuning was ranked by the CPU cost
model rather than measured on a GPU. :func:`fallback_archs` gives the order in
which :meth:`KernelCache.lookup` tries them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import logging
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from mirage_serve.mugraph.graph import DTYPES

log = logging.getLogger(__name__)

#: Version of the entry layout on disk (``entry.py``). Bump it when the layout or
#: the meaning of a field changes; entries of other versions become stale.
SCHEMA_VERSION = 1

#: Used when ``mirage_serve.codegen`` does not define ``CODEGEN_VERSION`` (the
#: code generator not yet present in this build). Entries keyed with it become
#: stale as soon as a real code generator version is exposed.
FALLBACK_CODEGEN_VERSION = "0-no-codegen"

UNPROFILED = "unprofiled"

#: Architectures whose tuning parameters another one may use, best first. A
#: device may use entries tuned on an architecture whose instruction set is a
#: subset of its own and whose shared memory per SM is no larger, so the tuned
#: tile sizes compile and fit. ``smXYa`` (the arch-specific variant Triton
#: targets on Hopper and Blackwell) may use ``smXY`` entries by the general rule
#: in :func:`fallback_archs`; the table adds the cross-generation cases.
GPU_ARCH_COMPAT: dict[str, tuple[str, ...]] = {
    "sm89": ("sm86",),  # Ada: a superset of consumer Ampere, both 100 KB shared memory per SM
    "sm87": ("sm86",),  # Jetson Orin: Ampere with 164 KB; sm86 tiles fit
}

# Bounds on what a key may contain (keys are read from untrusted files).
MAX_NAME_LEN = 64
MAX_DIMS = 16
MAX_OPTIONS = 16
MAX_DIM = 1 << 24
MAX_STR_LEN = 128
MAX_VERSION_LEN = 64

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_ARCH_RE = re.compile(r"^sm[0-9]{2,3}[a-z]?$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}$")


class CacheKeyError(ValueError):
    """A cache key field is malformed; the message names the field and the rule."""


@functools.lru_cache(maxsize=1)
def current_codegen_version() -> str:
    """``mirage_serve.codegen.CODEGEN_VERSION`` if defined, else :data:`FALLBACK_CODEGEN_VERSION`."""
    try:
        mod = importlib.import_module("mirage_serve.codegen")
    except Exception as e:  # noqa: BLE001 - a codegen that fails to import must not make every cache key fail
        log.warning("mirage_serve.codegen could not be imported (%s); keying cache entries with codegen version %s", e, FALLBACK_CODEGEN_VERSION)
        return FALLBACK_CODEGEN_VERSION
    version = getattr(mod, "CODEGEN_VERSION", None)
    if version is None:
        return FALLBACK_CODEGEN_VERSION
    return str(version)


@functools.lru_cache(maxsize=1)
def current_triton_version() -> str:
    """The installed Triton's version (read from package metadata, Triton is not imported), or ``none``."""
    for dist in ("triton", "pytorch-triton", "triton-nightly"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def current_gpu_arch(device: int | None = None) -> str:
    """``smXY`` of the CUDA device (default: the current one), or ``unprofiled`` without one."""
    try:
        import torch
    except ImportError:
        return UNPROFILED
    if not torch.cuda.is_available():
        return UNPROFILED
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def fallback_archs(arch: str) -> tuple[str, ...]:
    """The architectures a lookup for ``arch`` tries, in order: the exact one, the
    compatible ones (``smXYa`` -> ``smXY``, then :data:`GPU_ARCH_COMPAT`), then
    ``unprofiled``."""
    check_arch(arch)
    if arch == UNPROFILED:
        return (UNPROFILED,)
    order = [arch]
    base = arch.rstrip("abcdefghijklmnopqrstuvwxyz")
    if base != arch:
        order.append(base)
    for a in (arch, base):
        order.extend(GPU_ARCH_COMPAT.get(a, ()))
    order.append(UNPROFILED)
    return tuple(dict.fromkeys(order))


def check_arch(arch: Any) -> str:
    if not isinstance(arch, str) or not (arch == UNPROFILED or _ARCH_RE.match(arch)):
        raise CacheKeyError(f"gpu_arch {arch!r} must be 'sm<major><minor>[suffix]' (e.g. 'sm90') or {UNPROFILED!r}")
    return arch


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise CacheKeyError(f"{what} {name!r} must be an identifier of at most {MAX_NAME_LEN} characters")
    return name


def _check_version(v: Any, what: str) -> str:
    if not isinstance(v, str) or not _VERSION_RE.match(v):
        raise CacheKeyError(f"{what} {v!r} must be a version string of at most {MAX_VERSION_LEN} characters ([A-Za-z0-9.+_-])")
    return v


def _check_option_value(name: str, v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        if abs(v) > MAX_DIM:
            raise CacheKeyError(f"option {name}={v} is out of range (|value| <= {MAX_DIM})")
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise CacheKeyError(f"option {name}={v} must be finite")
        return v
    if isinstance(v, str):
        if len(v) > MAX_STR_LEN:
            raise CacheKeyError(f"option {name} is longer than {MAX_STR_LEN} characters")
        return v
    raise CacheKeyError(f"option {name}={v!r} must be a bool, int, float or string")


def _pairs(obj: Any, what: str, limit: int) -> tuple[tuple[str, Any], ...]:
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, tuple | list):
        items = [tuple(p) for p in obj]
        if any(len(p) != 2 for p in items):
            raise CacheKeyError(f"{what} must be a mapping or (name, value) pairs")
    else:
        raise CacheKeyError(f"{what} must be a mapping of names to values, got {type(obj).__name__}")
    if len(items) > limit:
        raise CacheKeyError(f"{what} has {len(items)} entries; at most {limit} are allowed")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise CacheKeyError(f"{what} repeats a name: {names}")
    return tuple(sorted(items, key=lambda p: str(p[0])))


@dataclass(frozen=True)
class CacheKey:
    """What a cache entry is for. ``dims`` and ``options`` are stored as sorted
    ``(name, value)`` tuples so keys are hashable; pass dicts to the constructor.

    The three version fields default to this installation's versions; keys read
    from files keep whatever the file says (and such entries are *stale* when
    they differ).
    """

    spec: str
    dims: tuple[tuple[str, int], ...]
    dtype: str
    gpu_arch: str = UNPROFILED
    options: tuple[tuple[str, Any], ...] = ()
    schema_version: int = SCHEMA_VERSION
    codegen_version: str = field(default_factory=current_codegen_version)
    triton_version: str = field(default_factory=current_triton_version)

    def __post_init__(self) -> None:
        _check_name(self.spec, "spec name")
        dims = _pairs(self.dims, "dims", MAX_DIMS)
        for name, v in dims:
            _check_name(name, "dim name")
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_DIM:
                raise CacheKeyError(f"dim {name}={v!r} must be an integer in 1..{MAX_DIM}")
        options = _pairs(self.options, "options", MAX_OPTIONS)
        options = tuple((_check_name(n, "option name"), _check_option_value(n, v)) for n, v in options)
        if self.dtype not in DTYPES:
            raise CacheKeyError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}")
        check_arch(self.gpu_arch)
        if not isinstance(self.schema_version, int) or isinstance(self.schema_version, bool) or not 0 <= self.schema_version < 1 << 16:
            raise CacheKeyError(f"schema_version {self.schema_version!r} must be a small non-negative integer")
        _check_version(self.codegen_version, "codegen_version")
        _check_version(self.triton_version, "triton_version")
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "options", options)

    @property
    def dims_dict(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)

    def to_obj(self) -> dict[str, Any]:
        """The JSON object form (the one hashed and stored in entries)."""
        return {
            "spec": self.spec,
            "dims": dict(self.dims),
            "options": dict(self.options),
            "dtype": self.dtype,
            "gpu_arch": self.gpu_arch,
            "schema_version": self.schema_version,
            "codegen_version": self.codegen_version,
            "triton_version": self.triton_version,
        }

    @classmethod
    def from_obj(cls, obj: Any) -> CacheKey:
        """Parse :meth:`to_obj`'s form strictly: every field required, none extra."""
        if not isinstance(obj, dict):
            raise CacheKeyError(f"a cache key must be a JSON object, got {type(obj).__name__}")
        expected = {"spec", "dims", "options", "dtype", "gpu_arch", "schema_version", "codegen_version", "triton_version"}
        missing, extra = expected - set(obj), set(obj) - expected
        if missing:
            raise CacheKeyError(f"cache key is missing field(s) {sorted(missing)}")
        if extra:
            raise CacheKeyError(f"cache key has unexpected field(s) {sorted(extra)}")
        if not isinstance(obj["dims"], dict) or not isinstance(obj["options"], dict):
            raise CacheKeyError("cache key dims and options must be JSON objects")
        return cls(**obj)

    @functools.cached_property
    def digest(self) -> str:
        """sha256 (hex) of the key's canonical JSON: identical in every process."""
        text = json.dumps(self.to_obj(), sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    @property
    def entry_id(self) -> str:
        """``<spec>-<first 32 hex digits of the digest>``: the entry's file name without ``.json``."""
        return f"{self.spec}-{self.digest[:32]}"

    @property
    def filename(self) -> str:
        return f"{self.entry_id}.json"

    def with_arch(self, gpu_arch: str) -> CacheKey:
        return replace(self, gpu_arch=gpu_arch)

    @property
    def is_current(self) -> bool:
        """Whether the schema, codegen and Triton versions are this installation's."""
        return (self.schema_version, self.codegen_version, self.triton_version) == (SCHEMA_VERSION, current_codegen_version(), current_triton_version())

    def stale_reason(self) -> str | None:
        """Why the key's versions differ from this installation's, or None."""
        diffs = []
        if self.schema_version != SCHEMA_VERSION:
            diffs.append(f"cache schema {self.schema_version} (this build: {SCHEMA_VERSION})")
        if self.codegen_version != current_codegen_version():
            diffs.append(f"codegen {self.codegen_version} (this build: {current_codegen_version()})")
        if self.triton_version != current_triton_version():
            diffs.append(f"triton {self.triton_version} (installed: {current_triton_version()})")
        return "built for " + ", ".join(diffs) if diffs else None

    def describe(self) -> str:
        """``spec[batch=8,hidden=4096] float16 sm90``: for messages and listings."""
        dims = ",".join(f"{k}={v}" for k, v in self.dims)
        opts = "".join(f" {k}={v}" for k, v in self.options)
        return f"{self.spec}[{dims}]{opts} {self.dtype} {self.gpu_arch}"
