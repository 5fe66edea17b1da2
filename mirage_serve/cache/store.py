"""The on-disk kernel cache: a directory of JSON entries, safe for several builders at once.

Layout of a cache directory::

    <root>/.lock                      filelock, held by writers, quarantine and prune
    <root>/entries/<spec>-<hash>.json one entry per key (CacheKey.filename)
    <root>/entries/.tmp-*             a write in progress (or left by a killed writer; prune removes it)
    <root>/rejected/<name>.<time>     entries that failed a check, moved aside, with a .reason file beside

Where the cache is (first that applies): the ``path`` given to
:class:`KernelCache` (the CLI's ``--cache-dir``), the ``MIRAGE_SERVE_CACHE``
environment variable, ``platformdirs.user_cache_dir("mirage-serve")/kernels``.

Lookup order for a key with architecture A: for each architecture in
:func:`~mirage_serve.cache.keys.fallback_archs` (A, the compatible ones,
``unprofiled``), first the user cache, then the read-only package cache
(``mirage_serve.kernel_cache``, files ``entries/*.json``); the first entry that
passes every check wins. An entry that fails a check is logged once (path and
reason), moved to ``rejected/`` when it is in the user cache (the package cache
is never written), and treated as missing so that ``build-cache`` rebuilds it.

Writes go to a temporary file in ``entries/``, are fsynced, then renamed over
the entry with :func:`os.replace` while holding the lock: a reader sees the old
entry or the new one, never a part of one.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from mirage_serve.cache.entry import MAX_ENTRY_BYTES, CacheEntry, CacheError, EntryRejected, parse_entry_json
from mirage_serve.cache.keys import CacheKey, fallback_archs

log = logging.getLogger(__name__)

ENV_VAR = "MIRAGE_SERVE_CACHE"
ENTRIES = "entries"
REJECTED = "rejected"
LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp-"

# (path, reason) pairs already logged by this process: each problem is reported once.
_reported: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


def default_cache_dir() -> Path:
    """``$MIRAGE_SERVE_CACHE`` if set, else ``platformdirs.user_cache_dir("mirage-serve")/kernels``."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("mirage-serve")) / "kernels"


def shipped_cache_dir() -> Path | None:
    """The package's read-only cache folder (``mirage_serve.kernel_cache``), or None if not a real directory."""
    try:
        import mirage_serve.kernel_cache as pkg
    except ImportError:
        return None
    root = Path(pkg.__file__).resolve().parent
    return root if root.is_dir() else None


def _report(path: Path, reason: str, *, action: str, once: bool = True) -> None:
    """Log a rejected file. A file left in place (read-only cache) is reported once per
    process; one moved aside is reported every time, as each is a new file."""
    if once:
        with _reported_lock:
            if (str(path), reason) in _reported:
                return
            _reported.add((str(path), reason))
    log.warning("kernel cache: rejected %s: %s (%s)", path, reason, action)


