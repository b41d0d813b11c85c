"""``speculators eval`` and the ``evaluate`` API: draft layouts, prompt files, results JSON and plot."""

from __future__ import annotations

import copy
import json

import pytest

from speculators.cli import main
from speculators.eval.prompts import load_prompts, render_prompts


@pytest.fixture(scope="module")
def exported_draft(tmp_path_factory, fitted_llama_draft, tiny_llama_dir):
    """The fitted draft saved in the standard format, naming the tiny Llama as its verifier."""
    draft = copy.deepcopy(fitted_llama_draft)
    draft.config.speculators_config.verifier.name_or_path = str(tiny_llama_dir)
    return draft.save_pretrained(
        tmp_path_factory.mktemp("drafts") / "fitted", dtype=__import__("torch").float32
    )


def test_cli_writes_results_and_plot(exported_draft, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(
        [
            "eval",
            str(exported_draft),
            "--k",
            "1",
            "3",
            "--tree",
            "--tree-topk",
            "2",
            "--tree-depth",
            "3",
            "--tree-budget",
            "5",
            "--max-prompts",
            "6",
            "--max-new-tokens",
            "16",
            "--batch-size",
            "3",
            "--output",
            str(out),
            "--dtype",
            "float32",  # matches_plain == 1 is byte identity: fp32 (auto may pick bf16 on this CPU)
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert (results["precision"]["dtype"], results["precision"]["source"]) == ("float32", "recipe")
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert (
        results["verifier"]
        == json.loads((exported_draft / "config.json").read_text())["speculators_config"]["verifier"][
            "name_or_path"
        ]
    )
    assert results["prompts"]["count"] == 6 and results["plain"]["generated_tokens"] > 0
    assert [r["name"] for r in results["runs"]] == ["chain-k1", "chain-k3", "tree-top2-d3-n5"]
    for run in results["runs"]:
        assert run["matches_plain"] == 1.0  # greedy speculative output equals plain output
        assert 1.0 <= run["acceptance_length_per_sample_mean"] <= run["k"] + 1
        assert 1.0 < run["acceptance_length_global"] <= run["k"] + 1  # the fitted draft is accepted sometimes
        assert len(run["per_position_acceptance_conditional"]) == run["k"] and run["speedup"] > 0
    assert "chain-k3" in capsys.readouterr().out


def test_api_resolves_a_trainer_run_and_samples(exported_draft, tmp_path, tiny_llama, smollm2_tokenizer):
    import shutil

    from speculators.eval import evaluate
    from speculators.eval.evaluation import EvalSettings

    step = tmp_path / "run" / "checkpoints" / "step-7"
    shutil.copytree(exported_draft, step / "draft")
    (tmp_path / "run" / "checkpoints" / "best.json").write_text(json.dumps({"step": 7, "path": "step-7"}))
    settings = EvalSettings(ks=[2], temperature=0.8, top_p=0.9, max_new_tokens=12, max_prompts=4)
    results = evaluate(tmp_path / "run", (tiny_llama, smollm2_tokenizer), settings=settings)
    assert results["draft"].endswith("step-7/draft")
    run = results["runs"][0]
    assert (
        "matches_plain" not in run and run["verify_steps"] > 0
    )  # sampling: outputs differ, nothing to match


def test_prompt_files_in_every_layout(tmp_path, smollm2_tokenizer):
    lines = [
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye?"},
                {"role": "assistant", "content": "Bye"},
            ]
        },
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"}]},
        {"prompt": "Name a colour."},
    ]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "heldout_conversations.jsonl").write_text(
        "\n".join(json.dumps(line) for line in lines) + "\n"
    )
    prompts = load_prompts(data_dir)
    assert prompts[0][-1] == {"role": "user", "content": "Bye?"} and len(prompts[0]) == 3
    assert prompts[1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert prompts[2] == [{"role": "user", "content": "Name a colour."}]
    rendered = render_prompts(smollm2_tokenizer, prompts)
    assert smollm2_tokenizer.decode(rendered[2]).rstrip().endswith("assistant")
    assert len(load_prompts(None)) == 32


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ('{"text": "x"}', "no 'messages'"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "no user message"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "unknown role"),
    ],
)
def test_bad_prompt_files_name_the_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_prompts(path)
    assert f"{path}:2" in str(info.value)


