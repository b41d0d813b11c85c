"""What ``make demo`` does after the export, on the tiny Llama and a draft fitted to it: a k x concurrency sweep
(``--concurrency`` without ``-k`` tries every chain k the draft can draft, with plain decoding at each concurrency),
``speculators export --k-from-eval`` serving the sweep's fastest k, an evaluation at that k one request at a time
with the sweep's batched point at that k beside it, and the headline lines the demo prints last (speculators.eval.headline).

Every expected figure is recomputed here from ``requests.jsonl`` read as plain JSON, not through the code under test.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from speculators.cli import main

PROMPTS = 3
BATCH = 3
COMMON = ["--max-prompts", str(PROMPTS), "--max-new-tokens", "10", "--dtype", "float32", "--no-oracle"]


@pytest.fixture(scope="module")
def exported_draft(tmp_path_factory, fitted_llama_draft, tiny_llama_dir):
    draft = copy.deepcopy(fitted_llama_draft)
    draft.config.speculators_config.verifier.name_or_path = str(tiny_llama_dir)
    return draft.save_pretrained(tmp_path_factory.mktemp("drafts") / "fitted", dtype=torch.float32)


def _eval(draft, out, *extra: str) -> tuple[dict, list[dict]]:
    assert main(["eval", str(draft), *COMMON, "--output", str(out), *extra]) == 0
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return json.loads((out / "results.json").read_text()), rows


@pytest.fixture(scope="module")
def demo_evals(exported_draft, tmp_path_factory):
    """(sweep results, sweep rows, results at the served k, its rows, the served k), as scripts/demo.sh runs them."""
    root = tmp_path_factory.mktemp("demo-eval")
    sweep, sweep_rows = _eval(
        exported_draft, root / "sweep", "--batch-size", "1", "--concurrency", "1", str(BATCH)
    )
    served = sweep["reports"]["k_sweep"]["best_k"]["1"]
    results, rows = _eval(
        exported_draft,
        root / "eval",
        "-k",
        str(served),
        "--batch-size",
        "1",
    )
    return sweep, sweep_rows, results, rows, served


def _speed(rows: list[dict]) -> float:
    """Output tokens over the wall time of the batches they ran in (each batch counted once)."""
    batches = {row["batch"]: row["timing"]["wall_s"] for row in rows}
    return sum(row["output_tokens"] for row in rows) / sum(batches.values())


def test_a_sweep_without_k_tries_every_k_and_each_point_has_its_plain_speedup(demo_evals):
    sweep, rows, *_ = demo_evals
    points = sweep["reports"]["k_sweep"]["points"]
    assert sorted({p["k"] for p in points}) == [1, 2, 3, 4]  # an EAGLE-3 draft: 1..SWEEP_MAX_K
    assert sorted({p["concurrency"] for p in points}) == [1, BATCH]
    for point in points:
        ours = [
            r
            for r in rows
            if r["engine"] == "ours" and r["k"] == point["k"] and r["concurrency"] == point["concurrency"]
        ]
        plain = [r for r in rows if r["engine"] == "plain" and r["concurrency"] == point["concurrency"]]
        assert len(ours) == len(plain) == PROMPTS
        assert point["speedup"] == pytest.approx(_speed(ours) / _speed(plain))


def test_the_demo_evaluates_at_the_served_k_and_the_headline_says_so(demo_evals):
    from speculators.eval.headline import draft_cost_share, headline

    sweep, sweep_rows, results, rows, served = demo_evals
    assert [run["k"] for run in results["runs"]] == [served]
    assert {r["concurrency"] for r in rows} == {1}  # the demo's evaluation: one request at a time only
    run = results["runs"][0]
    lines = headline(results, sweep["reports"]["k_sweep"])
    assert lines[0].startswith(f"served k = {served}: the sweep's best at one request at a time")
    for point in sweep["reports"]["k_sweep"]["points"]:
        if point["concurrency"] == 1:
            assert f"k{point['k']} {point['speedup']:.2f}x" in lines[0]
    ours_c1 = [r for r in rows if r["engine"] == "ours" and r["concurrency"] == 1]
    plain_c1 = [r for r in rows if r["engine"] == "plain" and r["concurrency"] == 1]
    assert f"ours {_speed(ours_c1):.1f} tok/s ({_speed(ours_c1) / _speed(plain_c1):.2f}x plain)" in lines[1]
    assert lines[1].startswith("  one request at a time")
    # the batched figure beside it: the sweep's point at the served k (the evaluation decoded one at a time only)
    batched = [
        r for r in sweep_rows if r["engine"] == "ours" and r["k"] == served and r["concurrency"] == BATCH
    ]
    plain_batched = [r for r in sweep_rows if r["engine"] == "plain" and r["concurrency"] == BATCH]
    assert f"ours {BATCH} at once {_speed(batched):.1f} tok/s" in lines[2]
    assert f"({_speed(batched) / _speed(plain_batched):.2f}x plain) in the k sweep" in lines[2]
    share = (run["draft_s"] / run["draft_forwards"]) / (run["verifier_s"] / run["verifier_forwards"])
    assert draft_cost_share(run) == pytest.approx(share)
    assert f"one draft forward costs {share:.0%} of a verifier forward" in lines[3]
    assert f"the {served} draft(s) of each step cost {served * share:.0%} of a verifier step" in lines[3]


def test_the_export_serves_the_sweeps_k_and_its_card_shows_the_sweep(
    demo_evals, fitted_llama_draft, tiny_llama_dir, tmp_path
):
    from tests.export.conftest import make_run

    sweep, _, _, _, served = demo_evals
    draft = copy.deepcopy(fitted_llama_draft)
    draft.config.speculators_config.verifier.name_or_path = str(tiny_llama_dir)
    run = make_run(tmp_path / "run", str(tiny_llama_dir), {10: draft}, best_step=10, speculative_tokens=7)
    sweep_file = tmp_path / "sweep.json"
    sweep_file.write_text(json.dumps(sweep))
    assert (
        main(
            [
                "export",
                str(run),
                str(tmp_path / "export"),
                "--k-from-eval",
                str(sweep_file),
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == served


def test_the_batched_figure_is_the_evaluations_own_when_it_measured_one():
    from speculators.eval.headline import batched_points

    own = {"points": [{"k": 2, "concurrency": 1}, {"k": 2, "concurrency": 4}, {"k": 3, "concurrency": 4}]}
    sweep = {"points": [{"k": 2, "concurrency": 8}]}
    assert batched_points(2, 1, own, sweep) == [({"k": 2, "concurrency": 4}, "")]
    assert batched_points(2, 1, {"points": own["points"][:1]}, sweep) == [
        ({"k": 2, "concurrency": 8}, " in the k sweep")
    ]
    assert batched_points(2, 1, {"points": []}, None) == []
