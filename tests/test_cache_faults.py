"""Faults: every damaged, forged or hostile entry is rejected with a clear reason,
moved aside, and never executed; concurrent and killed writers leave the cache
consistent.

Forgeries here recompute the checksum (it detects corruption, it is not a
signature), so each case reaches the check it is about.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import multiprocessing
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from handwritten import fused_rmsnorm_linear

from mirage_serve.cache import CacheEntry, CacheError, CacheKey, KernelCache
from mirage_serve.cache.entry import checksum_of
from mirage_serve.cache.store import ENTRIES, REJECTED
from mirage_serve.mugraph import GraphBuilder, graph_to_obj
from mirage_serve.reference import execute, random_inputs

TESTS = Path(__file__).resolve().parent
DIMS = {"batch": 4, "hidden": 64, "out": 32}
CERT = {"verdict": "equivalent", "trials": 3, "seed": 0}


def make_key(arch: str = "sm90", dims=None) -> CacheKey:
    return CacheKey("rmsnorm_linear", dims or DIMS, "float32", arch)


def make_entry(arch: str = "sm90", tag: int = 64, dims=None, graph=None) -> CacheEntry:
    key = make_key(arch, dims)
    d = key.dims_dict
    graph = graph if graph is not None else fused_rmsnorm_linear(d["batch"], d["hidden"], d["out"], n_blocks=4, loop=2)
    return CacheEntry.create(key, graph, certificate=CERT, params={"BLOCK_K": tag}, timings={"time_us": 2.0})


@pytest.fixture
def cache(tmp_path) -> KernelCache:
    return KernelCache(tmp_path / "cache", readonly_dirs=())


@contextlib.contextmanager
def no_code_execution():
    """Fail if anything is evaluated, compiled, executed or unpickled inside the block."""

    def trip(*a, **k):
        raise AssertionError("a cache entry caused code to be evaluated, executed or unpickled")

    saved = [(mod, name, getattr(mod, name)) for mod, name in ((builtins, "eval"), (builtins, "exec"), (builtins, "compile"), (pickle, "loads"), (pickle, "load"))]
    for mod, name, _ in saved:
        setattr(mod, name, trip)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@pytest.fixture
def tripwires(tmp_path):
    """A payload that would leave a marker file if any part of an entry were ever executed."""
    marker = tmp_path / "PWNED"
    return f"__import__('os').system('touch {marker}')", marker


def resign(obj: dict) -> dict:
    obj["checksum"] = checksum_of(obj)
    return obj


def expect_rejected(cache: KernelCache, key: CacheKey, caplog, *reason_parts: str) -> str:
    """``lookup`` misses, logs one warning naming the file and reason, and moves the file to rejected/."""
    path = cache.path_for(key)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mirage_serve.cache.store"), no_code_execution():
        assert cache.lookup(key) is None
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1, msgs
    assert str(path) in msgs[0] and "moved to" in msgs[0]
    for part in reason_parts:
        assert part in msgs[0], (part, msgs[0])
    assert not os.path.lexists(path)
    notes = list((cache.root / REJECTED).glob(f"{path.name}.*.reason"))
    assert notes and all(os.path.lexists(str(n)[: -len(".reason")]) for n in notes)  # kept, with its reason beside it
    assert any(reason_parts[0] in n.read_text() for n in notes)
    # the builder's next put restores it
    cache.put(make_entry(key.gpu_arch, dims=key.dims_dict))
    assert cache.lookup(key) is not None
    return msgs[0]


def write_obj(cache: KernelCache, key: CacheKey, obj) -> Path:
    path = cache.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_truncated_entry(cache, caplog, tripwires):
    path = cache.put(make_entry())
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    expect_rejected(cache, make_key(), caplog, "not valid JSON (truncated or corrupt)")
    path.write_bytes(b"")
    expect_rejected(cache, make_key(), caplog, "not valid JSON")


def test_flipped_byte_in_content(cache, caplog, tripwires):
    path = cache.put(make_entry())
    path.write_text(path.read_text().replace('"BLOCK_K": 64', '"BLOCK_K": 65'))
    expect_rejected(cache, make_key(), caplog, "checksum mismatch", "modified or corrupted")


def test_random_bit_flips_never_serve_changed_content(cache, tripwires):
    """Flip one bit at many positions: the lookup either rejects the file or returns exactly the original entry
    (a flip that only changed formatting, e.g. whitespace)."""
    good = make_entry()
    path = cache.put(good)
    original = path.read_bytes()
    rng = random.Random(1234)
    served_same = rejected = 0
    for pos in rng.sample(range(len(original)), 120):
        damaged = bytearray(original)
        damaged[pos] ^= 1 << rng.randrange(8)
        logging.disable(logging.WARNING)
        try:
            path.write_bytes(bytes(damaged))
            with no_code_execution():
                got = cache.lookup(good.key)
        finally:
            logging.disable(logging.NOTSET)
        if got is None:
            rejected += 1
        else:
            assert got == good
            served_same += 1
    assert rejected > 100
    assert len(list((cache.root / REJECTED).glob("*.reason"))) == rejected


def test_entry_from_another_schema_version(cache, caplog, tripwires):
    obj = make_entry().to_obj()
    obj["schema_version"] = 2
    obj["key"]["schema_version"] = 2
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "schema version 2", "this build reads version 1")
    write_obj(cache, make_key(), {"format": "mirage-serve.kernel-cache-entry", "schema_version": 0, "graph": []})
    expect_rejected(cache, make_key(), caplog, "schema version 0")


def test_graph_that_does_not_match_its_key(cache, caplog, tripwires):
    obj = make_entry().to_obj()
    obj["mugraph"] = graph_to_obj(fused_rmsnorm_linear(8, 64, 32, 4, 2))  # batch 8 in a batch-4 entry
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "μGraph inputs [[8, 64]:float32", "do not match spec rmsnorm_linear[batch=4,hidden=64,out=32]")

    g = GraphBuilder()  # right inputs, an output of the wrong shape
    x, _, _ = g.input("X", (4, 64)), g.input("G", (64,)), g.input("W", (32, 64))
    obj["mugraph"] = graph_to_obj(g.build([x]))
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "μGraph outputs [[4, 64]:float32] do not match")

    obj = make_entry("sm80").to_obj()  # a valid entry, but for another key, under this key's name
    write_obj(cache, make_key(), obj)
    expect_rejected(cache, make_key(), caplog, "float32 sm80", "not to the file's name")


def test_invalid_or_non_canonical_mugraph(cache, caplog, tripwires):
    obj = make_entry().to_obj()
    obj["mugraph"]["kernel"]["ops"][3]["kind"] = "python"
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "invalid μGraph", "unknown operator kind 'python'")
    obj = make_entry().to_obj()
    obj["mugraph"]["kernel"]["ops"][3]["attrs"] = {}  # parses, but the canonical form omits empty attrs
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "not in canonical form")


def reference_reverifier(graph, spec, *, trials, seed, float_check):
    """Stand-in re-verification: compare the candidate with the spec on random float64 inputs
    through the reference executor (a real numerical check, used to test the hook)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        xs = random_inputs(spec, gen, dtype=torch.float64)
        for a, b in zip(execute(graph, xs), execute(spec, xs)):
            if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-9, atol=1e-9):
                return {"verdict": "not_equivalent", "seed": seed}
    return {"verdict": "equivalent", "seed": seed}


