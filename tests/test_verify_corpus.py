"""Every upstream Mirage μGraph in ../shared/mirage-mugraphs gets the right verdict via
``mirage-serve verify --all``: all accepted except the 190 of qknorm_gqa_bs1.json, which
upstream's single index-valued fingerprint let through and which are all wrong.

Full checks (three finite-field trials and the float16 check) at the files' own
shapes; 45 s for all 302 graphs on two shared cores (90 s when loaded). MIRAGE_SERVE_FAST_CORPUS=1 skips
the float check of the large files (finite-field trials only)."""

import json
import os

import pytest
from conftest import MUGRAPHS

from mirage_serve.cli import main

FULL = os.environ.get("MIRAGE_SERVE_FAST_CORPUS") != "1"
pytestmark = pytest.mark.skipif(not MUGRAPHS.is_dir(), reason=f"upstream Mirage corpus not found at {MUGRAPHS} (place shared/ beside the checkout)")

# file -> (spec, number of graphs, expected verdict for all of them, float check by default)
CORPUS = {
    "rmsnorm_bs1.json": ("mirage_rmsnorm", 18, "equivalent", False),
    "rmsnorm_bs8.json": ("mirage_rmsnorm", 20, "equivalent", False),
    "gqa_bs1.json": ("mirage_gqa", 28, "equivalent", False),
    "lora.json": ("mirage_lora", 4, "equivalent", True),
    "single_lora.json": ("mirage_lora", 1, "equivalent", True),
    "gated_mlp.json": ("mirage_gated_mlp", 32, "equivalent", False),
    "ntrans_bs1.json": ("mirage_ntrans", 9, "equivalent", True),
    "qknorm_gqa_bs1.json": ("mirage_qknorm_gqa", 190, "not_equivalent", True),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_file_verdicts(name, capsys):
    spec, count, expected, with_float = CORPUS[name]
    argv = ["verify", str(MUGRAPHS / name), "--spec", spec, "--all", "--json"]
    if not (with_float or FULL):
        argv.append("--no-float-check")
    rc = main(argv)
    doc = json.loads(capsys.readouterr().out)
    verdicts = [r["certificate"]["verdict"] for r in doc["results"]]
    assert len(verdicts) == count
    assert verdicts == [expected] * count, [(r["index"], r["certificate"]["reason"]) for r in doc["results"] if r["certificate"]["verdict"] != expected][:3]
    assert rc == (0 if expected == "equivalent" else 1)
    n_eq = count if expected == "equivalent" else 0
    assert doc["summary"] == f"{n_eq} equivalent, {count - n_eq} not equivalent, 0 unknown"
    if expected == "equivalent":
        # accepted graphs completed every trial (and the float check where it ran)
        for r in doc["results"]:
            cert = r["certificate"]
            assert len(cert["primes"]) == 3
            assert all(f["passed"] for f in cert["float_checks"]) and len(cert["float_checks"]) == (1 if with_float or FULL else 0)


def test_qknorm_rejections_are_certain_differences(capsys):
    # a rejection needs one trial: the first trial already shows differing outputs
    rc = main(["verify", str(MUGRAPHS / "qknorm_gqa_bs1.json"), "--spec", "mirage_qknorm_gqa", "--index", "0", "--json"])
    cert = json.loads(capsys.readouterr().out)["results"][0]["certificate"]
    assert rc == 1 and cert["verdict"] == "not_equivalent" and "differs at" in cert["reason"] and len(cert["primes"]) == 1
