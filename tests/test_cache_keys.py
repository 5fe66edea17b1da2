"""Cache keys: stable hashes, version sensitivity, validation, architecture fallback."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from mirage_serve.cache import keys as keys_mod
from mirage_serve.cache.keys import SCHEMA_VERSION, UNPROFILED, CacheKey, CacheKeyError, fallback_archs

DIMS = {"batch": 8, "hidden": 4096, "out": 6144}


def key(**kw) -> CacheKey:
    base = dict(spec="rmsnorm_linear", dims=DIMS, dtype="float16", gpu_arch="sm90", codegen_version="3", triton_version="3.9.0")
    base.update(kw)
    return CacheKey(**base)


def test_digest_is_stable_across_processes():
    code = (
        "from mirage_serve.cache.keys import CacheKey;"
        "print(CacheKey('rmsnorm_linear', {'out': 6144, 'hidden': 4096, 'batch': 8}, 'float16', 'sm90',"
        " codegen_version='3', triton_version='3.9.0').digest)"
    )
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": str(s), "PATH": ""}).stdout.strip() for s in (1, 2)}
    assert outs == {key().digest}
    assert len(key().digest) == 64


def test_dim_order_does_not_matter_and_keys_are_hashable():
    a = key(dims={"batch": 8, "hidden": 4096, "out": 6144})
    b = key(dims={"out": 6144, "batch": 8, "hidden": 4096})
    assert a == b and hash(a) == hash(b) and a.digest == b.digest
    assert a.filename == f"rmsnorm_linear-{a.digest[:32]}.json"


@pytest.mark.parametrize(
    "change",
    [
        {"codegen_version": "4"},
        {"triton_version": "3.10.0"},
        {"schema_version": SCHEMA_VERSION + 1},
        {"gpu_arch": "sm80"},
        {"gpu_arch": UNPROFILED},
        {"dtype": "bfloat16"},
        {"dims": {**DIMS, "batch": 16}},
        {"options": {"eps": 1e-5}},
        {"spec": "add_rmsnorm_linear"},
    ],
)
def test_any_field_changes_the_digest(change):
    assert key(**change).digest != key().digest


def test_versions_default_to_this_installation():
    k = CacheKey("rmsnorm_linear", DIMS, "float16")
    assert k.gpu_arch == UNPROFILED
    assert k.codegen_version == keys_mod.current_codegen_version()
    assert k.triton_version == keys_mod.current_triton_version()
    assert k.is_current and k.stale_reason() is None
    stale = key(codegen_version="old-1")
    assert not stale.is_current and "codegen old-1" in stale.stale_reason()


def test_codegen_version_comes_from_codegen_when_it_defines_one(monkeypatch):
    monkeypatch.setitem(sys.modules, "mirage_serve.codegen", types.SimpleNamespace(CODEGEN_VERSION="7.1"))
    keys_mod.current_codegen_version.cache_clear()
    try:
        assert keys_mod.current_codegen_version() == "7.1"
        monkeypatch.setitem(sys.modules, "mirage_serve.codegen", types.SimpleNamespace())
        keys_mod.current_codegen_version.cache_clear()
        assert keys_mod.current_codegen_version() == keys_mod.FALLBACK_CODEGEN_VERSION
    finally:
        monkeypatch.undo()
        keys_mod.current_codegen_version.cache_clear()


def test_round_trip_and_strict_parse():
    k = key(options={"eps": 1e-5})
    assert CacheKey.from_obj(k.to_obj()) == k
    with pytest.raises(CacheKeyError, match="unexpected field"):
        CacheKey.from_obj({**k.to_obj(), "code": "import os"})
    obj = k.to_obj()
    del obj["triton_version"]
    with pytest.raises(CacheKeyError, match="missing field"):
        CacheKey.from_obj(obj)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"gpu_arch": "hopper"}, "gpu_arch"),
        ({"gpu_arch": "sm90; rm -rf"}, "gpu_arch"),
        ({"dims": {"batch": 1 << 40, "hidden": 8, "out": 8}}, "batch"),
        ({"dims": {"batch": 0, "hidden": 8, "out": 8}}, "batch"),
        ({"dims": {"batch": True, "hidden": 8, "out": 8}}, "batch"),
        ({"dims": {"../etc": 1}}, "dim name"),
        ({"dims": {f"d{i}": 1 for i in range(100)}}, "at most"),
        ({"spec": "../../evil"}, "spec name"),
        ({"dtype": "float64"}, "dtype"),
        ({"options": {"eps": float("nan")}}, "finite"),
        ({"options": {"fn": ["a"]}}, "bool, int, float or string"),
        ({"codegen_version": "1/../../x"}, "codegen_version"),
        ({"schema_version": "1"}, "schema_version"),
    ],
)
def test_malformed_keys_are_refused(change, message):
    with pytest.raises(CacheKeyError, match=message):
        key(**change)


def test_fallback_order():
    assert fallback_archs("sm90a") == ("sm90a", "sm90", UNPROFILED)
    assert fallback_archs("sm90") == ("sm90", UNPROFILED)
    assert fallback_archs("sm89") == ("sm89", "sm86", UNPROFILED)
    assert fallback_archs("sm80") == ("sm80", UNPROFILED)
    assert fallback_archs("sm100a") == ("sm100a", "sm100", UNPROFILED)
    assert fallback_archs(UNPROFILED) == (UNPROFILED,)
    with pytest.raises(CacheKeyError):
        fallback_archs("gpu")


def test_describe_names_everything():
    d = key(options={"eps": 1e-5}).describe()
    assert d == "rmsnorm_linear[batch=8,hidden=4096,out=6144] eps=1e-05 float16 sm90"
