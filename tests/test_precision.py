"""The compute-dtype decision (speculators.precision): the hardware rule on each kind of processor, the order of
authority (recipe > SPECULATORS_COMPUTE_DTYPE > hardware), and every caller of ``auto`` routed through it.

Other processors are described by their /proc/cpuinfo text and torch's capability string (this machine cannot be
an AVX2-only one); this machine's own facts are read for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators import precision
from speculators.precision import ENV_VAR, choose, cpu_facts, parse_cpuinfo

AVX2_ONLY = (
    "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) CPU E5-2690 v4\nflags\t\t: fpu sse2 avx avx2 fma\n"
)
AVX512_BF16 = (
    "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx avx2 avx512f avx512_bf16 avx512_vnni\n"
    "processor\t: 1\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu avx avx2 avx512f avx512_bf16 avx512_vnni\n"
)
AMX = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx2 avx512f amx_bf16 amx_tile\n"


def test_an_avx2_only_cpu_computes_in_fp32():
    cpu = parse_cpuinfo(AVX2_ONLY, "AVX2")
    choice = choose("auto", "cpu", cpu=cpu, env={})
    assert choice.dtype == torch.float32 and choice.source == "auto"
    assert "~30x slower" in choice.reason
    record = choice.to_json()
    assert record["cpu"] == {
        "model": "Intel(R) Xeon(R) CPU E5-2690 v4",
        "capability": "AVX2",
        "flags": {"avx512_bf16": False, "amx_bf16": False, "avx512f": False, "avx2": True},
    }
    assert record["dtype"] == "float32" and record["device"] == "cpu"


@pytest.mark.parametrize(("cpuinfo", "flag"), [(AVX512_BF16, "avx512_bf16"), (AMX, "amx_bf16")])
def test_a_cpu_with_native_bf16_computes_in_bf16(cpuinfo, flag):
    choice = choose("auto", "cpu", cpu=parse_cpuinfo(cpuinfo, "AVX512"), env={})
    assert choice.dtype == torch.bfloat16 and flag in choice.reason
    assert choice.to_json()["cpu"]["flags"][flag] is True


def test_cuda_takes_bf16_where_the_device_supports_it():
    cpu = parse_cpuinfo(AVX2_ONLY, "AVX2")  # the host CPU does not matter for a CUDA device
    if torch.cuda.is_available():  # the real device decides
        expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        assert choose("auto", "cuda", cpu=cpu, env={}).dtype == expected
    else:  # no GPU here: the device's answer is given
        assert choose("auto", "cuda", cpu=cpu, env={}, cuda_bf16=True).dtype == torch.bfloat16
        assert choose("auto", "cuda", cpu=cpu, env={}, cuda_bf16=False).dtype == torch.float32


def test_recipe_beats_environment_beats_hardware():
    fast = parse_cpuinfo(AVX512_BF16, "AVX512")
    assert choose("auto", "cpu", cpu=fast, env={}).source == "auto"
    env = {ENV_VAR: "float32"}
    by_env = choose("auto", "cpu", cpu=fast, env=env)
    assert (by_env.dtype, by_env.source) == (torch.float32, "env") and ENV_VAR in by_env.reason
    by_recipe = choose("bf16", "cpu", cpu=parse_cpuinfo(AVX2_ONLY, "AVX2"), env=env, key="train.dtype")
    assert (by_recipe.dtype, by_recipe.source) == (torch.bfloat16, "recipe")
    assert by_recipe.reason == "train.dtype=bfloat16 set explicitly"
    assert choose("auto", "cpu", cpu=fast, env={ENV_VAR: "auto"}).source == "auto"  # auto defers


def test_unknown_names_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="train.dtype='float7'"):
        choose("float7", key="train.dtype", env={})
    with pytest.raises(ValueError, match=ENV_VAR):
        choose("auto", env={ENV_VAR: "int8"})


def test_this_machines_facts_are_read_from_proc_cpuinfo():
    facts = cpu_facts()
    assert facts.capability == torch.backends.cpu.get_cpu_capability()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = set(
            next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split()
        )
        assert set(facts.flags) == flags & set(precision.RECORDED_FLAGS)
    hardware = choose("auto", "cpu", env={})
    assert hardware.dtype == (torch.bfloat16 if facts.native_bf16 else torch.float32)


def test_every_auto_caller_goes_through_the_decision(monkeypatch):
    from speculators.serving.vllm_bridge import VllmRequest, current_placement
    from speculators.verifier import resolve_dtype
    from train.assemble import compute_dtype, compute_precision

    monkeypatch.setenv(ENV_VAR, "bfloat16")
    assert resolve_dtype("auto") == compute_dtype("auto") == torch.bfloat16
    assert compute_precision("auto").source == "env"
    request = VllmRequest(model="m", prompts=["hi"])  # dtype "auto" by default
    assert request.to_job()["engine"]["dtype"] == request.to_job()["dtype"] == "bfloat16"
    assert (
        current_placement(VllmRequest(model="m", prompts=["hi"], dtype="float32")).engine["dtype"]
        == "float32"
    )
    monkeypatch.setenv(ENV_VAR, "float32")
    assert resolve_dtype("auto") == compute_dtype("auto") == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16  # the recipe's value is kept


def test_the_bench_machine_record_names_the_processor_and_the_choice():
    record = precision.machine_record()
    json.dumps(record)
    assert record["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(record["cpu"]["flags"]) == set(precision.RECORDED_FLAGS)
    assert record["auto_dtype"]["cpu"]["dtype"] == choose("auto", "cpu", env={}).name
