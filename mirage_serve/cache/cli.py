"""``mirage-serve cache list|show KEY|verify [KEY]|prune``: inspect and maintain the kernel cache.

KEY is an entry id as ``list`` prints it (``<spec>-<hash>``), any unique prefix
of it, or a unique prefix of the hash alone. Exit status: 0 success, 1 when
``verify`` found a bad entry, 2 on errors (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mirage_serve.cache.entry import CacheError
from mirage_serve.cache.store import KernelCache, ScanItem, VerifyResult
from mirage_serve.memory import retained_heap

_PREFERRED_TIMINGS = ("time_us", "latency_us", "median_us", "mean_us", "us", "latency_ms", "ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``cache`` subcommands to ``parser``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", metavar="DIR", help="the user cache directory (default: $MIRAGE_SERVE_CACHE or the platform cache dir)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--no-package", action="store_true", help="ignore the read-only cache shipped with mirage-serve")
    sub = parser.add_subparsers(dest="cache_command", metavar="SUBCOMMAND", required=True)
    sub.add_parser("list", parents=[common], help="list entries (and files that failed a check)")
    p = sub.add_parser("show", parents=[common], help="print one entry")
    p.add_argument("key", metavar="KEY", help="entry id or a unique prefix of it or of its hash")
    p = sub.add_parser("verify", parents=[common], help="re-check entries' integrity and re-verify their certificates")
    p.add_argument("key", metavar="KEY", nargs="?", help="one entry (default: all)")
    p.add_argument("--no-reverify", action="store_true", help="file checks only; do not re-run the verifier")
    p.add_argument("--trials", type=int, default=3, help="finite-field trials for re-verification (default 3)")
    p.add_argument("--seed", type=int, default=None, help="verifier seed (default: a fresh random one, printed)")
    p.add_argument("--float-check", action="store_true", help="also run the verifier's floating-point check")
    p = sub.add_parser("prune", parents=[common], help="remove stale, corrupt and rejected entries and leftover temporary files")
    p.add_argument("--dry-run", action="store_true", help="show what would be removed; remove nothing")


def run(args: argparse.Namespace) -> int:
    """Run a ``cache`` subcommand; returns the exit status."""
    try:
        cache = KernelCache(args.cache_dir, readonly_dirs=() if args.no_package else None)
        return {"list": _list, "show": _show, "verify": _verify, "prune": _prune}[args.cache_command](cache, args)
    except (CacheError, OSError, ValueError) as e:
        print(f"mirage-serve cache {args.cache_command}: {e}", file=sys.stderr)
        return 2


def _entry_id(item: ScanItem) -> str:
    return item.path.name.removesuffix(".json")


def _timing(timings: dict[str, float]) -> str:
    if not timings:
        return "-"
    name = next((t for t in _PREFERRED_TIMINGS if t in timings), sorted(timings)[0])
    return f"{name}={timings[name]:.4g}"


def _item_obj(item: ScanItem, full: bool = False) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": _entry_id(item), "path": str(item.path), "location": item.location, "state": item.state}
    if item.reason:
        obj["reason"] = item.reason
    e = item.entry
    if e is not None:
        obj.update(key=e.key.to_obj(), verdict=e.verdict, profiled=e.profiled, timings=e.timings, params=e.params, created=e.created)
        if full:
            obj["entry"] = e.to_obj()
    return obj


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _list(cache: KernelCache, args: argparse.Namespace) -> int:
    items = cache.scan()
    if args.json:
        print(json.dumps({"cache_dir": str(cache.root), "items": [_item_obj(i) for i in items]}, indent=1))
        return 0
    good = [i for i in items if i.entry is not None]
    bad = [i for i in items if i.entry is None]
    print(f"kernel cache {cache.root}: {len(good)} usable entr{'y' if len(good) == 1 else 'ies'}")
    if good:
        rows = [["ID", "SPEC", "DIMS", "DTYPE", "ARCH", "VERDICT", "PROFILED", "TIMING", "WHERE"]]
        for i in good:
            e = i.entry
            assert e is not None
            dims = ",".join(f"{k}={v}" for k, v in e.key.dims) + "".join(f" {k}={v}" for k, v in e.key.options)
            rows.append([_entry_id(i), e.key.spec, dims, e.key.dtype, e.key.gpu_arch, e.verdict, "yes" if e.profiled else "no", _timing(e.timings), i.location])
        print(_table(rows))
    if bad:
        print(f"\n{len(bad)} file(s) not usable here (`mirage-serve cache prune` removes those in the user cache):")
        for i in bad:
            print(f"  {i.state:8} {i.path}: {i.reason}")
    return 0


def _resolve(cache: KernelCache, text: str, items: list[ScanItem] | None = None) -> ScanItem:
    items = cache.scan() if items is None else items
    named = [i for i in items if i.state != "temp"]
    exact = [i for i in named if _entry_id(i) == text or i.path.name == text]
    if not exact:
        exact = [i for i in named if _entry_id(i).startswith(text) or _entry_id(i).rpartition("-")[2].startswith(text)]
    if not exact:
        raise CacheError(f"no cache entry matches {text!r}; `mirage-serve cache list` shows the ids")
    users = [i for i in exact if i.location == "user"]
    if len({_entry_id(i) for i in exact}) > 1:
        raise CacheError(f"{text!r} matches {len(exact)} entries ({', '.join(sorted({_entry_id(i) for i in exact})[:5])}…); give more of the id")
    return (users or exact)[0]


def _show(cache: KernelCache, args: argparse.Namespace) -> int:
    item = _resolve(cache, args.key)
    if args.json:
        print(json.dumps(_item_obj(item, full=True), indent=1))
        return 0
    print(f"{_entry_id(item)}  ({item.location} cache, {item.state})\n  path: {item.path}")
    if item.entry is None:
        print(f"  reason: {item.reason}")
        return 0
    e = item.entry
    from mirage_serve.mugraph import content_hash

    print(f"  key: {e.key.describe()}")
    print(f"  versions: schema {e.key.schema_version}, codegen {e.key.codegen_version}, triton {e.key.triton_version}")
    print(f"  created: {e.created}")
    print(f"  μGraph: {len(e.graph.ops)} kernel ops ({len(e.graph.customized_ops)} customized), content hash {content_hash(e.graph)[:16]}")
    print(f"  params: {json.dumps(e.params, sort_keys=True)}")
    print(f"  timings: {json.dumps(e.timings, sort_keys=True)}")
    print(f"  certificate: {json.dumps(e.certificate, sort_keys=True)}")
    print(f"  checksum: {e.checksum}")
    return 0


def _verify(cache: KernelCache, args: argparse.Namespace) -> int:
    items = cache.scan()
    targets = [_resolve(cache, args.key, items)] if args.key else [i for i in items if i.state in ("ok", "corrupt")]
    results: list[dict[str, Any]] = []
    reverify = False if args.no_reverify else None
    bad = 0
    for item in targets:
        if item.entry is None:
            moved = cache.quarantine(item.path, item.reason) if item.location == "user" and item.state == "corrupt" else None
            results.append({"id": _entry_id(item), "path": str(item.path), "status": "rejected" if item.state == "corrupt" else item.state, "reason": item.reason + (f" (moved to {moved})" if moved else "")})
            bad += item.state == "corrupt"
            continue
        with retained_heap():  # one entry's large temporaries are reused within it and given back after it
            r: VerifyResult = cache.verify(item.entry.key, reverify, trials=args.trials, seed=args.seed, float_check=args.float_check)
        results.append({"id": _entry_id(item), "path": str(r.path), "status": r.status, "reason": r.reason})
        bad += r.status in ("rejected", "not_equivalent")
    if args.json:
        print(json.dumps({"cache_dir": str(cache.root), "results": results}, indent=1))
    else:
        for r in results:
            print(f"{r['status']:15} {r['id']}: {r['reason']}")
        print(f"{len(results)} checked, {bad} bad")
    return 1 if bad else 0


def _prune(cache: KernelCache, args: argparse.Namespace) -> int:
    removed = cache.prune(dry_run=args.dry_run)
    if args.json:
        print(json.dumps({"cache_dir": str(cache.root), "dry_run": args.dry_run, "removed": [_item_obj(i) for i in removed]}, indent=1))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for i in removed:
        print(f"{verb} {i.state:8} {i.path}: {i.reason}")
    print(f"{verb} {len(removed)} file(s) from {cache.root}")
    return 0
