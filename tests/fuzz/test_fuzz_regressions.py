"""Saved fuzz findings (tests/fuzz/regressions/*.json), replayed through the check that found
them. Entries whose cause is still open are strict xfails naming the component and the cause,
so a fix shows up as an XPASS (then drop the entry's ``xfail``). An entry whose graphs the IR
now refuses names the refusal in ``data.refused_with``."""

from __future__ import annotations

from pathlib import Path

import pytest

from mirage_serve.fuzz.regressions import load, replay
from mirage_serve.fuzz.runner import KNOWN_CAUSES, known_cause

REGRESSIONS = sorted((Path(__file__).parent / "regressions").glob("*.json"))


@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: p.stem)
def test_regression(path, request):
    entry = load(path)
    if entry["xfail"]:
        request.applymarker(pytest.mark.xfail(strict=True, reason=entry["xfail"]))
    if entry["refused"]:  # the IR refuses the graphs now: for the reason the entry names, not another
        assert entry["data"].get("refused_with") and entry["data"]["refused_with"] in entry["refused"], entry["refused"]
    assert replay(entry) is None


def test_every_open_cause_has_a_saved_regression():
    covered = set()
    for p in REGRESSIONS:
        e = load(p)
        if e["xfail"]:
            covered.add(known_cause(e["check"] if e["tag"] != "reference-crash" else "reference", e["tag"].removeprefix("reference-"), e["graphs"]))
    for check, tag, cause, _ in KNOWN_CAUSES:
        assert cause in covered, f"no saved regression for the known cause ({check}/{tag}): {cause}"
