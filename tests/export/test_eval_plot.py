"""The evaluation plot names the draft by its recipe and algorithm (never by its directory, usually ``export``), and
with a single k shows per-position acceptance and the speed-ups instead of a one-point acceptance-vs-k curve."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.eval.evaluation import EvalSettings, draft_identity, evaluate
from speculators.eval.plot import build_figure
from speculators.export import export_checkpoint
from tests.export.conftest import build_draft, make_run

HASS = {"recipe_name": "hass_tiny", "train": {"algorithm": "hass", "ttt_steps": 3}}


def _results(ks: list[int], speedups: bool = True, vllm: bool = False) -> dict:
    runs = [
        {
            "name": f"chain-k{k}",
            "method": "chain",
            "k": k,
            "acceptance_length_global": 1.0 + 0.4 * k,
            "acceptance_length_per_sample_mean": 0.9 + 0.4 * k,
            "per_position_acceptance_conditional": [0.8, 0.6, 0.5][:k],
            **({"speedup": 1.1 + 0.2 * k} if speedups else {}),
        }
        for k in ks
    ]
    results = {
        "draft": "/home/alice/runs/hass_tiny/export",
        "draft_name": "hass_tiny (HASS)",
        "verifier": "/root/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/0a1b2c3",
        "runs": runs,
    }
    if vllm:
        results["vllm"] = {
            f"chain-k{k}": {"acceptance_length": 1.3 + 0.4 * k, "speedup_vs_vllm_plain": 1.5} for k in ks
        }
    return results


def _close(figure) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


def test_one_k_shows_the_speedup_not_a_one_point_curve():
    figure = build_figure(_results([3], vllm=True))
    try:
        left, right = figure.axes
        assert figure._suptitle.get_text() == "hass_tiny (HASS) on HuggingFaceTB/SmolLM2-135M-Instruct"
        assert [line.get_ydata().tolist() for line in left.lines] == [[0.8, 0.6, 0.5]]  # per position
        assert right.get_title() == "Speed-up over plain decoding"
        assert all(len(line.get_xdata()) != 1 or line.get_linestyle() == ":" for line in right.lines)
        heights = sorted(round(bar.get_height(), 3) for bar in right.patches)
        assert heights == [1.5, 1.7]  # ours and vLLM's, each over its own plain run
        assert any("1.70x" in text.get_text() and "AL 2.20" in text.get_text() for text in right.texts)
    finally:
        _close(figure)


def test_one_k_without_a_baseline_shows_acceptance_length_of_the_ceiling():
    figure = build_figure(_results([3], speedups=False))
    try:
        right = figure.axes[1]
        assert "no plain baseline" in right.get_title()
        assert [round(bar.get_height(), 3) for bar in right.patches] == [2.2]
        assert any(text.get_text() == "2.20 of 4" for text in right.texts)
    finally:
        _close(figure)


def test_several_ks_keep_the_acceptance_curve():
    figure = build_figure(_results([1, 2, 3]))
    try:
        right = figure.axes[1]
        assert right.get_title() == "Acceptance length vs k"
        assert right.lines[0].get_xdata().tolist() == [1, 2, 3]
        assert right.patches == [] or all(p.get_height() == 0 for p in right.patches)
    finally:
        _close(figure)


@pytest.fixture(scope="module")
def hass_run(tmp_path_factory, verifier_dir):
    root = tmp_path_factory.mktemp("hass")
    draft = build_draft(verifier_dir, seed=3)
    run = make_run(root / "hass_tiny", str(verifier_dir), {10: draft}, best_step=10, extra_recipe=HASS)
    return run


def test_the_draft_is_named_by_recipe_and_algorithm_wherever_it_is_read_from(hass_run, tmp_path):
    exported = export_checkpoint(hass_run, tmp_path / "export").out_dir
    bare = export_checkpoint(hass_run, tmp_path / "export-no-card", model_card=False).out_dir
    model = Eagle3DraftModel.from_pretrained(exported, dtype=torch.float32)
    step = hass_run / "checkpoints" / "step-10"
    assert draft_identity(hass_run, step / "draft", model)["name"] == "hass_tiny (HASS)"
    assert draft_identity(step, step / "draft", model)["name"] == "hass_tiny (HASS)"
    assert draft_identity(exported, exported, model) == {
        "recipe": "hass_tiny",
        "algorithm": "hass",
        "name": "hass_tiny (HASS)",
    }  # from the card `speculators export` wrote
    assert draft_identity(bare, bare, model)["name"] == "EAGLE-3 draft"  # no card: the config's algorithm
    assert draft_identity(None, None, model)["name"] == "EAGLE-3 draft"


def test_evaluating_an_export_titles_results_and_plot_by_recipe(hass_run, tmp_path):
    exported = export_checkpoint(hass_run, tmp_path / "export").out_dir
    chats = [[{"role": "user", "content": f"Count to {i}."}] for i in range(2)]
    settings = EvalSettings(ks=[2], max_new_tokens=4, batch_size=2)
    results = evaluate(exported, prompts=chats, settings=settings, output_dir=tmp_path / "eval")
    written = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert written["draft_name"] == results["draft_name"] == "hass_tiny (HASS)"
    assert (written["draft_recipe"], written["draft_algorithm"]) == ("hass_tiny", "hass")
    assert (tmp_path / "eval" / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    figure = build_figure(written)
    try:
        assert figure._suptitle.get_text().startswith("hass_tiny (HASS) on ")
        assert "export" not in figure._suptitle.get_text()
        assert figure.axes[1].get_title() == "Speed-up over plain decoding"
    finally:
        _close(figure)