def _verifier():
    try:
        from mirage_serve.verify import verify_equivalent
    except ImportError:
        return None
    return verify_equivalent


@pytest.mark.parametrize("which", ["reference stand-in", "mirage_serve.verify"])
def test_forged_certificate_is_caught_by_reverification(cache, caplog, which):
    reverify = reference_reverifier if which == "reference stand-in" else _verifier()
    if reverify is None:
        pytest.skip("mirage_serve.verify.verify_equivalent is not in this build yet")
    g = GraphBuilder()  # right shapes, wrong function (no RMSNorm), certificate claiming equivalence
    x, _, w = g.input("X", (4, 64)), g.input("G", (64,)), g.input("W", (32, 64))
    forged = CacheEntry.create(make_key(), g.build([g.matmul(x, w, trans_b=True)]), certificate=CERT)
    cache.put(forged)
    # integrity checks alone cannot tell: the file is well formed and says "equivalent"
    assert cache.lookup(make_key()) == forged
    assert cache.verify(make_key(), reverify, trials=2, seed=5).status == "not_equivalent"
    assert cache.lookup(make_key()) is None
    assert "NOT equivalent" in next((cache.root / REJECTED).glob("*.reason")).read_text()
    # an honest entry passes the same re-verification
    cache.put(make_entry())
    assert cache.verify(make_key(), reverify, trials=2, seed=5).status == "equivalent"


