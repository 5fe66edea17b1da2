"""Kernel-cache entries: the on-disk JSON form, its strict parser and its checks.

An entry file is one JSON object, nothing else::

    {"format": "mirage-serve.kernel-cache-entry", "schema_version": 1,
     "key": {...CacheKey.to_obj()...},
     "mugraph": {...canonical μGraph object (mugraph.graph_to_obj)...},
     "params": {"BLOCK_M": 64, "num_warps": 4, ...},     # tuning parameters: ints and strings
     "certificate": {"verdict": "equivalent", ...},      # Certificate.to_dict() of the verifier
     "timings": {"latency_us": 12.5, ...},               # floats (empty when unprofiled)
     "created": "2026-12-02T18:48:08Z",
     "checksum": "sha256:<hex>"}                          # over the canonical JSON of all the rest

Nothing read from a file is executed, imported or unpickled: the file is parsed
with :func:`json.loads` (duplicate keys, NaN and Infinity rejected), bounded in
size and nesting, checked field by field (unexpected fields are errors), and the
μGraph is parsed by :func:`mirage_serve.mugraph.graph_from_obj` and must have
the input and output shapes and dtypes of the spec its key names. Kernel source
is regenerated from the μGraph by the code generator when the entry is used.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from mirage_serve.cache.keys import SCHEMA_VERSION, CacheKey, CacheKeyError
from mirage_serve.mugraph import KernelGraph, MuGraphError, graph_from_obj, graph_to_obj
from mirage_serve.mugraph.serialize import MAX_JSON_DEPTH, json_depth

ENTRY_FORMAT = "mirage-serve.kernel-cache-entry"
#: Entry files larger than this are rejected unread (a 4096-operator μGraph is far smaller).
MAX_ENTRY_BYTES = 4 << 20
#: Nesting of a whole entry: the μGraph object sits two levels below the top.
MAX_ENTRY_DEPTH = MAX_JSON_DEPTH + 2
MAX_CERTIFICATE_DEPTH = 8
MAX_CERTIFICATE_BYTES = 256 << 10
MAX_PARAMS = 64
MAX_TIMINGS = 64
MAX_PARAM_INT = 1 << 31
MAX_STR_LEN = 256

_FIELDS = frozenset({"format", "schema_version", "key", "mugraph", "params", "certificate", "timings", "created", "checksum"})
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_CHECKSUM_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_CREATED_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z$")


class CacheError(Exception):
    """A kernel-cache operation failed; the message says what to do next."""


class EntryRejected(CacheError):
    """An entry (file or object) failed a check. ``stale`` is True when it is well
    formed but for another cache schema, codegen or Triton version."""

    def __init__(self, reason: str, *, stale: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.stale = stale


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace, ASCII only, no NaN: the text checksums and hashes are taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)


def checksum_of(body: dict[str, Any]) -> str:
    """``sha256:<hex>`` over the canonical JSON of an entry object without its ``checksum``."""
    rest = {k: v for k, v in body.items() if k != "checksum"}
    return "sha256:" + hashlib.sha256(canonical_json(rest).encode("ascii")).hexdigest()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise EntryRejected(f"duplicate JSON key {k!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise EntryRejected(f"non-finite number {name} in JSON")


def parse_entry_json(data: bytes) -> Any:
    """Parse entry bytes strictly: bounded size and nesting, UTF-8, no duplicate keys, no NaN/Infinity."""
    if len(data) > MAX_ENTRY_BYTES:
        raise EntryRejected(f"file is {len(data)} bytes, over the {MAX_ENTRY_BYTES}-byte limit for an entry")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EntryRejected(f"not UTF-8 text ({e})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except RecursionError:
        raise EntryRejected(f"JSON nested deeper than {MAX_ENTRY_DEPTH} levels") from None
    except json.JSONDecodeError as e:
        raise EntryRejected(f"not valid JSON (truncated or corrupt): {e}") from None
    except EntryRejected:
        raise
    except ValueError as e:  # e.g. an integer literal over Python's digit limit
        raise EntryRejected(f"JSON with a value that cannot be read: {str(e)[:200]}") from None
    if json_depth(obj, MAX_ENTRY_DEPTH) > MAX_ENTRY_DEPTH:
        raise EntryRejected(f"JSON nested deeper than {MAX_ENTRY_DEPTH} levels")
    return obj


def _check_params(params: Any) -> dict[str, int | str]:
    if not isinstance(params, dict):
        raise EntryRejected(f"params must be a JSON object of tuning parameters, got {type(params).__name__}")
    if len(params) > MAX_PARAMS:
        raise EntryRejected(f"params has {len(params)} entries; at most {MAX_PARAMS} are allowed")
    for k, v in params.items():
        if not isinstance(k, str) or not _NAME_RE.match(k):
            raise EntryRejected(f"tuning parameter name {k!r} must be an identifier of at most 64 characters")
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise EntryRejected(f"tuning parameter {k}={v!r} must be an integer or a string")
        if isinstance(v, int) and abs(v) > MAX_PARAM_INT:
            raise EntryRejected(f"tuning parameter {k}={v} is out of range (|value| <= {MAX_PARAM_INT})")
        if isinstance(v, str) and len(v) > MAX_STR_LEN:
            raise EntryRejected(f"tuning parameter {k} is longer than {MAX_STR_LEN} characters")
    return dict(params)


def _check_timings(timings: Any) -> dict[str, float]:
    if not isinstance(timings, dict):
        raise EntryRejected(f"timings must be a JSON object of numbers, got {type(timings).__name__}")
    if len(timings) > MAX_TIMINGS:
        raise EntryRejected(f"timings has {len(timings)} entries; at most {MAX_TIMINGS} are allowed")
    out = {}
    for k, v in timings.items():
        if not isinstance(k, str) or not _NAME_RE.match(k):
            raise EntryRejected(f"timing name {k!r} must be an identifier of at most 64 characters")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise EntryRejected(f"timing {k}={v!r} must be a finite non-negative number")
        out[k] = v
    return out


def _check_certificate(cert: Any) -> dict[str, Any]:
    if not isinstance(cert, dict):
        raise EntryRejected(f"certificate must be a JSON object (Certificate.to_dict()), got {type(cert).__name__}")
    if json_depth(cert, MAX_CERTIFICATE_DEPTH) > MAX_CERTIFICATE_DEPTH:
        raise EntryRejected(f"certificate nested deeper than {MAX_CERTIFICATE_DEPTH} levels")
    try:
        size = len(canonical_json(cert))
    except (TypeError, ValueError) as e:
        raise EntryRejected(f"certificate is not plain JSON data: {e}") from None
    if size > MAX_CERTIFICATE_BYTES:
        raise EntryRejected(f"certificate is {size} bytes, over the {MAX_CERTIFICATE_BYTES}-byte limit")
    if "verdict" not in cert:
        raise EntryRejected("certificate has no verdict")
    return cert


def _check_created(created: Any) -> str:
    if not isinstance(created, str) or not _CREATED_RE.match(created):
        raise EntryRejected(f"created {created!r} must be a UTC time like 2026-01-31T12:00:00Z")
    try:
        _dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError as e:
        raise EntryRejected(f"created {created!r} is not a valid time: {e}") from None
    return created


def _utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(obj: Any, what: str) -> Any:
    """A deep copy through JSON, so an entry holds plain data only."""
    try:
        return json.loads(canonical_json(obj))
    except (TypeError, ValueError) as e:
        raise CacheError(f"{what} must be plain JSON data (dicts, lists, strings, finite numbers): {e}") from None


def check_graph_matches_key(graph: KernelGraph, key: CacheKey) -> None:
    """The μGraph's input and output shapes and dtypes are those of the spec built from the key."""
    from mirage_serve.specs import build_spec

    try:
        spec = build_spec(key.spec, key.dims_dict, key.dtype, **key.options_dict)
    except (MuGraphError, TypeError) as e:
        raise EntryRejected(f"key {key.describe()} does not name a buildable spec: {e}") from None
    g_info, s_info = graph.info, spec.info
    g_in = [(g_info[t].shape, g_info[t].dtype) for t in graph.input_ids]
    s_in = [(s_info[t].shape, s_info[t].dtype) for t in spec.input_ids]
    if g_in != s_in:
        raise EntryRejected(f"μGraph inputs {_fmt(g_in)} do not match spec {key.describe()} inputs {_fmt(s_in)}")
    g_out = [(g_info[t].shape, g_info[t].dtype) for t in graph.outputs]
    s_out = [(s_info[t].shape, s_info[t].dtype) for t in spec.outputs]
    if g_out != s_out:
        raise EntryRejected(f"μGraph outputs {_fmt(g_out)} do not match spec {key.describe()} outputs {_fmt(s_out)}")


