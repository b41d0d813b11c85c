"""Fault injection: run the ``speculators`` console script and SIGKILL it at a named point of its own code.

``python -m tests.support.kill_at MODULE:FUNCTION before|after -- ARGV...`` wraps ``FUNCTION`` of ``MODULE`` so the
process kills itself (SIGKILL: no ``finally`` block, no clean-up runs) the first time it is called, before or after
the real call, then runs ``speculators ARGV``. The command under test runs unchanged up to that point: this is what
a power cut, the OOM killer or ``kill -9`` does to it there.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys


def arm(target: str, when: str) -> None:
    module_name, _, function_name = target.partition(":")
    module = importlib.import_module(module_name)
    real = getattr(module, function_name)

    @functools.wraps(real)
    def killing(*args, **kwargs):
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(module, function_name, killing)


def main(argv: list[str]) -> int:
    target, when, separator, *command = argv
    if separator != "--" or when not in ("before", "after"):
        raise SystemExit("usage: kill_at MODULE:FUNCTION before|after -- SPECULATORS-ARGV...")
    arm(target, when)
    from speculators.cli import main as cli_main

    return cli_main(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
