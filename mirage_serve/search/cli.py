"""``mirage-serve search SPEC --dims k=v,...``: superoptimize one spec, print a
summary table and optionally write the verified μGraphs (best first) as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mirage_serve.mugraph.graph import DTYPES, MuGraphError
from mirage_serve.mugraph.serialize import graph_to_obj
from mirage_serve.search.config import TARGETS, SearchConfig
from mirage_serve.search.driver import Candidate, SearchResult, superoptimize


def parse_dims(text: str | None) -> dict[str, int]:
    """``"batch=16,hidden=4096"`` -> ``{"batch": 16, "hidden": 4096}`` (clear error otherwise)."""
    dims: dict[str, int] = {}
    if not text:
        return dims
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise MuGraphError(f"--dims entry {part!r} is not NAME=VALUE (e.g. --dims batch=16,hidden=4096)")
        try:
            dims[name.strip()] = int(value)
        except ValueError:
            raise MuGraphError(f"--dims {name.strip()}={value!r}: the value must be an integer") from None
    return dims


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="name of a spec in mirage_serve.specs (e.g. rmsnorm_linear)")
    parser.add_argument("--dims", default="", help="dims of the spec, NAME=VALUE,... (e.g. batch=16,hidden=4096,out=6144)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="element type of the spec's tensors")
    parser.add_argument("--time-budget", type=float, default=600.0, help="seconds before the search stops with what it has")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the verifier's random trials")
    parser.add_argument("--json", dest="json_out", default=None, help="write the verified μGraphs and statistics here")
    parser.add_argument("--no-prune", action="store_true", help="disable abstract-expression pruning (for comparison)")
    parser.add_argument("--max-kernel-ops", type=int, default=None, help="operators per kernel graph (default from SearchConfig)")
    parser.add_argument("--max-block-ops", type=int, default=None, help="operators per block graph (default from SearchConfig)")
    parser.add_argument("--target", default="H100", choices=sorted(TARGETS), help="GPU the cost model assumes")
    parser.add_argument("--top", type=int, default=10, help="rows of the summary table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _describe(c: Candidate) -> tuple[str, str]:
    grids, loops = [], []
    for op in c.graph.ops:
        if op.kind == "customized":
            grids.append("x".join(map(str, op.block.grid)))
            loops.append(str(op.block.forloop_range))
        elif op.kind != "input":
            grids.append(op.kind)
            loops.append("-")
    return " | ".join(grids), " | ".join(loops)


def format_table(result: SearchResult, top: int = 10) -> str:
    """The summary table: rank, estimated cost, kernels, grids, loop ranges, verdict."""
    rows = [("rank", "cost_us", "kernels", "grid", "loop", "verdict")]
    for i, c in enumerate(result.candidates[:top]):
        grid, loop = _describe(c)
        rows.append((str(i + 1), f"{c.cost * 1e6:.2f}", str(c.num_kernels), grid, loop, str(getattr(c.certificate, "verdict", "?"))))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    s = result.stats
    lines.append(
        f"{len(result.candidates)} verified in {s.elapsed_s:.1f}s ({'complete' if s.complete else 'partial: budget or limits cut it short'}); "
        f"enumerated {s.enumerated}, pruned by abstract expressions {s.pruned_abstract}, by other rules {s.pruned_other}, "
        f"rejected by the verifier {s.rejected}; first after {_t(s.time_to_first_s)}, best after {_t(s.time_to_best_s)}"
    )
    return "\n".join(lines)


def _t(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"


def result_to_obj(result: SearchResult, meta: dict[str, Any]) -> dict[str, Any]:
    """JSON form of a search result: verified μGraphs best first, with statistics."""
    return {
        **meta,
        "stats": result.stats.to_dict(),
        "candidates": [
            {
                "rank": i + 1,
                "cost_s": c.cost,
                "hash": c.hash,
                "cost": c.cost_detail.to_dict() if c.cost_detail else None,
                "certificate": c.certificate.to_dict() if hasattr(c.certificate, "to_dict") else None,
                "graph": graph_to_obj(c.graph),
            }
            for i, c in enumerate(result.candidates)
        ],
    }


def run(args: argparse.Namespace) -> int:
    from mirage_serve.specs import build_spec

    try:
        dims = parse_dims(args.dims)
        spec = build_spec(args.spec, dims, dtype=args.dtype)
        changes: dict[str, Any] = {}
        if args.max_kernel_ops is not None:
            changes["max_kernel_ops"] = args.max_kernel_ops
        if args.max_block_ops is not None:
            changes["max_block_ops"] = args.max_block_ops
        cfg = SearchConfig(time_budget_s=args.time_budget, jobs=args.jobs, seed=args.seed, prune=not args.no_prune,
                           progress=not args.no_progress, target=TARGETS[args.target], **changes)
        result = superoptimize(spec, cfg)
    except MuGraphError as e:
        print(f"mirage-serve search: {e}", file=sys.stderr)
        return 2
    print(format_table(result, args.top))
    if args.json_out:
        meta = {"spec": args.spec, "dims": dims, "dtype": args.dtype, "seed": args.seed, "prune": not args.no_prune,
                "target": args.target, "time_budget_s": args.time_budget}
        Path(args.json_out).write_text(json.dumps(result_to_obj(result, meta), indent=1, sort_keys=True, allow_nan=False) + "\n")
        print(f"wrote {len(result.candidates)} μGraph(s) to {args.json_out}")
    return 0 if result.candidates else 1
