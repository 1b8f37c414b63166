"""The ``stepwatch`` command. Each subcommand lives in its own module and registers itself.

A subcommand module exposes ``register(subparsers)`` which adds its parser and sets
``func=callable(args) -> int`` as the parser default. Modules are imported only when the command
line is parsed, so ``import stepwatch`` stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that provide subcommands, in the order `stepwatch --help` lists them.
SUBCOMMAND_MODULES = (
    "stepwatch.report.cli",
    "stepwatch.rules.cli",
    "stepwatch.doctor.cli",
    "stepwatch.serving.cli",
    "stepwatch.runner.cli",
    "stepwatch.comm.cli",
    "stepwatch.traces.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog="stepwatch",
        description="PyTorch training-loop instrumentation: records, findings, captures.",
    )
    parser.add_argument("--version", action="version", version=f"stepwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in SUBCOMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
