"""The compute dtype: one decision, made at run time by what the processor does fast, recorded with its reason.

Processors differ. A CPU with ``avx512_bf16`` (or AMX) multiplies bf16 matrices 3-4x faster than fp32 (measured on
a 2-core AMD EPYC: 1024^2 matmuls at 635 vs 183 GFLOP/s); an AVX2-only CPU emulates bf16 and runs it ~30x
SLOWER than fp32. So "auto" cannot be a fixed dtype: it is bf16 where the hardware has native bf16 (CUDA with bf16
support, a CPU with ``avx512_bf16`` or ``amx_bf16``) and fp32 elsewhere.

Order of authority (the first that names a dtype wins):

1. the recipe key (``train.dtype``, ``verifier.dtype`` — capture, online training and eval —, ``--dtype`` of
   ``speculators eval``, ``VllmRequest.dtype``) when it is not ``auto``;
2. the environment variable :data:`ENV_VAR` (``auto`` | ``float32`` | ``bfloat16``): one switch for a whole
   machine or test suite;
3. the hardware rule above.

:func:`choose` returns a :class:`Precision`: the dtype, who decided (``recipe`` / ``env`` / ``auto``), why, the
device, and the CPU facts the rule read (model, ``torch.backends.cpu.get_cpu_capability()``, the relevant
``/proc/cpuinfo`` flags). Runs write :meth:`Precision.to_json` next to their results so a figure is never compared
with one from another processor or dtype unawares.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

ENV_VAR = "SPECULATORS_COMPUTE_DTYPE"
AUTO = "auto"
CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # native bf16 dot products (AVX-512 BF16, AMX tiles)
RECORDED_FLAGS = (*BF16_FLAGS, "avx512f", "avx2")
ALIASES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16", "float": "float32"}


@dataclass(frozen=True)
class CpuFacts:
    """What the hardware rule reads about the CPU."""

    model: str
    capability: str  # torch.backends.cpu.get_cpu_capability(): the ATen kernels torch dispatches to
    flags: tuple[str, ...]  # those of RECORDED_FLAGS the CPU has

    @property
    def native_bf16(self) -> bool:
        return any(flag in self.flags for flag in BF16_FLAGS)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "capability": self.capability,
            "flags": {flag: flag in self.flags for flag in RECORDED_FLAGS},
        }


def parse_cpuinfo(text: str, capability: str) -> CpuFacts:
    """:class:`CpuFacts` of a ``/proc/cpuinfo`` text (the first processor's model name and flags)."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return CpuFacts(
        model or platform.processor() or platform.machine(),
        capability,
        tuple(flag for flag in RECORDED_FLAGS if flag in flags),
    )


@lru_cache(maxsize=1)
def cpu_facts() -> CpuFacts:
    """This machine's CPU facts (read once per process)."""
    try:
        text = CPUINFO.read_text()
    except OSError:  # not Linux: no flags, so the rule keeps fp32 on CPU
        text = ""
    return parse_cpuinfo(text, torch.backends.cpu.get_cpu_capability())


@dataclass(frozen=True)
class Precision:
    """One dtype decision and why it was made."""

    dtype: torch.dtype
    source: str  # "recipe" | "env" | "auto"
    reason: str
    device: str
    cpu: CpuFacts

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.name,
            "source": self.source,
            "reason": self.reason,
            "device": self.device,
            "cpu": self.cpu.to_json(),
            "torch": torch.__version__,
        }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str) -> torch.dtype | None:
    """``None`` for ``auto``, else the torch dtype ``name`` (aliases bf16/fp32/fp16 accepted); ``where`` names the
    setting in the error."""
    name = ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if name in (AUTO, ""):
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}={name!r}: unknown dtype; use auto, float32, bfloat16 or float16")
    return dtype


def hardware_dtype(
    device: str | torch.device, cpu: CpuFacts, cuda_bf16: bool | None = None
) -> tuple[torch.dtype, str]:
    """The hardware rule: (dtype, reason). ``cuda_bf16`` defaults to ``torch.cuda.is_bf16_supported()``."""
    kind = torch.device(device).type
    if kind == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = torch.cuda.is_bf16_supported()
        if cuda_bf16:
            return torch.bfloat16, "CUDA device with bf16 support"
        return torch.float32, "CUDA device without bf16 support"
    if kind != "cpu":
        return torch.float32, f"{kind} device: fp32 (no rule for its bf16 speed)"
    if cpu.native_bf16:
        found = ", ".join(flag for flag in BF16_FLAGS if flag in cpu.flags)
        return torch.bfloat16, f"CPU has native bf16 ({found}): bf16 matmuls run ~3-4x faster than fp32"
    return (
        torch.float32,
        "CPU without avx512_bf16/amx_bf16: bf16 would be emulated (~30x slower than fp32 on AVX2)",
    )


def choose(
    requested: str | torch.dtype = AUTO,
    device: str | torch.device = "cpu",
    *,
    cpu: CpuFacts | None = None,
    env: dict[str, str] | None = None,
    cuda_bf16: bool | None = None,
    key: str = "dtype",
) -> Precision:
    """The compute dtype for ``device``: ``requested`` (a recipe value) unless ``auto``, then :data:`ENV_VAR`
    unless unset or ``auto``, then :func:`hardware_dtype`. ``key`` names the recipe setting in errors; ``cpu``,
    ``env`` and ``cuda_bf16`` default to this machine's (tests pass others' hardware)."""
    cpu = cpu or cpu_facts()
    env = os.environ if env is None else env
    device_name = torch.device(device).type
    dtype = requested if isinstance(requested, torch.dtype) else parse_dtype(requested, key)
    if dtype is not None:
        return Precision(dtype, "recipe", f"{key}={dtype_name(dtype)} set explicitly", device_name, cpu)
    dtype = parse_dtype(env.get(ENV_VAR, AUTO), ENV_VAR)
    if dtype is not None:
        return Precision(dtype, "env", f"{ENV_VAR}={dtype_name(dtype)}", device_name, cpu)
    dtype, reason = hardware_dtype(device, cpu, cuda_bf16)
    return Precision(dtype, "auto", reason, device_name, cpu)


def machine_record() -> dict[str, Any]:
    """The hardware a bench figure was measured on, with what ``auto`` chooses there (CPU and, if any, CUDA)."""
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    record: dict[str, Any] = {"cpu": cpu_facts().to_json(), "torch": torch.__version__, "auto_dtype": {}}
    for device in devices:
        choice = choose(AUTO, device, env={})
        record["auto_dtype"][device] = {"dtype": choice.name, "reason": choice.reason}
    if torch.cuda.is_available():
        record["cuda_device"] = torch.cuda.get_device_name(0)
    return record


__all__ = [
    "AUTO",
    "ENV_VAR",
    "CpuFacts",
    "Precision",
    "choose",
    "cpu_facts",
    "dtype_name",
    "hardware_dtype",
    "machine_record",
    "parse_cpuinfo",
    "parse_dtype",
]
