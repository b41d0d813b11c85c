"""The acceptance bench's per-domain table (issue 31): every lane measured on MT-Bench, HumanEval and GSM8K by the
same code as ``speculators eval --suite`` (bench.acceptance_measure.engine_suites), with the ceiling, and rendered
from the result JSON by the bench's own ``render``.

A tiny real run: the tiny Llama and a draft fitted to it, one question per suite, a few new tokens."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from speculators.cli import main
from tests.decoding.conftest import chat_prompts, fitted_llama_draft, tiny_llama  # noqa: F401 - fixtures

SUITES = "mtbench,humaneval,gsm8k"
TOKENS = 8


@pytest.fixture(scope="module")
def exported_draft(tmp_path_factory, fitted_llama_draft, tiny_llama_dir):  # noqa: F811
    draft = copy.deepcopy(fitted_llama_draft)
    draft.config.speculators_config.verifier.name_or_path = str(tiny_llama_dir)
    return draft.save_pretrained(tmp_path_factory.mktemp("drafts") / "fitted", dtype=torch.float32)


@pytest.fixture(scope="module")
def bench_suites(exported_draft, tiny_llama, smollm2_tokenizer):  # noqa: F811
    from bench import acceptance_measure as measure

    settings = measure.suite_settings(1, TOKENS, 512)
    return measure.engine_suites(
        (tiny_llama, smollm2_tokenizer), {"eagle3": exported_draft}, {"eagle3": [1, 2, 3]}, settings
    )


def test_each_lane_per_suite_equals_speculators_eval_on_the_suites(bench_suites, exported_draft, tmp_path):
    out = tmp_path / "eval"
    code = main(
        ["eval", str(exported_draft), "--suite", SUITES, "--max-prompts-per-suite", "1", "-k", "3"]
        + ["--max-new-tokens", str(TOKENS), "--max-prompt-tokens", "512", "--dtype", "float32", "--no-plain"]
        + ["--output", str(out)]
    )
    assert code == 0
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    lane = bench_suites["drafters"]["eagle3"]
    assert lane["k"] == 3 and list(lane["per_suite"]) == SUITES.split(",")
    for engine, figures in (("ours", lane["per_suite"]), ("oracle", bench_suites["oracle"]["k3"])):
        for suite, cell in figures.items():
            part = [r for r in rows if r["engine"] == engine and r["suite"] == suite]
            steps = [count for r in part for count in r["accepted_per_step"]]
            assert cell["requests"] == len(part) == (2 if suite == "mtbench" else 1)
            assert cell["acceptance_length"] == pytest.approx(1 + sum(steps) / len(steps))
            assert cell["tokens_per_verify_step"] == pytest.approx(
                sum(r["output_tokens"] for r in part) / (len(steps) + len(part))
            )
    for suite in SUITES.split(","):  # the ceiling is never below the draft
        assert (
            bench_suites["oracle"]["k3"][suite]["acceptance_length"]
            >= lane["per_suite"][suite]["acceptance_length"]
        )


def test_render_shows_the_per_domain_table_from_the_result_json(bench_suites):
    from bench.acceptance_bench import per_suite_summary, render

    suites = {
        **bench_suites,
        "ngram": {"k": 3, "per_suite": {"gsm8k": {"acceptance_length": 1.5, "tokens_per_verify_step": 1.25}}},
    }
    speedup_c1 = {"eagle3": {"k1": 0.9, "k2": 1.2, "k3": 1.1}}
    result = json.loads(json.dumps({"summary": {"per_suite": per_suite_summary(suites, speedup_c1)}}))
    lines = render(result)
    header = next(i for i, line in enumerate(lines) if line.startswith("| drafter | k | best k"))
    assert lines[header] == "| drafter | k | best k, one request | mtbench | humaneval | gsm8k |"
    cells = {line.split(" | ")[0].lstrip("| "): line for line in lines[header + 2 :] if line.startswith("|")}
    lane = bench_suites["drafters"]["eagle3"]["per_suite"]
    expected = " | ".join(
        f"{round(lane[s]['acceptance_length'], 3)} ({round(lane[s]['tokens_per_verify_step'], 3)})"
        for s in SUITES.split(",")
    )
    assert cells["eagle3"] == f"| eagle3 | 3 | 2 | {expected} |"
    assert cells["ngram"] == "| ngram | 3 |  |  |  | 1.5 (1.25) |"
    assert "ceiling (oracle) k3" in cells
    assert render({"summary": {}}) == render({"summary": {"per_suite": None}})  # older results: no table


@pytest.mark.consumer
def test_ngram_runs_on_each_suites_prompts_in_vllm(tiny_llama, smollm2_tokenizer, tiny_llama_dir, tmp_path):  # noqa: F811
    """The n-gram row of the table: vLLM's n-gram drafter on the same suite prompts as the lanes, one batch per
    suite, AL and tokens per verify step from its own counters."""
    from bench import acceptance_measure as measure
    from speculators.serving.vllm_bridge import vllm_available
    from tests.conftest import require_consumer

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    settings = measure.suite_settings(1, TOKENS, 512)
    suites, prompts = measure.suite_token_prompts((tiny_llama, smollm2_tokenizer), settings)
    assert suites == ["mtbench", "mtbench", "humaneval", "gsm8k"]  # MT-Bench: both turns of its question
    setup = measure.DecodeSetup(str(tiny_llama_dir), prompts, TOKENS, 1, tmp_path, 1)
    ngram = measure.ngram_suites(setup, suites, prompts, 3)
    assert ngram["k"] == 3 and list(ngram["per_suite"]) == ["mtbench", "humaneval", "gsm8k"]
    for suite, cell in ngram["per_suite"].items():
        assert "error" not in cell, cell
        assert cell["requests"] == suites.count(suite)
        assert cell["acceptance_length"] is None or 1.0 <= cell["acceptance_length"] <= 4.0