def test_genuine_certificate_transplanted_onto_another_graph_or_spec(cache, caplog):
    verify_equivalent = _verifier()
    if verify_equivalent is None:
        pytest.skip("mirage_serve.verify.verify_equivalent is not in this build yet")
    from mirage_serve.specs import build_spec

    honest = fused_rmsnorm_linear(4, 64, 32, n_blocks=4, loop=2)
    cert = verify_equivalent(honest, build_spec("rmsnorm_linear", DIMS, "float32"), trials=2, seed=3, float_check=False)
    assert cert.verdict == "equivalent"
    cache.put(CacheEntry.create(make_key(), honest, certificate=cert))
    assert cache.lookup(make_key()) is not None

    g = GraphBuilder()  # the same certificate on a μGraph it was not issued for
    x, _, w = g.input("X", (4, 64)), g.input("G", (64,)), g.input("W", (32, 64))
    wrong = g.build([g.matmul(x, w, trans_b=True)])
    with pytest.raises(CacheError, match="certificate was issued for μGraph"):
        CacheEntry.create(make_key(), wrong, certificate=cert)
    obj = make_entry().to_obj()
    obj["certificate"], obj["mugraph"] = cert.to_dict(), graph_to_obj(wrong)
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "certificate was issued for μGraph")

    # the right μGraph and certificate, filed under a key whose spec differs (another eps): same shapes
    other = CacheKey("rmsnorm_linear", DIMS, "float32", "sm90", options={"eps": 1e-5})
    with pytest.raises(CacheError, match="certificate was issued against spec"):
        CacheEntry.create(other, honest, certificate=cert)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda o: o.update(code="__PAYLOAD__"), "unexpected field(s) ['code']"),
        (lambda o: o["key"].update(loader="__PAYLOAD__"), "unexpected field(s) ['loader']"),
        (lambda o: o["mugraph"]["kernel"].update(hook="__PAYLOAD__"), "unexpected key(s) ['hook']"),
        (lambda o: o["mugraph"]["kernel"]["ops"][3]["block"].update(src="__PAYLOAD__"), "unexpected key(s) ['src']"),
        (lambda o: o.update(params={"BLOCK_K": {"__reduce__": "__PAYLOAD__"}}), "must be an integer or a string"),
        (lambda o: o.update(params={"__PAYLOAD__": 1}), "tuning parameter name"),
        (lambda o: o.update(timings={"time_us": "__PAYLOAD__"}), "finite non-negative number"),
        (lambda o: o.update(certificate={"verdict": "equivalent", "z": [[[[[[[[["__PAYLOAD__"]]]]]]]]]}), "certificate nested deeper"),
        (lambda o: o.update(certificate={"verdict": "not_equivalent", "note": "__PAYLOAD__"}), "not 'equivalent'"),
        (lambda o: o.update(certificate="__PAYLOAD__"), "certificate must be a JSON object"),
        (lambda o: o.update(created="__PAYLOAD__"), "must be a UTC time"),
        (lambda o: o.pop("timings"), "missing field(s) ['timings']"),
        (lambda o: o.update(format="__PAYLOAD__"), "not a mirage-serve kernel-cache entry"),
    ],
)
def test_unexpected_or_malformed_fields(cache, caplog, tripwires, mutate, reason):
    payload, marker = tripwires
    obj = make_entry().to_obj()
    mutate(obj)
    obj = json.loads(json.dumps(obj).replace("__PAYLOAD__", json.dumps(payload)[1:-1]))
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, reason)
    assert not marker.exists()


