"""What the rest of the machine did while a benchmark measured: CPU-seconds of every process outside our own tree.

A speed figure counts only when the decoding had the machine to itself, so every timed run records the CPU time
that other processes used during its window (``/proc/stat`` busy time minus the CPU time of this process and its
descendants, read from ``/proc/<pid>/stat``). Linux only; elsewhere the figures are ``None``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# a window whose other processes used more than this share of one core is reported as contended
CONTENDED_SHARE = 0.10


def _machine_busy_seconds() -> float | None:
    """CPU-seconds all cores have spent busy since boot (user, nice, system, irq, softirq, steal)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def _process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU-seconds used so far) for every live process."""
    table: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return table


def _our_tree_seconds(root: int) -> float:
    """CPU-seconds of ``root`` and its live descendants (children that exited are counted by the kernel into
    their parent's cutime only once reaped, so long-lived workers are what this sees)."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += table.get(pid, (0, 0.0))[1]
        stack.extend(children.get(pid, []))
    return total


@dataclass
class LoadWindow:
    """Use as ``with LoadWindow() as window: ...``; afterwards ``window.report()``."""

    wall_s: float = 0.0
    machine_busy_s: float | None = None
    ours_s: float | None = None

    def __enter__(self) -> LoadWindow:
        self._t0 = time.perf_counter()
        self._busy0 = _machine_busy_seconds()
        self._ours0 = _our_tree_seconds(os.getpid())
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t0
        busy = _machine_busy_seconds()
        if busy is not None and self._busy0 is not None:
            self.machine_busy_s = busy - self._busy0
            self.ours_s = _our_tree_seconds(os.getpid()) - self._ours0

    def report(self) -> dict[str, float | bool | None]:
        """Wall time, our CPU, other processes' CPU and their share of one core; ``contended`` above 10 %."""
        if self.machine_busy_s is None or self.ours_s is None or self.wall_s <= 0:
            return {"wall_s": round(self.wall_s, 2), "others_cpu_s": None, "contended": None}
        others = max(0.0, self.machine_busy_s - self.ours_s)
        share = others / self.wall_s
        return {
            "wall_s": round(self.wall_s, 2),
            "ours_cpu_s": round(self.ours_s, 2),
            "others_cpu_s": round(others, 2),
            "others_core_share": round(share, 3),
            "contended": share > CONTENDED_SHARE,
        }
