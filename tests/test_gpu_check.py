"""scripts/gpu_check.sh runs on CPU (--cpu-smoke) before a GPU ever sees it, and its built-in recipe is the real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import REPO_ROOT


def _load_gpu_check():
    """scripts/gpu_check.py as a module, loaded from its file (scripts/ is not a package, nor put on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


def test_cpu_smoke_runs_every_section_without_hydra_or_deepspeed(tmp_path):
    out = tmp_path / "gpu_check.json"
    guard = (
        "import sys; sys.modules.update(dict.fromkeys(['hydra', 'omegaconf', 'deepspeed', 'datasets', 'vllm']));"
        f"sys.argv = ['gpu_check', '--cpu-smoke', '--out', {str(out)!r}];"
        f"import runpy; runpy.run_path({str(REPO_ROOT / 'scripts' / 'gpu_check.py')!r}, run_name='__main__')"
    )  # importing any of them fails: the GPU host does not have them
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", guard], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["cpu_smoke"]
    assert report["flex_vs_dense"]["float32"]["ok"] and report["flex_vs_dense"]["bfloat16"]["ok"]
    assert report["train"]["loss_fell"] and report["train"]["tokens_per_s"] > 0
    assert report["capture"]["tokens_per_s"] > 0 and report["export"]["ok"]


def test_the_built_in_recipe_is_eagle3_llama8b():
    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipes"), version_base=None):
        cfg = OmegaConf.to_container(
            compose(config_name="config", overrides=["recipe=eagle3_llama8b"]), resolve=True
        )
    for section, values in gpu_check.RECIPE.items():
        if isinstance(values, dict):
            for key, value in values.items():
                if isinstance(value, dict):
                    assert {k: cfg[section][key][k] for k in value} == value, (section, key)
                else:
                    assert cfg[section][key] == value, (section, key)
        else:
            assert cfg[section] == values
