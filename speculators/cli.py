"""The ``speculators`` console script: validate, export, convert, eval, push.

Each subcommand lives next to the code it drives and registers itself through ``add_parser(subparsers)``; this
module only wires them together, so ``speculators --help`` lists everything the library can do.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

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


@contextmanager
def user_errors_as_one_line(errors: tuple[type[BaseException], ...] = USER_ERRORS) -> Iterator[None]:
    """For the other entry points (``train/run.py``, ``data_gen/run.py``, under Hydra): ``errors`` raised inside
    end the process with one ``error:`` line and exit status 1 instead of a traceback (``SystemExit`` passes
    through Hydra's own exception report). SPECULATORS_TRACEBACK=1 re-raises."""
    try:
        yield
    except errors as exc:
        if os.environ.get("SPECULATORS_TRACEBACK") == "1":
            raise
        print(f"error: {user_message(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def user_message(exc: BaseException) -> str:
    """The exception's own message (a KeyError's without the repr quotes); its type only when it says nothing."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return text or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
