"""`make demo` trains the drafter the full bench measured fastest at one request at a time; quick-bench figures
(60 CPU-seconds of training, 2 timed prompts) never choose it."""

from __future__ import annotations

import importlib.util
import json

from tests.conftest import REPO_ROOT


def _demo_recipe():
    spec = importlib.util.spec_from_file_location("demo_recipe", REPO_ROOT / "scripts" / "demo_recipe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path, speedups):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": {"speedup_c1": speedups}}))


def test_the_fastest_served_learnt_drafter_is_picked_and_ngram_or_engine_only_ones_are_not(
    tmp_path, monkeypatch
):
    module = _demo_recipe()
    monkeypatch.setattr(module, "REPO", tmp_path)
    _write(
        tmp_path / "bench/results/acceptance.json",
        {
            "eagle3": {"k1": 0.9, "k3": 1.05},
            "dflash": {"k4": 1.2},
            "ngram": {"k3": 1.5},
            "dspark_engine": {"k3": 1.9},
            "peer": {"k3": 1.4},
        },
    )
    recipe, reason = module.pick()
    assert recipe == "dflash_smollm2" and "1.20x plain at k4" in reason and "eagle3 1.05x (k3)" in reason


def test_quick_bench_figures_never_choose_the_demo(tmp_path, monkeypatch):
    module = _demo_recipe()
    monkeypatch.setattr(module, "REPO", tmp_path)
    _write(tmp_path / "bench/results/acceptance_quick.json", {"peagle": {"k2": 1.8}})
    recipe, reason = module.pick()
    assert recipe == module.FALLBACK and "no speed-up measured" in reason
