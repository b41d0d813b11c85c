"""`make bench`: run every benchmark in turn and write bench/results/SUMMARY.md from their JSON results.

Each benchmark of :data:`bench.MAKE_BENCH` is a module whose ``run()`` writes ``bench/results/<name>.json``; this
runner only sequences them (one at a time, each ``python -m bench.<module>`` in a process of its own: they measure
throughput on a shared CPU) and bench/summary.py condenses the headline figures of every result file into
SUMMARY.md. A benchmark that fails is reported at the end; the others still run.

    python -m bench.run                  # all benchmarks (the acceptance one's headline run: every drafter of ours
                                         # at equal CPU, under 2 h on 2 cores; the peer lanes and the curve are
                                         # `make bench-extended`: python -m bench.acceptance_bench --run extended)
    python -m bench.run --only engine    # a subset, by name (python bench/run.py works too)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench import MAKE_BENCH
from bench.record import REPO, RESULTS

# name (its result file) -> module; the order is cheapest first, so a quick look at the suite needs no trained draft.
BENCHMARKS = {module.removesuffix("_bench"): module for module in MAKE_BENCH}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these benchmarks")
    parser.add_argument(
        "--summary-only", action="store_true", help="rewrite SUMMARY.md from existing results"
    )
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        print(hardware_line(), flush=True)
    status: dict[str, str] = {}
    for name, module in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        if args.summary_only:
            break
        print(f"\n==> bench {name}: python -m bench.{module}", flush=True)
        start = time.monotonic()
        code = subprocess.call([sys.executable, "-m", f"bench.{module}"], cwd=REPO)
        status[name] = f"exit {code} after {time.monotonic() - start:.0f} s"
    for name, outcome in status.items():
        print(f"bench {name}: {outcome}")
    from bench.summary import write

    print(f"wrote {write().relative_to(REPO)}")
    return 0 if all(s.startswith("exit 0") for s in status.values()) else 1


def hardware_line() -> str:
    """What the figures are measured on, printed first: figures from different processors are not comparable."""
    from speculators.precision import machine_record

    record = machine_record()
    cpu, flags = record["cpu"], record["cpu"]["flags"]
    auto = ", ".join(f"{device} {d['dtype']} ({d['reason']})" for device, d in record["auto_dtype"].items())
    return (
        f"hardware: {cpu['model']}, {__import__('os').cpu_count()} CPUs, torch {record['torch']} capability "
        f"{cpu['capability']}, flags {' '.join(f for f, on in flags.items() if on) or 'none'}; auto dtype: {auto}"
        + (f"; GPU {record['cuda_device']}" if "cuda_device" in record else "")
    )


if __name__ == "__main__":
    sys.exit(main())