def check_certificate_binding(cert: dict[str, Any], graph: KernelGraph, key: CacheKey) -> None:
    """A certificate that names the graphs it was issued for (the verifier's ``candidate_hash``
    and ``spec_hash``, content hashes) must name this μGraph and the key's spec: a genuine
    certificate copied onto another μGraph or into another key's entry is refused."""
    from mirage_serve.mugraph import content_hash
    from mirage_serve.specs import build_spec

    claimed = cert.get("candidate_hash")
    if isinstance(claimed, str) and claimed and claimed != content_hash(graph):
        raise EntryRejected(f"certificate was issued for μGraph {claimed[:16]}…, not for this entry's μGraph {content_hash(graph)[:16]}…")
    claimed = cert.get("spec_hash")
    if isinstance(claimed, str) and claimed:
        actual = content_hash(build_spec(key.spec, key.dims_dict, key.dtype, **key.options_dict))
        if claimed != actual:
            raise EntryRejected(f"certificate was issued against spec {claimed[:16]}…, not {key.describe()} ({actual[:16]}…)")


def _fmt(sig: list[tuple[tuple[int, ...], str]]) -> str:
    return "[" + ", ".join(f"{list(s)}:{d}" for s, d in sig) + "]"


@dataclass(frozen=True)
class CacheEntry:
    """One kernel: its key, μGraph, tuning parameters, certificate and timings.

    Build new entries with :meth:`create`; read them with :meth:`from_obj` (what
    :class:`KernelCache` does). ``checksum`` covers every other field, so an
    entry whose dicts were changed after creation is refused by ``put``.
    """

    key: CacheKey
    mugraph: dict[str, Any]
    params: dict[str, int | str]
    certificate: dict[str, Any]
    timings: dict[str, float]
    created: str
    checksum: str = field(default="")

    @classmethod
    def create(
        cls,
        key: CacheKey,
        graph: KernelGraph,
        *,
        certificate: Any,
        params: dict[str, int | str] | None = None,
        timings: dict[str, float] | None = None,
        created: str | None = None,
    ) -> CacheEntry:
        """A new entry for ``graph``. ``certificate`` is a verifier ``Certificate``
        (anything with ``to_dict()``) or its dict; it must say ``equivalent``."""
        cert = certificate.to_dict() if hasattr(certificate, "to_dict") else certificate
        body = {
            "key": key,
            "mugraph": _plain(graph_to_obj(graph), "the μGraph"),
            "params": _plain(params or {}, "params"),
            "certificate": _plain(cert, "the certificate"),
            "timings": {k: float(v) for k, v in (_plain(timings or {}, "timings")).items()},
            "created": created or _utc_now(),
        }
        entry = cls(**body)
        entry = cls(**body, checksum=checksum_of(entry._body_obj()))
        entry.check(deep=True)
        return entry

    def _body_obj(self) -> dict[str, Any]:
        return {
            "format": ENTRY_FORMAT,
            "schema_version": self.key.schema_version,
            "key": self.key.to_obj(),
            "mugraph": self.mugraph,
            "params": self.params,
            "certificate": self.certificate,
            "timings": self.timings,
            "created": self.created,
        }

    def to_obj(self) -> dict[str, Any]:
        """The JSON object written to disk."""
        return {**self._body_obj(), "checksum": self.checksum}

    def to_json(self) -> str:
        """The file text: sorted keys, indented for people; the checksum does not depend on formatting."""
        return json.dumps(self.to_obj(), sort_keys=True, indent=1, allow_nan=False, ensure_ascii=True) + "\n"

    @classmethod
    def from_obj(cls, obj: Any, *, deep: bool = True, allow_stale: bool = False) -> CacheEntry:
        """Parse and check an entry object; raises :class:`EntryRejected` with the reason.

        Order: format, schema version (other versions are *stale*), exact field
        set, checksum, key, then (``deep``) the field contents, the μGraph and
        its match with the key, and the verdict. Entries whose key names other
        codegen or Triton versions are rejected as stale before the deep checks,
        unless ``allow_stale`` (for tools that regenerate the code themselves).
        """
        if not isinstance(obj, dict):
            raise EntryRejected(f"an entry must be a JSON object, got {type(obj).__name__}")
        if obj.get("format") != ENTRY_FORMAT:
            raise EntryRejected(f"not a mirage-serve kernel-cache entry (format {str(obj.get('format'))[:80]!r}, expected {ENTRY_FORMAT!r})")
        version = obj.get("schema_version")
        if version != SCHEMA_VERSION:
            raise EntryRejected(
                f"written by cache schema version {str(version)[:20]}; this build reads version {SCHEMA_VERSION} "
                "(`mirage-serve cache prune` removes such entries; `build-cache` rebuilds them)",
                stale=isinstance(version, int) and not isinstance(version, bool),
            )
        missing, extra = _FIELDS - set(obj), set(obj) - _FIELDS
        if missing:
            raise EntryRejected(f"missing field(s) {sorted(missing)}")
        if extra:
            raise EntryRejected(f"unexpected field(s) {sorted(str(x)[:64] for x in extra)}")
        if not isinstance(obj["checksum"], str) or not _CHECKSUM_RE.match(obj["checksum"]):
            raise EntryRejected("checksum must be 'sha256:' and 64 hex digits")
        try:
            actual = checksum_of(obj)
        except (TypeError, ValueError) as e:
            raise EntryRejected(f"entry is not plain JSON data: {e}") from None
        if actual != obj["checksum"]:
            raise EntryRejected(f"checksum mismatch (file says {obj['checksum'][:19]}…, content hashes to {actual[:19]}…): the file was modified or corrupted")
        try:
            key = CacheKey.from_obj(obj["key"])
        except (CacheKeyError, TypeError) as e:
            raise EntryRejected(f"bad key: {e}") from None
        if key.schema_version != SCHEMA_VERSION:
            raise EntryRejected(f"key says schema version {key.schema_version} but the entry says {SCHEMA_VERSION}")
        stale = None if allow_stale else key.stale_reason()
        if stale:
            raise EntryRejected(stale, stale=True)
        if not isinstance(obj["mugraph"], dict):
            raise EntryRejected("mugraph must be a JSON object")
        entry = cls(
            key=key,
            mugraph=obj["mugraph"],
            params=_check_params(obj["params"]),
            certificate=_check_certificate(obj["certificate"]),
            timings=_check_timings(obj["timings"]),
            created=_check_created(obj["created"]),
            checksum=obj["checksum"],
        )
        if deep:
            entry.check(deep=True)
        return entry

    def check(self, *, deep: bool = True) -> None:
        """Re-run the content checks: field types, checksum, and (``deep``) μGraph
        validity, canonical form, match with the key, and an ``equivalent`` verdict."""
        _check_params(self.params)
        _check_timings(self.timings)
        _check_certificate(self.certificate)
        _check_created(self.created)
        if checksum_of(self._body_obj()) != self.checksum:
            raise EntryRejected("checksum does not match the entry's contents (was the entry changed after CacheEntry.create?)")
        if not deep:
            return
        try:
            graph = graph_from_obj(self.mugraph)
        except MuGraphError as e:
            raise EntryRejected(f"invalid μGraph: {e}") from None
        except RecursionError:
            raise EntryRejected("invalid μGraph: nested too deeply") from None
        if graph_to_obj(graph) != self.mugraph:
            raise EntryRejected("μGraph is not in canonical form (mugraph.graph_to_obj would write it differently)")
        check_graph_matches_key(graph, self.key)
        verdict = self.certificate.get("verdict")
        if verdict != "equivalent":
            raise EntryRejected(f"certificate verdict is {str(verdict)[:40]!r}, not 'equivalent': only verified kernels may be cached")
        check_certificate_binding(self.certificate, graph, self.key)

    @functools.cached_property
    def graph(self) -> KernelGraph:
        """The μGraph (parsed and validated)."""
        return graph_from_obj(self.mugraph)

    @property
    def verdict(self) -> str:
        return str(self.certificate.get("verdict"))

    @property
    def profiled(self) -> bool:
        """Measured on a GPU (an architecture in the key and at least one timing)."""
        return self.key.gpu_arch != "unprofiled" and bool(self.timings)
