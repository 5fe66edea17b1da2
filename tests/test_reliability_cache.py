"""Cache integrity beyond tests/test_cache_faults.py: the cache package never evaluates,
executes, imports or unpickles file data (a static scan that fails if such a call
appears), and a few hostile entries that file does not try (oversized number
literals, block graphs with astronomically large grids or loops)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from test_cache_faults import cache, expect_rejected, make_entry, make_key, resign, tripwires, write_obj  # noqa: F401 - fixtures

import mirage_serve

PACKAGE = Path(mirage_serve.__file__).resolve().parent
# the cache package and the μGraph JSON parser it uses
SCANNED = sorted((PACKAGE / "cache").glob("*.py")) + [PACKAGE / "mugraph" / "serialize.py"]

FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "execfile", "breakpoint"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "yaml", "runpy", "code", "codeop", "ctypes", "subprocess"}
FORBIDDEN_ATTRS = {("torch", "load"), ("numpy", "load"), ("np", "load"), ("os", "system"), ("os", "popen"), ("os", "execv"), ("os", "execve"),
                   ("os", "spawnv"), ("importlib", "reload"), ("types", "FunctionType"), ("types", "CodeType")}


def code_execution_sites(source: str, filename: str) -> list[str]:
    """Places where ``source`` could evaluate, execute, import or unpickle data: forbidden builtins,
    modules and attributes, and ``import_module`` / ``__import__`` with a non-literal name."""
    tree = ast.parse(source, filename)
    found = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for n in names:
                if n.split(".")[0] in FORBIDDEN_MODULES:
                    found.append(f"{where}: imports {n}")
            if isinstance(node, ast.ImportFrom) and node.module in ("builtins", "importlib") and any(a.name in FORBIDDEN_CALLS | {"import_module"} for a in node.names):
                found.append(f"{where}: imports {[a.name for a in node.names]} from {node.module}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in FORBIDDEN_CALLS:
                found.append(f"{where}: calls {f.id}()")
            if isinstance(f, ast.Attribute):
                base = f.value.id if isinstance(f.value, ast.Name) else None
                if (base, f.attr) in FORBIDDEN_ATTRS:
                    found.append(f"{where}: calls {base}.{f.attr}()")
                if f.attr in FORBIDDEN_CALLS and base in ("builtins", "__builtins__"):
                    found.append(f"{where}: calls {base}.{f.attr}()")
                if f.attr == "import_module" and not (node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                    found.append(f"{where}: import_module with a computed name")
            if isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
                found.append(f"{where}: getattr with a computed name")
    return found


def test_scanner_flags_every_kind_of_code_execution():
    """The guard itself: each of these lines must be reported (so the scan below cannot pass vacuously)."""
    bad = [
        "import pickle", "from marshal import loads", "import yaml", "eval(data)", "exec(text)", "compile(src, 'f', 'exec')",
        "__import__(name)", "importlib.import_module(name)", "torch.load(path)", "np.load(path, allow_pickle=True)",
        "getattr(module, field)", "from builtins import exec", "builtins.eval(x)", "os.system(cmd)", "import subprocess",
    ]
    for line in bad:
        assert code_execution_sites(line, "<t>"), line
    ok = 'importlib.import_module("mirage_serve.codegen")\njson.loads(text)\ngetattr(os, "O_NOFOLLOW", 0)'
    assert code_execution_sites(ok, "<t>") == []


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: p.name)
def test_cache_code_never_executes_file_data(path):
    sites = code_execution_sites(path.read_text(), str(path.relative_to(PACKAGE)))
    assert sites == [], "code that could execute data read from a cache file:\n" + "\n".join(sites)


def test_scan_covers_the_whole_cache_package():
    names = {p.name for p in SCANNED}
    assert {"entry.py", "store.py", "keys.py", "serialize.py"} <= names


# -- hostile entries not covered by test_cache_faults.py ----------------------------------------


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("forloop_range", 1 << 40, "does not divide into 1099511627776 iterations"),
        ("grid", [1 << 40], "does not divide evenly over grid dim 0 (size 1099511627776)"),
        ("grid", [4, 4, 4, 4, 4], "must have 1..3 positive dims"),
        ("grid", [0], "must have 1..3 positive dims"),
        ("forloop_range", -3, "must be a positive integer"),
    ],
)
def test_block_graph_with_huge_or_bad_tiling(cache, caplog, tripwires, field, value, reason):  # noqa: F811 - fixtures
    obj = make_entry().to_obj()
    block = next(op["block"] for op in obj["mugraph"]["kernel"]["ops"] if op["kind"] == "customized")
    block[field] = value
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "invalid μGraph", reason)


def test_out_of_range_float_literal(cache, caplog, tripwires):  # noqa: F811 - fixtures
    body = json.dumps(make_entry().to_obj())
    write_obj(cache, make_key(), body.replace('"time_us": 2.0', '"time_us": 1e999'))
    expect_rejected(cache, make_key(), caplog, "not plain JSON data")


def test_input_of_absurd_rank(cache, caplog, tripwires):  # noqa: F811 - fixtures
    obj = make_entry().to_obj()
    obj["mugraph"]["kernel"]["ops"][0]["attrs"]["shape"] = [4] * 5000
    write_obj(cache, make_key(), resign(obj))
    expect_rejected(cache, make_key(), caplog, "rank 5000 not supported")


def test_integer_literal_over_the_digit_limit_is_rejected_not_raised(cache, caplog, tripwires):  # noqa: F811 - fixtures
    body = json.dumps(make_entry().to_obj())
    write_obj(cache, make_key(), body.replace('"time_us": 2.0', '"time_us": ' + "9" * 100_000))
    expect_rejected(cache, make_key(), caplog, "cannot be read", "digits")
