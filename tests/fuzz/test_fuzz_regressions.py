"""Saved fuzz findings (tests/fuzz/regressions/*.json), replayed through the check that found
them. Entries whose cause is still open are strict xfails naming the component and the cause,
so a fix shows up as an XPASS (then drop the entry's ``xfail``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mirage_serve.fuzz.regressions import load, replay
from mirage_serve.fuzz.runner import KNOWN_CAUSES

REGRESSIONS = sorted((Path(__file__).parent / "regressions").glob("*.json"))


@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: p.stem)
def test_regression(path, request):
    entry = load(path)
    if entry["xfail"]:
        request.applymarker(pytest.mark.xfail(strict=True, reason=entry["xfail"]))
    assert replay(entry) is None


def test_every_open_cause_has_a_saved_regression():
    entries = [load(p) for p in REGRESSIONS]
    tags = {(e["check"], e["tag"].removeprefix("reference-")) for e in entries if e["xfail"]}
    for check, tag, cause, _ in KNOWN_CAUSES:
        assert (check, tag) in tags, f"no saved regression for the known cause {check}/{tag}: {cause}"