def test_huge_dimensions(cache, caplog, tripwires):
    obj = make_entry().to_obj()
    obj["key"]["dims"]["batch"] = 1 << 40
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "bad key", "dim batch=1099511627776 must be an integer in 1..16777216")

    obj = make_entry().to_obj()  # a μGraph of astronomically large tensors under a small key
    obj["mugraph"]["kernel"]["ops"][0]["attrs"]["shape"] = [1 << 40, 64]
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "μGraph inputs [[1099511627776, 64]:float32", "do not match spec")

    obj = make_entry().to_obj()  # far too many operators
    obj["mugraph"]["kernel"]["ops"] = obj["mugraph"]["kernel"]["ops"][:1] * 5000
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "5000 operators exceeds the limit of 4096")

    path = cache.path_for(make_key())  # a file far larger than any entry: refused before parsing
    path.write_bytes(b" " * (5 << 20))
    expect_rejected(cache, make_key(), caplog, "over the 4194304-byte limit")


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deep_nesting(cache, caplog, tripwires, depth):
    obj = make_entry().to_obj()
    body = json.dumps(resign(obj))
    deep = "[" * depth + "]" * depth
    write_obj(cache, make_key(), body[:-1] + f', "deep": {deep}}}')
    expect_rejected(cache, make_key(), caplog, "nested deeper than 18 levels")


def test_json_tricks(cache, caplog, tripwires):
    body = json.dumps(make_entry().to_obj())
    write_obj(cache, make_key(), body[:-1] + ', "params": {}}')
    expect_rejected(cache, make_key(), caplog, "duplicate JSON key 'params'")
    write_obj(cache, make_key(), body.replace('"time_us": 2.0', '"time_us": NaN'))
    expect_rejected(cache, make_key(), caplog, "non-finite number NaN")
    write_obj(cache, make_key(), "[]")
    expect_rejected(cache, make_key(), caplog, "an entry must be a JSON object")
    cache.path_for(make_key()).write_bytes(b"\x80\x04\x95" + pickle.dumps({"a": 1}, protocol=2))
    expect_rejected(cache, make_key(), caplog, "not UTF-8")


def test_symlink_pointing_outside_the_cache(cache, caplog, tmp_path, tripwires):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    target = KernelCache(outside, readonly_dirs=()).put(make_entry())  # a perfectly valid entry, outside
    link = cache.path_for(make_key())
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    expect_rejected(cache, make_key(), caplog, "symlink")
    assert target.exists() and KernelCache(outside, readonly_dirs=()).lookup(make_key()) is not None
    moved = [p for p in (cache.root / REJECTED).iterdir() if not p.name.endswith(".reason")]
    assert len(moved) == 1 and moved[0].is_symlink()  # the link itself was moved, not its target

    link.unlink()  # a link inside the cache is refused as well
    inside = cache.root / "copy.json"
    inside.write_bytes(target.read_bytes())
    link.symlink_to(inside)
    expect_rejected(cache, make_key(), caplog, "symlink")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_under_an_entry_name_does_not_hang(cache, caplog):
    path = cache.path_for(make_key())
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    expect_rejected(cache, make_key(), caplog, "not a regular file")


