"""KernelCache: put/lookup, lookup fallback order, the read-only package cache,
remove, prune, verify with a re-verification hook, and the ``cache`` CLI."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from handwritten import fused_rmsnorm_linear
from hypothesis import given, settings
from hypothesis import strategies as st

from mirage_serve.cache import CacheEntry, CacheError, CacheKey, KernelCache, default_cache_dir
from mirage_serve.cache.store import ENTRIES, REJECTED
from mirage_serve.cli import main
from mirage_serve.mugraph import GraphBuilder

DIMS = {"batch": 4, "hidden": 64, "out": 32}
CERT = {"verdict": "equivalent", "trials": 3, "seed": 0}


def make_key(arch: str = "sm90", **kw) -> CacheKey:
    return CacheKey("rmsnorm_linear", kw.pop("dims", DIMS), "float32", arch, **kw)


def make_entry(arch: str = "sm90", *, tag: int = 64, cert=CERT, graph=None, **kw) -> CacheEntry:
    key = make_key(arch, **kw)
    d = key.dims_dict
    graph = graph if graph is not None else fused_rmsnorm_linear(d["batch"], d["hidden"], d["out"], n_blocks=4, loop=2)
    timings = {} if arch == "unprofiled" else {"latency_us": 3.5}
    return CacheEntry.create(key, graph, certificate=cert, params={"BLOCK_K": tag, "num_warps": 4}, timings=timings)


def unnormalized_graph(d=DIMS):
    """Right shapes, wrong function: X @ W^T without the RMSNorm."""
    g = GraphBuilder()
    x, _, w = g.input("X", (d["batch"], d["hidden"])), g.input("G", (d["hidden"],)), g.input("W", (d["out"], d["hidden"]))
    return g.build([g.matmul(x, w, trans_b=True)])


@pytest.fixture
def cache(tmp_path) -> KernelCache:
    return KernelCache(tmp_path / "user", readonly_dirs=())


def test_put_then_lookup_round_trips(cache):
    e = make_entry()
    path = cache.put(e)
    assert path == cache.path_for(e.key) and path.parent.name == ENTRIES
    got = cache.lookup(e.key)
    assert got == e and got.params == {"BLOCK_K": 64, "num_warps": 4}
    assert got.graph.outputs == e.graph.outputs
    on_disk = json.loads(path.read_text())
    assert on_disk["checksum"] == e.checksum and on_disk["key"] == e.key.to_obj()
    assert not any(p.name.startswith(".tmp-") for p in path.parent.iterdir())


def test_lookup_missing_and_empty_dir(tmp_path):
    c = KernelCache(tmp_path / "nothing-here", readonly_dirs=())
    assert c.lookup(make_key()) is None
    assert c.entries() == [] and c.scan() == []
    assert not (tmp_path / "nothing-here").exists()  # reading never creates the directory


def test_put_replaces_an_existing_entry(cache):
    cache.put(make_entry(tag=32))
    cache.put(make_entry(tag=128))
    assert cache.lookup(make_key()).params["BLOCK_K"] == 128
    assert len(cache.entries()) == 1


def test_lookup_fallback_order(tmp_path):
    user, pkg = tmp_path / "user", tmp_path / "pkg"
    c = KernelCache(user, readonly_dirs=(pkg,))
    writer_pkg = KernelCache(pkg, readonly_dirs=())
    want = make_key("sm90a")
    assert c.lookup(want) is None
    writer_pkg.put(make_entry("unprofiled", tag=1))
    assert c.lookup(want).params["BLOCK_K"] == 1  # package, unprofiled
    c.put(make_entry("unprofiled", tag=2))
    assert c.lookup(want).params["BLOCK_K"] == 2  # user before package at the same arch
    writer_pkg.put(make_entry("sm90", tag=3))
    assert c.lookup(want).params["BLOCK_K"] == 3  # a compatible arch beats unprofiled, even from the package
    c.put(make_entry("sm90", tag=4))
    assert c.lookup(want).params["BLOCK_K"] == 4
    writer_pkg.put(make_entry("sm90a", tag=5))
    assert c.lookup(want).params["BLOCK_K"] == 5  # the exact arch beats everything
    assert c.lookup(make_key("sm80")).params["BLOCK_K"] == 2  # sm80 may not use sm90 tuning: falls to unprofiled
    assert c.get(make_key("sm80")) is None  # get() has no fallback
    assert c.lookup(make_key("unprofiled")).key.gpu_arch == "unprofiled"
    assert c.lookup(make_key("sm90a", dims={**DIMS, "batch": 8})) is None


def test_package_cache_is_read_only(tmp_path, caplog):
    user, pkg = tmp_path / "user", tmp_path / "pkg"
    bad = KernelCache(pkg, readonly_dirs=()).put(make_entry())
    bad.write_text(bad.read_text().replace('"BLOCK_K": 64', '"BLOCK_K": 65'))
    c = KernelCache(user, readonly_dirs=(pkg,))
    with caplog.at_level(logging.WARNING, logger="mirage_serve.cache.store"):
        assert c.lookup(make_key()) is None
        assert c.lookup(make_key()) is None
    warnings = [r.getMessage() for r in caplog.records if "checksum mismatch" in r.getMessage()]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "read-only" in warnings[0]
    assert bad.exists() and not (pkg / REJECTED).exists()  # never moved or deleted
    c.put(make_entry(tag=8))
    assert c.lookup(make_key()).params["BLOCK_K"] == 8 and not (pkg / ENTRIES / "x").exists()
    assert all(i.location == "user" for i in c.prune())
    assert bad.exists()


def test_put_refuses_what_lookup_would_reject(cache):
    with pytest.raises(CacheError, match="not 'equivalent'"):
        cache.put(make_entry(cert={"verdict": "not_equivalent"}))
    with pytest.raises(CacheError, match="do not match spec"):
        cache.put(make_entry(dims={**DIMS, "out": 48}, graph=fused_rmsnorm_linear(4, 64, 32, 4, 2)))
    with pytest.raises(CacheError, match="codegen"):
        cache.put(make_entry(codegen_version="some-other-codegen"))
    e = make_entry()
    e.params["BLOCK_K"] = 7  # changed after create: the checksum no longer matches
    with pytest.raises(CacheError, match="checksum"):
        cache.put(e)
    assert not (cache.root / ENTRIES).exists() or not list((cache.root / ENTRIES).iterdir())


def test_create_requires_plain_data():
    with pytest.raises(CacheError, match="plain JSON"):
        make_entry(cert={"verdict": "equivalent", "obj": object()})


def test_create_accepts_certificate_objects():
    class Cert:
        verdict = "equivalent"

        def to_dict(self):
            return {"verdict": "equivalent", "trials": 5}

    e = make_entry(cert=Cert())
    assert e.certificate == {"verdict": "equivalent", "trials": 5}


def test_remove(cache, tmp_path):
    cache.put(make_entry())
    assert cache.remove(make_key()) is True
    assert cache.remove(make_key()) is False and cache.lookup(make_key()) is None
    pkg = tmp_path / "pkg"
    KernelCache(pkg, readonly_dirs=()).put(make_entry("sm80"))
    with pytest.raises(CacheError, match="read-only"):
        KernelCache(cache.root, readonly_dirs=(pkg,)).remove(make_key("sm80"))


def test_prune_removes_only_what_is_provably_stale(cache):
    good = cache.put(make_entry())
    d = good.parent
    stale = make_entry("sm80")
    obj = stale.to_obj()
    obj["key"]["triton_version"] = "0.0.1"
    from mirage_serve.cache.entry import checksum_of

    obj["checksum"] = checksum_of(obj)
    stale_key = CacheKey.from_obj(obj["key"])
    (d / stale_key.filename).write_text(json.dumps(obj))
    other_schema = d / "rmsnorm_linear-0000.json"
    other_schema.write_text(json.dumps({"format": "mirage-serve.kernel-cache-entry", "schema_version": 99, "whatever": 1}))
    tmp = d / ".tmp-rmsnorm_linear-abc-1-ff"
    tmp.write_text('{"format": "mirage')
    (d / "notes.txt").write_text("not an entry; prune leaves files it does not own")
    states = {i.path.name: i.state for i in cache.scan()}
    assert states == {good.name: "ok", stale_key.filename: "stale", other_schema.name: "stale", tmp.name: "temp"}

    planned = cache.prune(dry_run=True)
    assert {i.path.name for i in planned} == {stale_key.filename, other_schema.name, tmp.name}
    assert all(i.path.exists() for i in planned)
    removed = cache.prune()
    assert {i.path for i in removed} == {i.path for i in planned}
    assert sorted(p.name for p in d.iterdir()) == sorted([good.name, "notes.txt"])
    assert cache.lookup(make_key()) is not None


def test_prune_empties_rejected(cache):
    p = cache.put(make_entry())
    p.write_text(p.read_text()[:100])
    assert cache.lookup(make_key()) is None
    rejected = list((cache.root / REJECTED).iterdir())
    assert len(rejected) == 2  # the file and its .reason note
    assert [i.state for i in cache.scan()] == ["rejected"]
    cache.prune()
    assert list((cache.root / REJECTED).iterdir()) == [] and cache.scan() == []


def test_verify_runs_the_reverification_hook(cache):
    cache.put(make_entry())
    calls = []

    def agree(graph, spec, *, trials, seed, float_check):
        calls.append((trials, seed, float_check, [op.kind for op in spec.ops]))
        return {"verdict": "equivalent", "seed": seed}

    r = cache.verify(make_key(), agree, trials=2, seed=11)
    assert r.ok and r.status == "equivalent" and r.certificate == {"verdict": "equivalent", "seed": 11}
    assert calls == [(2, 11, False, ["input", "input", "input", "rms_norm", "matmul"])]
    assert cache.verify(make_key(), False).status == "integrity_ok"
    assert cache.verify(make_key("sm80"), agree).status == "missing"

    undecided = cache.verify(make_key(), lambda g, s, **kw: {"verdict": "unknown"})
    assert undecided.status == "unknown" and cache.lookup(make_key()) is not None

    r = cache.verify(make_key(), lambda g, s, **kw: {"verdict": "not_equivalent"})
    assert r.status == "not_equivalent" and not r.ok
    assert cache.lookup(make_key()) is None  # quarantined
    assert "NOT equivalent" in next((cache.root / REJECTED).glob("*.reason")).read_text()


def test_default_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MIRAGE_SERVE_CACHE", str(tmp_path / "env-cache"))
    assert default_cache_dir() == tmp_path / "env-cache"
    assert KernelCache(readonly_dirs=()).root == tmp_path / "env-cache"
    monkeypatch.delenv("MIRAGE_SERVE_CACHE")
    assert default_cache_dir().name == "kernels" and "mirage-serve" in str(default_cache_dir())


def test_shipped_cache_is_the_package_folder():
    from mirage_serve.cache import shipped_cache_dir

    d = shipped_cache_dir()
    assert d is not None and (d / "__init__.py").exists()
    assert KernelCache(Path("/nonexistent-user-cache"))._dirs[1].root == d


# -- the CLI -------------------------------------------------------------------------


def cli(capsys, *args):
    rc = main(["cache", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_list_show_verify_prune(cache, capsys):
    cache.put(make_entry())
    cache.put(make_entry("unprofiled", tag=16))
    d = str(cache.root)
    rc, out, _ = cli(capsys, "list", "--cache-dir", d, "--no-package")
    assert rc == 0 and "2 usable entries" in out
    row = next(line for line in out.splitlines() if " sm90 " in line)
    assert "rmsnorm_linear" in row and "batch=4,hidden=64,out=32" in row and "equivalent" in row and "yes" in row and "latency_us=3.5" in row

    rc, out, _ = cli(capsys, "list", "--cache-dir", d, "--no-package", "--json")
    items = json.loads(out)["items"]
    assert rc == 0 and {i["key"]["gpu_arch"] for i in items} == {"sm90", "unprofiled"}
    entry_id = next(i["id"] for i in items if i["key"]["gpu_arch"] == "sm90")

    rc, out, _ = cli(capsys, "show", entry_id.rpartition("-")[2][:10], "--cache-dir", d, "--no-package")
    assert rc == 0 and "float32 sm90" in out and '"BLOCK_K": 64' in out
    rc, out, _ = cli(capsys, "show", entry_id, "--cache-dir", d, "--no-package", "--json")
    assert rc == 0 and json.loads(out)["entry"]["params"] == {"BLOCK_K": 64, "num_warps": 4}

    rc, out, _ = cli(capsys, "verify", "--no-reverify", "--cache-dir", d, "--no-package")
    assert rc == 0 and "2 checked, 0 bad" in out

    path = cache.path_for(make_key())
    path.write_text(path.read_text().replace('"num_warps": 4', '"num_warps": 8'))
    rc, out, _ = cli(capsys, "verify", "--no-reverify", "--cache-dir", d, "--no-package")
    assert rc == 1 and "checksum mismatch" in out and "1 bad" in out
    assert not path.exists()  # verify moved it aside

    rc, out, _ = cli(capsys, "prune", "--dry-run", "--cache-dir", d, "--no-package")
    assert rc == 0 and "would remove 1 file" in out and list((cache.root / REJECTED).iterdir())
    rc, out, _ = cli(capsys, "prune", "--cache-dir", d, "--no-package", "--json")
    assert rc == 0 and len(json.loads(out)["removed"]) == 1
    assert [p.name for p in (cache.root / REJECTED).iterdir()] == []


def test_cli_errors_go_to_stderr_with_status_2(cache, capsys):
    rc, out, err = cli(capsys, "show", "nope", "--cache-dir", str(cache.root), "--no-package")
    assert rc == 2 and out == "" and "no cache entry matches 'nope'" in err
    cache.put(make_entry("sm90"))
    cache.put(make_entry("sm80"))
    rc, _, err = cli(capsys, "show", "rmsnorm", "--cache-dir", str(cache.root), "--no-package")
    assert rc == 2 and "matches 2 entries" in err
    blocker = cache.root.parent / "a-file"
    blocker.write_text("x")
    rc, _, err = cli(capsys, "prune", "--cache-dir", str(blocker), "--no-package")
    assert rc == 2 and err.startswith("mirage-serve cache prune:")
    assert os.path.isfile(blocker)


def test_put_waits_for_the_lock_then_says_what_to_do(cache):
    import filelock

    cache.root.mkdir(parents=True)
    other = filelock.FileLock(str(cache.root / ".lock"))
    with other:
        # a second lock object in this process stands in for another builder holding the directory
        blocked = KernelCache(cache.root, readonly_dirs=(), lock_timeout=0.2)
        with pytest.raises(CacheError, match="could not lock kernel cache .* another build is writing it"):
            blocked.put(make_entry())
        assert blocked.lookup(make_key()) is None  # reads never need the lock
    assert KernelCache(cache.root, readonly_dirs=(), lock_timeout=5).put(make_entry()).exists()


def test_spec_options_are_part_of_the_key(cache):
    key = CacheKey("rmsnorm_linear", DIMS, "float32", "sm90", options={"eps": 1e-5})
    graph = fused_rmsnorm_linear(4, 64, 32, n_blocks=4, loop=2, eps=1e-5)
    cache.put(CacheEntry.create(key, graph, certificate=CERT))
    assert cache.lookup(key).key.options_dict == {"eps": 1e-5}
    assert cache.lookup(make_key()) is None  # the model with the default eps gets no kernel built for another eps
    bad = CacheKey("rmsnorm_linear", DIMS, "float32", "sm90", options={"no_such_option": 1})
    with pytest.raises(CacheError, match="does not name a buildable spec"):
        cache.put(CacheEntry.create(bad, graph, certificate=CERT))


_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)


@settings(max_examples=40, deadline=None)
@given(
    params=st.dictionaries(_names, st.integers(-(1 << 31), 1 << 31) | st.text(max_size=20), max_size=6),
    timings=st.dictionaries(_names, st.floats(min_value=0, max_value=1e9, allow_nan=False), max_size=4),
    cert_extra=st.dictionaries(_names, st.integers() | st.text(max_size=10) | st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=3), max_size=4),
)
def test_entries_round_trip_through_their_file_text(params, timings, cert_extra):
    from mirage_serve.cache.entry import parse_entry_json

    cert = {**cert_extra, "verdict": "equivalent"}
    e = CacheEntry.create(make_key(), fused_rmsnorm_linear(4, 64, 32, 4, 2), certificate=cert, params=params, timings=timings)
    back = CacheEntry.from_obj(parse_entry_json(e.to_json().encode("ascii")))
    assert back == e and back.checksum == e.checksum


def test_cli_verify_reverifies_with_the_verifier(cache, capsys):
    pytest.importorskip("mirage_serve.verify", reason="the verifier is not in this build yet")
    cache.put(make_entry())
    cache.put(CacheEntry.create(make_key("sm80"), unnormalized_graph(), certificate=CERT))  # a false claim
    rc, out, _ = cli(capsys, "verify", "--trials", "2", "--seed", "9", "--cache-dir", str(cache.root), "--no-package", "--json")
    status = {r["id"]: r["status"] for r in json.loads(out)["results"]}
    assert rc == 1
    assert status == {make_key().entry_id: "equivalent", make_key("sm80").entry_id: "not_equivalent"}
    assert cache.lookup(make_key("sm80")) is None and cache.lookup(make_key()) is not None


def test_from_obj_allow_stale_reads_an_entry_built_for_another_triton():
    from mirage_serve.cache.entry import EntryRejected, checksum_of

    obj = make_entry().to_obj()
    obj["key"]["triton_version"] = "0.0.1"
    obj["checksum"] = checksum_of(obj)
    with pytest.raises(EntryRejected, match="triton 0.0.1") as err:
        CacheEntry.from_obj(obj)
    assert err.value.stale
    e = CacheEntry.from_obj(obj, allow_stale=True)
    assert e.key.triton_version == "0.0.1" and e.graph is not None


def test_entries_include_stale_lists_other_triton_entries_after_usable_ones(cache, tmp_path):
    """Entries of another Triton version are never usable (``entries()``, ``lookup``), but their
    μGraphs may seed a search: ``include_stale`` lists them after the usable ones; the schema and
    checksum checks still apply, so a modified stale file is left out."""
    from mirage_serve.cache.entry import checksum_of

    good = cache.put(make_entry())
    obj = make_entry("sm80").to_obj()
    obj["key"]["triton_version"] = "0.0.1"
    obj["checksum"] = checksum_of(obj)
    stale_key = CacheKey.from_obj(obj["key"])
    (good.parent / stale_key.filename).write_text(json.dumps(obj))
    bad_key_obj = dict(obj["key"], gpu_arch="sm89")
    bad = dict(obj, key=bad_key_obj)  # stale too, but its checksum no longer matches
    (good.parent / CacheKey.from_obj(bad_key_obj).filename).write_text(json.dumps(bad))

    assert [e.key for e in cache.entries()] == [make_key()]
    listed = cache.entries(include_stale=True)
    assert [e.key.triton_version for e in listed] == [make_key().triton_version, "0.0.1"]
    assert listed[1].graph is not None
    states = {i.path.name: (i.state, i.entry is not None) for i in cache.scan(stale_entries=True)}
    assert states[stale_key.filename] == ("stale", True)
    assert states[CacheKey.from_obj(bad_key_obj).filename] == ("corrupt", False)
