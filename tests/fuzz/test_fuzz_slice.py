"""A bounded, seeded slice of the differential fuzzer (``python -m mirage_serve.fuzz``):
a fixed set of random programs, kernel graphs and block graphs through the float64
reference, the finite-field verifier and the generated kernels (some with NaN/Inf
inputs, some with fewer rows than the bucket). Every finding must belong to a
diagnosed cause (each with a strict-xfail regression); anything new fails here.

MIRAGE_SERVE_FUZZ_CASES sets the number of cases (default 150, 25-60 s on two
shared cores)."""

from __future__ import annotations

import logging
import os
import warnings

from mirage_serve.fuzz.runner import FuzzConfig, format_report, run_fuzz

CASES = int(os.environ.get("MIRAGE_SERVE_FUZZ_CASES", "150"))


def test_seeded_fuzz_slice_finds_nothing_new(caplog):
    logging.getLogger("mirage_serve.verify").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN/Inf arithmetic is what the faults do
        report = run_fuzz(FuzzConfig(seed=0, max_cases=CASES, minimise_s=10))
    text = format_report(report)
    assert not report.crashes, text
    new = [f for f in report.findings if not f.get("known_cause")]
    assert not new, text
    assert sum(report.cases.values()) == CASES and set(report.cases) == {"program", "kernel", "block"}, text
    outcomes = report.outcomes
    assert not any(k[0] == "reference" and k[1] not in ("agree", "explained") for k in outcomes), text
    assert not any(k[0].startswith("verifier") and "false-accept" in k for k in outcomes), text
    assert sum(v for k, v in outcomes.items() if k[0].startswith("codegen") and k[1] == "pass") >= CASES // 2, text
    assert report.faults > 0
