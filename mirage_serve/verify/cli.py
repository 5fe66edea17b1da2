"""``mirage-serve verify``: check the μGraphs of a file against a named spec.

Reads our canonical μGraph JSON or an upstream Mirage file (one or many graphs),
builds the spec in the candidate's dtype with dims read off the candidate's
input shapes (or ``--dims``), verifies, and prints each verdict with its
certificate. Exit status: 0 all equivalent, 1 any not equivalent, 2 unknown or
bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from mirage_serve.mugraph.graph import KernelGraph, MuGraphError
from mirage_serve.mugraph.serialize import graph_from_obj
from mirage_serve.specs import SPECS, build_spec, infer_dims
from mirage_serve.verify.certificate import Certificate, Verifier
from mirage_serve.verify.finite_field import DEFAULT_TRIALS
from mirage_serve.verify.float_check import graph_dtype


class BadInput(Exception):
    """The command line or the file cannot be used; the message says what to fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``mirage-serve verify``."""
    parser.add_argument("candidate", metavar="CANDIDATE.json", help="canonical μGraph JSON or an upstream Mirage μGraph file")
    parser.add_argument("--spec", required=True, metavar="NAME", help=f"the reference program; one of: {', '.join(sorted(SPECS))}")
    parser.add_argument("--dims", metavar="k=v,...", help="spec dims (default: read from the candidate's input shapes)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="verify every graph of the file and end with a summary line")
    which.add_argument("--index", type=int, metavar="N", help="verify graph N (0-based) of a file holding several")
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS, metavar="T", help=f"finite-field trials (default {DEFAULT_TRIALS})")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0); equal seeds give equal certificates")
    parser.add_argument("--no-float-check", action="store_true", help="finite-field trials only (a float failure can then go unnoticed)")
    parser.add_argument("--json", action="store_true", help="print one JSON document with every certificate")


def parse_dims(text: str) -> dict[str, int]:
    """``"batch=16,hidden=4096"`` -> ``{"batch": 16, "hidden": 4096}``."""
    dims: dict[str, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError
            dims[key.strip()] = int(value)
        except ValueError:
            raise BadInput(f"--dims: {part!r} is not name=integer (e.g. --dims batch=16,hidden=4096)") from None
    return dims


def load_graphs(path: str) -> list[KernelGraph]:
    """Every graph of a canonical or upstream Mirage μGraph file, in file order."""
    p = Path(path)
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None
    try:
        if isinstance(obj, dict):
            return [graph_from_obj(obj)]
        if isinstance(obj, list):
            from mirage_serve.mugraph.mirage_import import import_mirage_obj

            return import_mirage_obj(obj)
    except MuGraphError as e:
        raise BadInput(f"{path}: {e}") from None
    raise BadInput(f"{path}: neither a mirage-serve μGraph (a JSON object) nor an upstream Mirage file (a JSON array)")


def _select(graphs: list[KernelGraph], args: argparse.Namespace) -> list[tuple[int, KernelGraph]]:
    if args.all:
        return list(enumerate(graphs))
    if args.index is not None:
        if not 0 <= args.index < len(graphs):
            raise BadInput(f"--index {args.index}: the file holds graphs 0..{len(graphs) - 1}")
        return [(args.index, graphs[args.index])]
    if len(graphs) != 1:
        raise BadInput(f"the file holds {len(graphs)} graphs; pass --index N or --all")
    return [(0, graphs[0])]


def _spec_for(graph: KernelGraph, args: argparse.Namespace, dims_arg: dict[str, int] | None) -> tuple[KernelGraph, dict[str, int]]:
    try:
        dims = dims_arg if dims_arg is not None else infer_dims(args.spec, [graph.info[t].shape for t in graph.input_ids])
        return build_spec(args.spec, dims, dtype=graph_dtype(graph)), dims
    except MuGraphError as e:
        raise BadInput(str(e)) from None


def summary_line(counts: Counter) -> str:
    """``N equivalent, M not equivalent, K unknown``."""
    return f"{counts['equivalent']} equivalent, {counts['not_equivalent']} not equivalent, {counts['unknown']} unknown"


def exit_code(counts: Counter) -> int:
    """0 all equivalent, 1 any not equivalent, 2 otherwise (unknown)."""
    if counts["not_equivalent"]:
        return 1
    return 2 if counts["unknown"] else 0


def run(args: argparse.Namespace) -> int:
    """Verify the selected graphs; prints verdicts and certificates; returns the exit status."""
    try:
        if args.spec not in SPECS:
            raise BadInput(f"unknown spec {args.spec!r}; known specs: {', '.join(sorted(SPECS))}")
        if args.trials < 1:
            raise BadInput(f"--trials {args.trials}: at least one trial is needed")
        dims_arg = parse_dims(args.dims) if args.dims else None
        selected = _select(load_graphs(args.candidate), args)
        specs: dict[str, tuple[dict[str, int], Verifier]] = {}
        plans = []
        for index, graph in selected:
            spec, dims = _spec_for(graph, args, dims_arg)
            key = json.dumps([dims, graph_dtype(graph)], sort_keys=True)
            if key not in specs:
                specs[key] = (dims, Verifier(spec, trials=args.trials, seed=args.seed))
            plans.append((index, graph, key))
    except BadInput as e:
        print(f"mirage-serve verify: {e}", file=sys.stderr)
        return 2

    counts: Counter = Counter()
    results: list[tuple[int, dict[str, int], Certificate]] = []
    for index, graph, key in plans:
        dims, verifier = specs[key]
        cert = verifier.verify(graph, float_check=not args.no_float_check)
        counts[cert.verdict] += 1
        results.append((index, dims, cert))
        if not args.json:
            print(f"graph {index}: {cert.verdict} against {args.spec}({', '.join(f'{k}={v}' for k, v in dims.items())})")
            print("  " + cert.summary().replace("\n", "\n  "), flush=True)
    if args.json:
        doc = {
            "file": str(args.candidate),
            "spec": args.spec,
            "results": [{"index": i, "dims": d, "certificate": c.to_dict()} for i, d, c in results],
            "counts": {v: counts[v] for v in ("equivalent", "not_equivalent", "unknown")},
            "summary": summary_line(counts),
        }
        print(json.dumps(doc, indent=2, sort_keys=True))
    elif args.all:
        print(summary_line(counts))
    return exit_code(counts)