def test_prompt_length_cap_cuts_chats_back_then_skips_before_the_limit(smollm2_tokenizer):
    from speculators.eval.prompts import select_prompts

    long_turn = {"role": "user", "content": "word " * 300}
    multi_turn = [
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "answer " * 200},
        {"role": "user", "content": "Second question?"},
    ]
    chats = [
        [long_turn],
        multi_turn,
        [{"role": "user", "content": "Short one?"}],
        [{"role": "user", "content": "Hi"}],
    ]
    ids, kept, counts = select_prompts(smollm2_tokenizer, chats, max_prompt_tokens=64, limit=2)
    assert kept == [
        multi_turn[:1],
        chats[2],
    ]  # the long chat cut back to its first turn, the too-long one skipped
    assert counts == {"shortened": 1, "skipped": 1}
    assert ids == render_prompts(smollm2_tokenizer, kept) and all(len(i) <= 64 for i in ids)
    ids, kept, counts = select_prompts(
        smollm2_tokenizer, chats, None, None
    )  # no cap, no limit: all, unchanged
    assert kept == chats and counts == {"shortened": 0, "skipped": 0}
    with pytest.raises(ValueError, match="raise --max-prompt-tokens"):
        select_prompts(smollm2_tokenizer, chats, max_prompt_tokens=3, limit=None)


def test_cli_prompt_cap_reaches_the_results(exported_draft, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"prompt": text}) for text in ["long " * 200, "Hi?", "long " * 300, "Yes?", "No?"]
        )
    )
    out = tmp_path / "eval"
    argv = ["eval", str(exported_draft), "--prompts", str(prompts), "--max-prompt-tokens", "48"]
    assert main([*argv, "--max-prompts", "2", "--max-new-tokens", "4", "--k", "1", "--output", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["prompts"]["count"] == 2 and results["prompts"]["max_prompt_tokens"] == 48
    assert results["prompts"]["skipped_too_long"] == 2 and results["prompts"]["shortened_to_fit"] == 0
    assert results["prompts"]["mean_prompt_tokens"] <= 48


# ---- block drafts (DFlash) ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported_dflash(tmp_path_factory, tiny_llama, tiny_llama_dir):
    """A random bidirectional DFlash draft (block 4: three draft slots) saved for the tiny Llama."""
    import torch

    from tests.support.dflash_drafts import random_dflash_draft

    draft = random_dflash_draft(tiny_llama, block_size=4, block_causal=False)
    draft.config.speculators_config.verifier.name_or_path = str(tiny_llama_dir)
    return draft.save_pretrained(tmp_path_factory.mktemp("drafts") / "dflash", dtype=torch.float32)


def test_cli_evaluates_a_dflash_draft_over_its_whole_block_by_default(exported_dflash, tmp_path, capsys):
    out = tmp_path / "eval"
    args = ["eval", str(exported_dflash), "--max-prompts", "4", "--max-new-tokens", "12", "--batch-size", "2"]
    args += ["--dtype", "float32"]  # matches_plain == 1 below is byte identity
    assert main([*args, "--output", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["ks"] == [3]
    (run,) = results["runs"]
    assert run["name"] == "chain-k3" and run["k"] == 3 and run["matches_plain"] == 1.0
    assert len(run["per_position_acceptance_conditional"]) == 3
    assert run["speedup"] > 0 and run["tokens_per_s"] > 0 and run["acceptance_length_global"] >= 1.0
    assert (
        run["draft_forwards"] == run["verifier_forwards"] - 2
    )  # one per verify step (2 batches: 2 prefills)
    assert "chain-k3" in capsys.readouterr().out


def test_block_drafts_refuse_trees_and_chains_longer_than_the_block(exported_dflash, tmp_path, capsys):
    base = [
        "eval",
        str(exported_dflash),
        "--max-prompts",
        "1",
        "--max-new-tokens",
        "4",
        "--output",
        str(tmp_path),
    ]
    # a user mistake: one `error:` line naming the fix and exit status 1 (no traceback)
    for extra, message in (
        (["--tree"], "tree drafting is not supported for dflash"),
        (["--k", "4"], "at most 3"),
    ):
        assert main([*base, *extra]) == 1
        assert message in capsys.readouterr().err


def test_api_reports_full_acceptance_of_an_agreeing_dflash_draft(tmp_path, tiny_llama, smollm2_tokenizer):
    """The deterministic pair (verifier and draft with zeroed final norms, d2t[0] = 0) through ``evaluate``: every
    drafted token is accepted, so AL = draft_slots + 1 and every per-position rate is 1."""
    import torch

    from speculators.eval import evaluate
    from speculators.eval.evaluation import EvalSettings
    from tests.support.dflash_drafts import random_dflash_draft

    verifier = copy.deepcopy(tiny_llama)
    draft = random_dflash_draft(verifier, block_size=5, block_causal=True)
    with torch.no_grad():
        verifier.model.norm.weight.zero_()
        draft.norm.weight.zero_()
    draft_dir = draft.save_pretrained(tmp_path / "dflash", dtype=torch.float32)
    settings = EvalSettings(max_new_tokens=12, max_prompts=2, batch_size=2)
    results = evaluate(draft_dir, (verifier, smollm2_tokenizer), settings=settings)
    (run,) = results["runs"]
    assert run["name"] == "chain-k4" and run["matches_plain"] == 1.0
    assert run["acceptance_length_global"] == pytest.approx(5.0)
    assert run["per_position_acceptance_unconditional"] == [1.0] * 4
