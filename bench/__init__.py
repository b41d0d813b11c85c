"""The benchmarks: each writes ``bench/results/<name>.json`` and renders its own section of
``bench/results/SUMMARY.md``.

A bench is a module with ``RESULTS`` (the result files it writes, by stem), ``run(argv)`` (measure and write them)
and ``render(result)`` (its section's lines). What every bench shares (where results go, the machine a result was
measured on, writing a result, the pieces of a summary section) is :mod:`bench.record`. ``python -m bench.<name>``
runs one (``python bench/<name>.py`` too); ``python -m bench.run`` (``make bench``) runs :data:`MAKE_BENCH` in turn
and ``python -m bench.summary`` regenerates SUMMARY.md by calling every bench's ``render``.

Libraries of the benches, not benches: :mod:`bench.record`, :mod:`bench.machine_load` (the CPU other processes
took while a bench measured), :mod:`bench.learning_curve`, :mod:`bench.acceptance_measure`, and the peer lane
(``speculators==0.9.0``'s trainer on our data): :mod:`bench.peer_lane` with :mod:`bench.peer_data`,
:mod:`bench.peer_algorithms` and :mod:`bench.peer_trainer` (``bench/peer_launch.py`` runs under the peer's
interpreter and imports nothing from here).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# `make bench` (bench/run.py), cheapest first: a quick look at the suite needs no trained draft
MAKE_BENCH = ("data_gen_bench", "train_bench", "engine_bench", "acceptance_bench")
# each alone on an idle machine, outside make bench's budget
STANDALONE = (
    "dtype_bench",
    "fp8_bench",
    "capture_backends",
    "stream_bench",
    "levers_bench",
    "drafter_levers_bench",
    "vllm_timing_bench",
    "adapt_bench",
)
BENCHES = MAKE_BENCH + STANDALONE


def bench_modules() -> list[ModuleType]:
    """Every bench module, in :data:`BENCHES` order."""
    return [importlib.import_module(f"bench.{name}") for name in BENCHES]
