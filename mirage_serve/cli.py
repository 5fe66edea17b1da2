"""The ``mirage-serve`` command line.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up, so ``--help`` stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "build-cache": ("mirage_serve.cmd_build_cache", "search, verify, generate and tune kernels for a model; fill the kernel cache"),
    "search": ("mirage_serve.search.cli", "superoptimize one spec and print the verified μGraphs found"),
    "verify": ("mirage_serve.verify.cli", "check a μGraph file against a named spec"),
    "show": ("mirage_serve.mugraph.cli", "print a μGraph file readably (or its canonical JSON)"),
    "cache": ("mirage_serve.cache.cli", "list, show, verify or prune kernel-cache entries"),
    "bench": ("mirage_serve.cmd_bench", "run the kernel or end-to-end latency benchmarks"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirage-serve", description="A superoptimizer for the kernels of LLM inference.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            try:
                importlib.import_module(module).add_arguments(p)
            except ModuleNotFoundError as e:
                if e.name != module:
                    raise
                p.set_defaults(_missing=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    args = build_parser(only=command).parse_args(argv)
    # -v: each line with its wall-clock time, so a long build's log says where the time went
    fmt = ("%(asctime)s " if args.verbose else "") + "%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)], format=fmt, datefmt="%H:%M:%S")
    if args.command is None:
        build_parser(only="").print_help()
        return 2
    if getattr(args, "_missing", None):
        print(f"mirage-serve {args.command}: not available in this build", file=sys.stderr)
        return 2
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