def test_entries_folder_symlinked_outside_is_ignored(tmp_path, caplog):
    outside = tmp_path / "elsewhere"
    KernelCache(outside, readonly_dirs=()).put(make_entry())
    root = tmp_path / "cache"
    root.mkdir()
    (root / ENTRIES).symlink_to(outside / ENTRIES)
    c = KernelCache(root, readonly_dirs=())
    with caplog.at_level(logging.WARNING, logger="mirage_serve.cache.store"):
        assert c.lookup(make_key()) is None and c.scan() == []
    assert any("symlink" in r.getMessage() for r in caplog.records)
    with pytest.raises(Exception, match="symlink"):
        c.put(make_entry())
    assert (outside / ENTRIES / make_key().filename).exists()


# -- concurrency and crashes ----------------------------------------------------------


def _builder(root: str, worker: int, rounds: int) -> None:
    c = KernelCache(root, readonly_dirs=(), lock_timeout=60)
    for r in range(rounds):
        for b in (1, 2, 3):  # keys every worker writes
            c.put(make_entry(tag=100 * worker + r, dims={**DIMS, "batch": b}))
        c.put(make_entry(tag=r, dims={**DIMS, "batch": 10 + worker}))  # this worker's own key
        assert c.lookup(make_key(dims={**DIMS, "batch": 1 + r % 3})) is not None


def test_concurrent_builders_end_consistent(tmp_path):
    root = tmp_path / "shared"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_builder, args=(str(root), w, 6)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    c = KernelCache(root, readonly_dirs=())
    states = [i.state for i in c.scan()]
    assert states == ["ok"] * 7  # 3 shared keys + 4 own keys, nothing corrupt, no temp files left
    assert not (root / REJECTED).exists()
    for b in (1, 2, 3):
        assert c.lookup(make_key(dims={**DIMS, "batch": b})).params["BLOCK_K"] % 100 == 5  # a last round won
    for w in range(4):
        assert c.lookup(make_key(dims={**DIMS, "batch": 10 + w})).params["BLOCK_K"] == 5


WRITER = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    from test_cache_faults import DIMS, make_entry
    from mirage_serve.cache import KernelCache
    c = KernelCache({root!r}, readonly_dirs=())
    die_in_put = int(sys.argv[1])
    for b in range(1, 13):
        if b == die_in_put:
            real_replace = os.replace
            os.replace = lambda *a: os._exit(9)  # die after the temp file is written, before the rename
        c.put(make_entry(dims={{**DIMS, "batch": b}}))
        print(b, flush=True)
    """
)


def _run_writer(root: Path, die_in_put: int, kill_after: int | None = None) -> int:
    code = WRITER.format(tests=str(TESTS), root=str(root))
    p = subprocess.Popen([sys.executable, "-c", code, str(die_in_put)], stdout=subprocess.PIPE, text=True)
    if kill_after is not None:
        for _ in range(kill_after):
            p.stdout.readline()
        p.send_signal(signal.SIGKILL)
    p.communicate(timeout=120)
    return p.returncode


def test_killed_writer_then_resumed(tmp_path):
    root = tmp_path / "cache"
    assert _run_writer(root, die_in_put=5) == 9
    c = KernelCache(root, readonly_dirs=())
    items = c.scan()
    assert [i.state for i in items].count("ok") == 4
    assert [i.state for i in items].count("temp") == 1  # the half-finished write is not an entry
    assert all(i.state in ("ok", "temp") for i in items)
    assert c.lookup(make_key(dims={**DIMS, "batch": 5})) is None

    assert _run_writer(root, die_in_put=0, kill_after=3) == -signal.SIGKILL  # killed at an arbitrary point
    assert all(i.state in ("ok", "temp") for i in c.scan())

    assert _run_writer(root, die_in_put=0) == 0  # resumed: runs to completion (the lock was released by the kernel)
    for b in range(1, 13):
        assert c.lookup(make_key(dims={**DIMS, "batch": b})) is not None
    removed = c.prune()
    assert {i.state for i in removed} <= {"temp"} and len(removed) >= 1
    assert [i.state for i in c.scan()] == ["ok"] * 12
