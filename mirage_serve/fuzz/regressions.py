"""Saved fuzz findings: load one, replay its check, write a new one.

A regression file is JSON::

    {"name": ..., "check": "codegen" | "verifier" | "reference", "tag": ..., "detail": ...,
     "xfail": null | "why it still fails (the component and the cause)",
     "data": {"seed": ..., "faults": ..., "rows": ..., "expect": ...},
     "graphs": {"graph": <μGraph JSON>} or {"candidate": ..., "spec": ...}}

:func:`replay` re-runs the check the finding came from on the saved graphs and
returns ``None`` when it now passes (or the IR now refuses the graphs), or what
still disagrees.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mirage_serve.mugraph.graph import KernelGraph, MuGraphError
from mirage_serve.mugraph.serialize import graph_from_obj, graph_to_obj

REQUIRED = {"name", "check", "tag", "detail", "xfail", "data", "graphs"}


def load(path: str | Path) -> dict[str, Any]:
    """A regression entry with its graphs parsed; ``refused`` holds the IR's error when it no longer
    accepts them (then ``graphs`` is empty)."""
    entry = json.loads(Path(path).read_text())
    missing = REQUIRED - set(entry)
    if missing:
        raise ValueError(f"{path}: regression file lacks {sorted(missing)}")
    try:
        entry["graphs"] = {n: graph_from_obj(g) for n, g in entry["graphs"].items()}
        entry["refused"] = None
    except MuGraphError as e:  # the IR refuses the construct now (replay passes)
        entry["graphs"], entry["refused"] = {}, str(e)
    return entry


def replay(entry: dict[str, Any]) -> str | None:
    """Re-run the entry's check: None if it passes now, else what still fails."""
    from mirage_serve.fuzz.oracles import check_codegen, check_reference_agrees, check_verifier

    d, g = entry["data"], entry["graphs"]
    if entry.get("refused"):
        return None
    try:
        for graph in g.values():
            graph.validate()
    except MuGraphError:
        return None  # the IR refuses the construct now: nothing left to disagree about
    if entry["check"] == "codegen":
        r = check_codegen(g["graph"], d["seed"], faults=d.get("faults", 0), rows=d.get("rows"))
        return None if r.outcome in ("pass", "rejected", "explained") else f"{r.tag}: {r.finding.detail if r.finding else ''}"
    if entry["check"] == "verifier":
        r = check_verifier(g["candidate"], g["spec"], d["seed"], expect=d.get("expect"), what=entry["name"])
        return None if r.outcome in ("agree", "unknown", "explained") else f"{r.tag}: {r.finding.detail if r.finding else ''}"
    if entry["check"] == "reference":
        f = check_reference_agrees(g, d["seed"])
        return None if f is None else f"{f.tag}: {f.detail}"
    raise ValueError(f"unknown check {entry['check']!r}")


def save(path: str | Path, name: str, check: str, tag: str, detail: str, graphs: dict[str, KernelGraph], data: dict[str, Any], xfail: str | None) -> Path:
    """Write a regression file (graphs in canonical μGraph JSON)."""
    obj = {"name": name, "check": check, "tag": tag, "detail": detail, "xfail": xfail, "data": data,
           "graphs": {n: graph_to_obj(g) for n, g in graphs.items()}}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    return p
