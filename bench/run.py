"""`make bench`: run every benchmark in turn and write bench/results/SUMMARY.md from their JSON results.

Each benchmark is a plain script that writes ``bench/results/<name>.json``; this runner only sequences them (one at
a time: they measure throughput on a shared CPU) and bench/summary.py condenses the
headline figures of every result file into SUMMARY.md.
A benchmark that fails is reported at the end; the others still run.

    python bench/run.py                  # all benchmarks (the acceptance one trains eight drafts: ~2 h on 2 cores)
    python bench/run.py --only engine    # a subset, by name
"""

from __future__ import annotations

import argparse
import runpy
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# name -> script; the order is cheapest first, so a quick look at the suite needs no trained draft.
BENCHMARKS = {
    "data_gen": "bench/data_gen_bench.py",
    "train": "bench/train_bench.py",
    "engine": "bench/engine_bench.py",
    "acceptance": "bench/acceptance_bench.py",
}


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
    for name, script in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        if args.summary_only:
            break
        print(f"\n==> bench {name}: {script}", flush=True)
        start = time.monotonic()
        code = subprocess.call([sys.executable, str(REPO / script)], cwd=REPO)
        status[name] = f"exit {code} after {time.monotonic() - start:.0f} s"
    for name, outcome in status.items():
        print(f"bench {name}: {outcome}")
    # loaded from its file: run as a script or through runpy, bench/ is not on sys.path nor a package
    write_summary = runpy.run_path(str(REPO / "bench" / "summary.py"))["write"]
    print(f"wrote {write_summary().relative_to(REPO)}")
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
