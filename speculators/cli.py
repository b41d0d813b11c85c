"""The ``speculators`` console script: validate, export, convert, eval, push.

Each subcommand lives next to the code it drives and registers itself through ``add_parser(subparsers)``; this
module only wires them together, so ``speculators --help`` lists everything the library can do.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that define ``add_parser(subparsers)``; each sets ``func`` on its parser. Imported lazily by name so
# that ``speculators validate`` does not pay for the decoding engine's imports.
SUBCOMMAND_MODULES = (
    "speculators.format.command",
    "speculators.export.command",
    "speculators.eval.command",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speculators", description="Speculative-decoding drafts in the standard speculators format."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
