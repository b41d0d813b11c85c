"""The ``speculators`` console script: validate, export, convert, eval, push.

Each subcommand lives next to the code it drives and registers itself through ``add_parser(subparsers)``; this
module only wires them together, so ``speculators --help`` lists everything the library can do.
"""

from __future__ import annotations

import argparse
import importlib
import os
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


# What a user's mistake raises (a wrong path, a directory of the wrong kind, a bad value, a missing optional
# package): shown as one ``error:`` line naming the file and the fix, exit status 1. Anything else is our bug and
# keeps its traceback; SPECULATORS_TRACEBACK=1 shows the traceback of a user error too.
USER_ERRORS = (ValueError, OSError, KeyError, ImportError)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as exc:
        if os.environ.get("SPECULATORS_TRACEBACK") == "1":
            raise
        print(f"error: {user_message(exc)}", file=sys.stderr)
        return 1


def user_message(exc: BaseException) -> str:
    """The exception's own message (a KeyError's without the repr quotes); its type only when it says nothing."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return text or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