@dataclass(frozen=True)
class ScanItem:
    """One file found in a cache directory and what the checks made of it.

    ``state`` is ``ok`` (usable here), ``stale`` (well formed but for another
    cache schema, codegen or Triton version), ``corrupt`` (failed a check),
    ``rejected`` (already moved to ``rejected/``) or ``temp`` (a temporary file
    of a write in progress or of a killed writer).
    """

    path: Path
    location: str  # "user" or "package"
    state: str
    entry: CacheEntry | None = None
    reason: str = ""


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of :meth:`KernelCache.verify` for one entry.

    ``status``: ``equivalent`` (re-verified), ``integrity_ok`` (all file checks
    passed; no re-verification was run), ``not_equivalent`` (the re-verification
    contradicts the stored certificate; the entry was quarantined), ``unknown``
    (the verifier could not decide), ``rejected`` (a file check failed) or
    ``missing``.
    """

    key: CacheKey
    path: Path | None
    status: str
    reason: str = ""
    certificate: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("equivalent", "integrity_ok")


class _Dir:
    """One cache directory (the user's, writable, or the package's, read-only)."""

    def __init__(self, root: Path, location: str, writable: bool) -> None:
        self.root = root
        self.location = location
        self.writable = writable

    @property
    def entries(self) -> Path:
        return self.root / ENTRIES

    def entries_dir_ok(self) -> bool:
        """``entries/`` exists, is a real directory (not a link) inside the root."""
        try:
            st = os.lstat(self.entries)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            _report(self.entries, "the entries folder is a symlink or not a directory; entries are not read from it", action="ignored")
            return False
        return True


def _read_entry_file(path: Path) -> tuple[bytes, os.stat_result]:
    """Read an entry file without following links: regular files only, bounded size."""
    # O_NONBLOCK: opening a FIFO or device planted under an entry's name must not hang the reader
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise EntryRejected("entry file is a symlink; cache entries must be regular files inside the cache directory") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EntryRejected("not a regular file")
        if st.st_size > MAX_ENTRY_BYTES:
            raise EntryRejected(f"file is {st.st_size} bytes, over the {MAX_ENTRY_BYTES}-byte limit for an entry")
        chunks, left = [], MAX_ENTRY_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def load_entry_file(path: Path, *, deep: bool = True, allow_stale: bool = False) -> CacheEntry:
    """Read and check one entry file; its name must be its key's file name.

    Raises :class:`EntryRejected` with the reason (``stale`` set for entries of
    other versions), or ``OSError`` if the file cannot be read at all.
    ``allow_stale``: accept entries of other codegen or Triton versions (see
    :meth:`CacheEntry.from_obj`); their code is never run from the cache.
    """
    data, _ = _read_entry_file(path)
    entry = CacheEntry.from_obj(parse_entry_json(data), deep=deep, allow_stale=allow_stale)
    if entry.key.filename != path.name:
        raise EntryRejected(f"the key in the file ({entry.key.describe()}) hashes to {entry.key.filename}, not to the file's name")
    return entry


def write_atomic(d: Path, name: str, data: bytes) -> Path:
    """Write ``d / name`` through a fsynced temporary file in ``d`` renamed over it (a reader sees
    the old file or the new one, never part of one); the caller holds the cache lock."""
    target = d / name
    tmp = d / f"{TMP_PREFIX}{Path(name).stem}-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(d)
    return target


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform/filesystem allows fsync on a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class KernelCache:
    """The kernel cache: a writable user directory plus read-only package entries.

    ``path``: the user cache directory (default :func:`default_cache_dir`);
    ``readonly_dirs``: further cache directories searched after it (default: the
    package cache; pass ``()`` for none); ``lock_timeout``: seconds to wait for
    the directory lock before :class:`CacheError`.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, readonly_dirs: tuple[Path, ...] | list[Path] | None = None, lock_timeout: float = 60.0) -> None:
        self.root = Path(path).expanduser() if path is not None else default_cache_dir()
        if readonly_dirs is None:
            shipped = shipped_cache_dir()
            readonly_dirs = (shipped,) if shipped is not None else ()
        self._dirs = [_Dir(self.root, "user", True)]
        self._dirs += [_Dir(Path(d), "package", False) for d in readonly_dirs if Path(d).resolve() != self.root.resolve()]
        self.lock_timeout = lock_timeout

    def __repr__(self) -> str:
        return f"KernelCache({str(self.root)!r})"

    # -- paths and locking -------------------------------------------------------------

    def path_for(self, key: CacheKey) -> Path:
        """Where ``key``'s entry lives in the user cache."""
        return self.root / ENTRIES / key.filename

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(self.root / LOCK_NAME), timeout=self.lock_timeout)
        try:
            with lock:
                yield
        except filelock.Timeout:
            raise CacheError(
                f"could not lock kernel cache {self.root} within {self.lock_timeout:.0f}s; another build is writing it. "
                f"Wait for it, or if no process is using the cache, delete {self.root / LOCK_NAME}"
            ) from None

    def _ensure_entries_dir(self) -> Path:
        d = self.root / ENTRIES
        d.mkdir(parents=True, exist_ok=True)
        if d.is_symlink() or not d.is_dir():
            raise CacheError(f"{d} is a symlink or not a directory; remove it so the cache can recreate it")
        return d

    # -- writing -----------------------------------------------------------------------

    def put(self, entry: CacheEntry) -> Path:
        """Check ``entry`` fully and write it atomically to the user cache (replacing
        an existing entry for the same key). Returns the entry's path."""
        try:
            entry.check(deep=True)
        except EntryRejected as e:
            raise CacheError(f"refusing to cache {entry.key.describe()}: {e.reason}") from None
        stale = entry.key.stale_reason()
        if stale:
            raise CacheError(f"refusing to cache {entry.key.describe()}: its key is {stale}; build it with this installation's versions")
        text = entry.to_json().encode("ascii")
        with self._locked():
            target = write_atomic(self._ensure_entries_dir(), entry.key.filename, text)
        log.info("kernel cache: stored %s in %s", entry.key.describe(), target)
        return target

    def remove(self, key: CacheKey) -> bool:
        """Delete ``key``'s entry (exact architecture) from the user cache; False if it had none.

        Entries in the read-only package cache cannot be removed."""
        target = self.path_for(key)
        with self._locked():
            try:
                os.unlink(target)
            except FileNotFoundError:
                for d in self._dirs[1:]:
                    if os.path.lexists(d.entries / key.filename):
                        raise CacheError(f"{key.describe()} is in the read-only package cache {d.root}; it cannot be removed") from None
                return False
        log.info("kernel cache: removed %s", target)
        return True

    # -- reading -----------------------------------------------------------------------

    def lookup(self, key: CacheKey) -> CacheEntry | None:
        """The best usable entry for ``key``, or None.

        Tries each architecture of ``fallback_archs(key.gpu_arch)``, in the user
        cache then the package cache. Every candidate file is fully checked;
        a failing one is reported, quarantined (user cache) and skipped.
        """
        for arch in fallback_archs(key.gpu_arch):
            k = key if arch == key.gpu_arch else key.with_arch(arch)
            for d in self._dirs:
                entry = self._load(d, k)
                if entry is not None:
                    if arch != key.gpu_arch:
                        log.debug("kernel cache: %s served by the %s entry", key.describe(), arch)
                    return entry
        return None

    def get(self, key: CacheKey) -> CacheEntry | None:
        """The entry for exactly ``key`` (no architecture fallback), or None."""
        for d in self._dirs:
            entry = self._load(d, key)
            if entry is not None:
                return entry
        return None

    def _load(self, d: _Dir, key: CacheKey) -> CacheEntry | None:
        path = d.entries / key.filename
        if not os.path.lexists(path) or not d.entries_dir_ok():
            return None
        try:
            entry = load_entry_file(path)
        except FileNotFoundError:
            return None  # removed between the check and the read
        except EntryRejected as e:
            self._reject(d, path, e.reason)
            return None
        except OSError as e:
            _report(path, f"unreadable: {e}", action="skipped")
            return None
        if entry.key != key:
            self._reject(d, path, f"the file holds {entry.key.describe()}, not {key.describe()}")
            return None
        return entry

    def _reject(self, d: _Dir, path: Path, reason: str, checksum: str | None = None) -> None:
        if not d.writable:
            _report(path, reason, action="skipped; the package cache is read-only")
            return
        try:
            moved = self.quarantine(path, reason, checksum=checksum)
        except (OSError, CacheError) as e:
            _report(path, reason, action=f"skipped; could not move it aside: {e}")
            return
        if moved is not None:
            _report(path, reason, action=f"moved to {moved}", once=False)

    def quarantine(self, path: Path, reason: str, *, checksum: str | None = None) -> Path | None:
        """Move a bad user-cache file to ``rejected/`` with a ``.reason`` note beside it.

        Under the lock the file is re-checked first, so that an entry another
        writer replaced meanwhile stays: without ``checksum``, the file is moved
        only if it still fails a check; with ``checksum`` (an entry found wrong by
        re-verification), only if it is still that entry. Returns the new path, or
        None if the file was left."""
        path = Path(path)
        with self._locked():
            if not os.path.lexists(path):
                return None
            if not path.name.startswith(TMP_PREFIX):
                try:
                    current = load_entry_file(path)
                    if checksum is None or current.checksum != checksum:
                        return None  # a valid entry (replaced since it was read)
                except EntryRejected:
                    if checksum is not None:
                        return None  # changed since; its own check will catch it
                except FileNotFoundError:
                    return None
            rej = self.root / REJECTED
            rej.mkdir(exist_ok=True)
            if rej.is_symlink() or not rej.is_dir():
                raise CacheError(f"{rej} is a symlink or not a directory; remove it so rejected entries can be kept there")
            dest = rej / f"{path.name}.{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.{secrets.token_hex(8)}"
            os.replace(path, dest)  # moves a symlink itself, never its target
            (rej / (dest.name + ".reason")).write_text(reason + "\n", encoding="utf-8")
        return dest

    def scan(self, specs: Iterable[str] | None = None, *, stale_entries: bool = False) -> list[ScanItem]:
        """Every file in every cache directory, checked (nothing is moved or changed).
        ``specs``: only the entry files of these specs (named ``<spec>-<hash>.json``), nothing else.
        ``stale_entries``: a stale item also carries its entry where it passes every other check."""
        wanted = None if specs is None else set(specs)
        items: list[ScanItem] = []
        for d in self._dirs:
            if d.entries_dir_ok():
                for p in sorted(d.entries.iterdir()):
                    if wanted is not None and (not p.name.endswith(".json") or p.name.rpartition("-")[0] not in wanted):
                        continue
                    if p.name.startswith(TMP_PREFIX):
                        items.append(ScanItem(p, d.location, "temp", reason="temporary file of an unfinished write"))
                        continue
                    if not p.name.endswith(".json"):
                        continue
                    try:
                        entry = load_entry_file(p, allow_stale=stale_entries)
                        stale = entry.key.stale_reason() if stale_entries else None
                        items.append(ScanItem(p, d.location, "stale" if stale else "ok", entry, reason=stale or ""))
                    except EntryRejected as e:
                        items.append(ScanItem(p, d.location, "stale" if e.stale else "corrupt", reason=e.reason))
                    except OSError as e:
                        items.append(ScanItem(p, d.location, "corrupt", reason=f"unreadable: {e}"))
            rej = d.root / REJECTED
            if wanted is None and d.writable and rej.is_dir() and not rej.is_symlink():
                for p in sorted(rej.iterdir()):
                    if p.name.endswith(".reason"):
                        continue
                    note = rej / (p.name + ".reason")
                    reason = note.read_text(encoding="utf-8", errors="replace").strip()[:500] if note.is_file() else "rejected"
                    items.append(ScanItem(p, d.location, "rejected", reason=reason))
        return items

    def entries(self, specs: Iterable[str] | None = None, *, include_stale: bool = False) -> list[CacheEntry]:
        """All usable entries (user cache first; a key in both is listed once, from the user cache);
        ``specs``: only those of these spec names. ``include_stale``: entries of other codegen or
        Triton versions too (after the usable ones), for what does not run their code: their μGraphs
        as search seeds, which are verified afresh."""
        seen: set[str] = set()
        out = []
        items = self.scan(specs, stale_entries=include_stale)
        for item in [i for i in items if i.state == "ok"] + [i for i in items if i.state == "stale"]:
            if item.entry is not None and item.entry.key.digest not in seen:
                seen.add(item.entry.key.digest)
                out.append(item.entry)
        return out

    # -- maintenance -------------------------------------------------------------------

    def prune(self, *, dry_run: bool = False) -> list[ScanItem]:
        """Remove from the user cache what is provably unusable here: entries of other
        schema/codegen/Triton versions, corrupt entries, everything in ``rejected/``,
        and temporary files of killed writers. Returns what was (or, with
        ``dry_run``, would be) removed. The package cache is never touched."""
        with self._locked():  # no writer is mid-write while we hold it, so temp files are orphans
            doomed = [i for i in self.scan() if i.location == "user" and i.state in ("stale", "corrupt", "rejected", "temp")]
            if dry_run:
                return doomed
            for item in doomed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(item.path)
                if item.state == "rejected":
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(item.path.parent / (item.path.name + ".reason"))
                log.info("kernel cache: pruned %s (%s: %s)", item.path, item.state, item.reason)
        return doomed

    def verify(
        self,
        key: CacheKey,
        reverify: Callable[..., Any] | bool | None = None,
        *,
        trials: int = 3,
        seed: int | None = None,
        float_check: bool = False,
    ) -> VerifyResult:
        """Re-check ``key``'s entry (exact architecture): every file check, then the
        μGraph against its spec with ``reverify(graph, spec, trials=, seed=, float_check=)``
        (default ``None``: ``mirage_serve.verify.verify_equivalent`` when the verifier
        is installed, otherwise only the file checks run; ``False``: file checks only). A verdict of
        ``not_equivalent`` quarantines the entry: its stored certificate was wrong.
        """
        path: Path | None = None
        where = self._dirs[0]
        for d in self._dirs:
            p = d.entries / key.filename
            if os.path.lexists(p) and d.entries_dir_ok():
                path, where = p, d
                break
        if path is None:
            return VerifyResult(key, None, "missing", "no entry for this key")
        try:
            entry = load_entry_file(path)
        except EntryRejected as e:
            self._reject(where, path, e.reason)
            return VerifyResult(key, path, "rejected", e.reason)
        if reverify is False:
            return VerifyResult(key, path, "integrity_ok", "file checks passed (re-verification not requested)", entry.certificate)
        if reverify is None or reverify is True:
            reverify = _default_reverifier()
            if reverify is None:
                return VerifyResult(key, path, "integrity_ok", "file checks passed; the verifier is not installed, so the certificate was not re-checked", entry.certificate)
        from mirage_serve.specs import build_spec

        spec = build_spec(key.spec, key.dims_dict, key.dtype, **key.options_dict)
        seed = secrets.randbelow(1 << 31) if seed is None else seed
        cert = reverify(entry.graph, spec, trials=trials, seed=seed, float_check=float_check)
        cert_dict = cert.to_dict() if hasattr(cert, "to_dict") else dict(cert)
        verdict = cert_dict.get("verdict", getattr(cert, "verdict", None))
        if verdict == "equivalent":
            rows = cert_dict.get("rows")
            on = f", on {rows['verified_rows']} of {rows['rows']} rows" if isinstance(rows, dict) else ""
            return VerifyResult(key, path, "equivalent", f"re-verified ({trials} trials, seed {seed}{on})", cert_dict)
        if verdict == "not_equivalent":
            reason = f"re-verification (seed {seed}) found the μGraph NOT equivalent to {key.describe()}; its stored certificate is wrong"
            self._reject(where, path, reason, checksum=entry.checksum)
            return VerifyResult(key, path, "not_equivalent", reason, cert_dict)
        return VerifyResult(key, path, "unknown", f"the verifier could not decide (verdict {verdict!r}); the entry was kept", cert_dict)


def _default_reverifier() -> Callable[..., Any] | None:
    """The verifier, evaluating row-separable pairs too large for this machine's memory on fewer
    rows (see :mod:`mirage_serve.verify.rows`); None when it is not installed."""
    try:
        from mirage_serve.verify import verify_equivalent
        from mirage_serve.verify.rows import rows_within_memory
    except ImportError:
        return None

    def reverify(graph: Any, spec: Any, **kw: Any) -> Any:
        return verify_equivalent(graph, spec, max_rows=rows_within_memory(spec), **kw)

    return reverify
