"""Export: a trainer run directory (by the trainer's checkpoint contract) → a validated standard checkpoint."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.cli import main as cli_main
from speculators.export import ExportWarning, InvalidCheckpointError, export_checkpoint
from speculators.format import load_checkpoint, validate_checkpoint
from speculators.format.validate import errors
from tests.export.conftest import build_draft, draft_logits, make_run, state_dict_of

PNG_1PX = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c4890000000d49444154789c6360000002"
    "0001e221bc330000000049454e44ae426082"
)


@pytest.fixture(scope="module")
def drafts(verifier_dir):
    return {step: build_draft(verifier_dir, seed=step) for step in (10, 20, 30)}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, verifier_dir, drafts) -> Path:
    run = make_run(tmp_path_factory.mktemp("runs") / "run", str(verifier_dir), drafts, best_step=20)
    (run / "eval").mkdir()
    results = {"mt_bench": {"acceptance_length": 1.82, "speedup": 1.21}, "gsm8k": {"acceptance_length": 2.05}}
    (run / "eval" / "results.json").write_text(json.dumps(results))
    (run / "eval" / "acceptance.png").write_bytes(PNG_1PX)
    return run


def assert_no_debris(parent: Path, name: str) -> None:
    """Nothing in ``parent`` looks like (part of) the checkpoint ``name``: no dir, no hidden staging dir."""
    assert not (parent / name).exists()
    assert [p.name for p in parent.iterdir() if name in p.name] == []


def test_run_dir_exports_best_checkpoint_in_standard_form(run_dir, drafts, verifier_dir, tmp_path):
    out = tmp_path / "draft-bf16"
    result = export_checkpoint(run_dir, out)
    assert result.checkpoint.step == 20 and result.checkpoint.selected_by == "best"

    config, tensors = load_checkpoint(out)
    assert "model_type" not in config
    verifier = config["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(verifier_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # from the recipe
    assert config["torch_dtype"] == "bfloat16" and config["norm_before_residual"] is True
    expected = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state_dict_of(drafts[20]).items()
    }
    assert set(tensors) == set(expected)
    for name, tensor in tensors.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert errors(validate_checkpoint(out, json.loads((verifier_dir / "config.json").read_text()))) == []
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "eval_acceptance.png",
        "model.safetensors",
    ]


def test_model_card_describes_run_evaluation_and_serving(run_dir, verifier_dir, tmp_path):
    out = tmp_path / "carded"
    export_checkpoint(run_dir, out, speculative_tokens=3)
    card = (out / "README.md").read_text()
    assert str(verifier_dir.resolve()) not in card and str(run_dir) not in card  # no local path, by name only
    assert f"| verifier | `{verifier_dir.name}` |" in card
    assert f"is a directory (`{verifier_dir.name}`) on the machine that exported this draft" in card
    assert "vllm serve <this directory or repo id>" in card
    assert f"vllm serve {verifier_dir.name}" in card and '"num_speculative_tokens": 3' in card
    assert "| recipe | `eagle3_test` |" in card and "`sharegpt_builtin`" in card
    assert "training time | 4.0 min" in card  # elapsed_seconds from trainer_state.json
    assert "best acceptance length | 1.75 (step 20)" in card
    assert "| mt_bench | 1.82 | 1.21 |" in card and "| gsm8k | 2.05 |" in card
    assert "![eval_acceptance.png](eval_acceptance.png)" in card
    assert "```yaml" in card and "recipe_name: eagle3_test" in card


def test_model_card_title_says_what_the_draft_is_not_the_folder_name(run_dir, verifier_dir, tmp_path):
    out = tmp_path / "export"  # what `make demo` and most users call it
    export_checkpoint(run_dir, out)
    title = (out / "README.md").read_text().splitlines()[0]
    assert title == f"# EAGLE-3 draft for {verifier_dir.name}"


def test_card_shows_what_speculators_eval_measured(tmp_path, verifier_dir, drafts):
    """The card of a re-export (export, `speculators eval` it, export again with --eval-results, as `make demo`
    does) carries the real eval output: acceptance lengths, per-position rates and speed-ups of every run."""
    from speculators.eval.evaluation import EvalSettings, evaluate

    run = make_run(tmp_path / "run", str(verifier_dir), {10: drafts[10]}, best_step=10)
    out = tmp_path / "export"
    export_checkpoint(run, out)
    chats = [[{"role": "user", "content": f"Tell me about number {i}."}] for i in range(3)]
    settings = EvalSettings(ks=[1, 3], max_new_tokens=6, batch_size=3)
    # fp32: the card's "100%" (identical to plain decoding) is byte identity
    results = evaluate(out, prompts=chats, settings=settings, output_dir=tmp_path / "eval", dtype="float32")
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["runs"] == results["runs"]

    argv = ["export", str(run), str(out), "--eval-results", str(tmp_path / "eval" / "results.json")]
    assert cli_main(argv) == 0
    card = (out / "README.md").read_text()
    assert (
        "Measured by `speculators eval`" in card and "3 prompts from `in-memory`, up to 6 new tokens" in card
    )
    assert f"| plain (no draft) |  |  |  |  | {results['plain']['tokens_per_s']:.4g} |" in card
    for run_result in results["runs"]:
        rates = ", ".join(
            "-" if r is None else f"{r:.2f}" for r in run_result["per_position_acceptance_conditional"]
        )
        row = (
            f"| {run_result['name']} | {run_result['k']} | {run_result['acceptance_length_global']:.4g} "
            f"| {run_result['acceptance_length_per_sample_mean']:.4g} | {rates} "
            f"| {run_result['tokens_per_s']:.4g} | {run_result['speedup']:.4g} | 100% |"
        )
        assert row in card, row
    assert "![eval_acceptance.png](eval_acceptance.png)" in card and (out / "eval_acceptance.png").is_file()

    # the same results.json inside the run directory is found without the flag, and shown once with it
    evaluate(out, prompts=chats, settings=settings, output_dir=run / "eval", dtype="float32")
    assert cli_main([*argv[:3], "--eval-results", str(run / "eval" / "results.json")]) == 0
    assert (out / "README.md").read_text().count("Measured by `speculators eval`") == 1


def test_fp32_export_round_trip_is_exact(run_dir, drafts, tmp_path):
    out = tmp_path / "draft-fp32"
    export_checkpoint(run_dir / "checkpoints" / "step-30", out, dtype="float32")
    reloaded = Eagle3DraftModel.from_pretrained(out, dtype=torch.float32)
    for name, tensor in state_dict_of(reloaded).items():
        assert torch.equal(tensor, state_dict_of(drafts[30])[name]), name
    assert torch.equal(draft_logits(reloaded), draft_logits(drafts[30]))


def test_bf16_export_reloads_with_identical_bf16_logits(run_dir, drafts, tmp_path):
    out = tmp_path / "draft-bf16"
    export_checkpoint(run_dir, out)
    reloaded = Eagle3DraftModel.from_pretrained(out, dtype=torch.bfloat16)
    reference = copy.deepcopy(drafts[20]).to(torch.bfloat16)  # what the trainer's model computes in bf16
    logits = draft_logits(reloaded)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits, draft_logits(reference))


def test_embedded_verifier_name_resolves_to_its_local_directory(tmp_path, smollm2_dir):
    draft = build_draft(smollm2_dir, draft_vocab_size=256)
    run = make_run(tmp_path / "run", "smollm2", {5: draft}, best_step=5, speculative_tokens=2)
    config, _ = load_checkpoint(export_checkpoint(run, tmp_path / "out").out_dir)
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(smollm2_dir.resolve())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]


def test_wrong_verifier_is_refused_and_nothing_is_written(run_dir, small_verifier_dir, tmp_path):
    with pytest.raises((InvalidCheckpointError, ValueError), match="vocab"):
        export_checkpoint(run_dir, tmp_path / "out", verifier=str(small_verifier_dir))
    assert_no_debris(tmp_path, "out")


def test_invalid_weights_are_refused_and_an_existing_export_survives(tmp_path, verifier_dir, run_dir):
    out = tmp_path / "out"
    export_checkpoint(run_dir, out)
    before = (out / "model.safetensors").read_bytes()
    bad = build_draft(verifier_dir, seed=7)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("nan")
    bad_run = make_run(tmp_path / "diverged", str(verifier_dir), {5: bad}, best_step=5)
    with pytest.raises(InvalidCheckpointError, match="NaN"):
        export_checkpoint(bad_run, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_interrupted_export_leaves_nothing_that_looks_valid(run_dir, tmp_path, monkeypatch):
    import speculators.export.writer as writer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # the user pressing Ctrl-C while the weights are written

    monkeypatch.setattr(writer, "validate_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(run_dir, tmp_path / "out")
    assert_no_debris(tmp_path, "out")


def test_cli_export_then_validate(run_dir, tmp_path, capsys):
    out = tmp_path / "cli-out"
    assert (
        cli_main(["export", str(run_dir), str(out), "--speculative-tokens", "2", "--dtype", "float32"]) == 0
    )
    assert "exported" in capsys.readouterr().out
    config, tensors = load_checkpoint(out)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert tensors["fc.weight"].dtype == torch.float32
    assert cli_main(["validate", str(out)]) == 0
    assert cli_main(["export", str(tmp_path / "missing"), str(tmp_path / "x")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_prefixed_trainer_names_are_stripped_with_a_warning(tmp_path, verifier_dir, drafts):
    from safetensors.torch import load_file, save_file

    run = make_run(tmp_path / "run", str(verifier_dir), {10: drafts[10]}, best_step=10)
    weights = run / "checkpoints" / "step-10" / "draft" / "model.safetensors"
    save_file({"model." + k: v for k, v in load_file(str(weights)).items()}, str(weights))
    with pytest.warns(ExportWarning, match="stripped the prefix 'model.'"):
        export_checkpoint(run, tmp_path / "out")
    _, tensors = load_checkpoint(tmp_path / "out")
    assert not any(name.startswith("model.") for name in tensors)


def test_verifier_name_for_publishing_is_written_while_checks_use_the_local_copy(run_dir, tmp_path):
    from speculators.export import push_checkpoint

    out = tmp_path / "publishable"
    export_checkpoint(run_dir, out, verifier_name="example-org/tiny-llama")
    config, _ = load_checkpoint(out)
    assert config["speculators_config"]["verifier"]["name_or_path"] == "example-org/tiny-llama"
    assert "vllm serve example-org/tiny-llama" in (out / "README.md").read_text()
    calls = []

    class Recorder:
        def create_repo(self, **kwargs):
            calls.append("create_repo")

        def upload_folder(self, **kwargs):
            calls.append("upload_folder")

    push_checkpoint(out, "me/tiny-eagle3", api=Recorder())  # a hub-id verifier is publishable as it is
    assert calls == ["create_repo", "upload_folder"]


def test_export_runs_without_deepspeed_hydra_or_wandb(run_dir, tmp_path):
    """The library path imports none of the training dependencies (DeepSpeed only for ZeRO shards, lazily)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for name in ('deepspeed', 'hydra', 'wandb'): sys.modules[name] = None\n"
        "from speculators.cli import main\n"
        f"sys.exit(main(['export', {str(run_dir)!r}, {str(tmp_path / 'out')!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "out" / "config.json").is_file()


def test_bad_eval_results_fail_before_any_weight_is_read(tmp_path, verifier_dir, drafts, capsys):
    """The weights here cannot be read at all: the --eval-results error must come first (an 8B conversion takes
    minutes to reach the card)."""
    run = make_run(tmp_path / "run", str(verifier_dir), {10: drafts[10]}, best_step=10)
    (run / "checkpoints" / "step-10" / "draft" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(FileNotFoundError, match="--eval-results .*no such file"):
        export_checkpoint(run, tmp_path / "out", eval_results=tmp_path / "missing" / "results.json")
    (tmp_path / "not-results.json").write_text(json.dumps({"runs": []}))
    argv = ["export", str(run), str(tmp_path / "out"), "--eval-results", str(tmp_path / "not-results.json")]
    assert cli_main(argv) == 1
    assert "not the results.json of `speculators eval`" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
