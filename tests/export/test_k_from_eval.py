"""``speculators export --k-from-eval results.json`` chooses k from a sweep; an evaluation that measured one k at
the asked concurrency is no sweep, and saying "the k with the most tokens/s" of it would claim a comparison that
never ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators.cli import main as cli_main
from speculators.export.model_card import k_from_sweep
from tests.export.conftest import build_draft, make_run


def write_results(path: Path, points: list[tuple[int, int, float]]) -> Path:
    """A results.json as `speculators eval` writes it, with ``reports.k_sweep`` of ``(concurrency, k, tokens/s)``."""
    best: dict[str, int] = {}
    for concurrency in sorted({c for c, _, _ in points}):
        at = [(speed, k) for c, k, speed in points if c == concurrency]
        best[str(concurrency)] = max(at)[1]
    sweep = {
        "points": [
            {"concurrency": c, "k": k, "tokens_per_s": speed, "acceptance_length": 2.0, "requests": 4}
            for c, k, speed in points
        ],
        "best_k": best,
        "plain_tokens_per_s": {},
    }
    runs = [
        {"name": f"chain-k{k}", "method": "chain", "k": k, "acceptance_length_global": 2.0}
        for _, k, _ in points
    ]
    path.write_text(json.dumps({"runs": runs, "reports": {"k_sweep": sweep}}))
    return path


@pytest.mark.parametrize(
    "points,concurrency",
    [
        ([(1, 3, 40.0)], 1),  # one k, one concurrency
        ([(1, 3, 40.0), (8, 3, 150.0)], 8),  # one k at two concurrencies
        ([(1, 2, 40.0), (1, 3, 45.0), (8, 3, 150.0)], 8),  # a sweep at 1, a single point at 8
    ],
    ids=["one-point", "one-k-two-concurrencies", "one-k-at-the-asked-concurrency"],
)
def test_a_single_k_at_the_asked_concurrency_is_refused(points, concurrency, tmp_path):
    results = write_results(tmp_path / "results.json", points)
    with pytest.raises(ValueError) as refused:
        k_from_sweep(results, concurrency)
    message = str(refused.value)
    assert str(results) in message and "nothing to choose from" in message
    assert f"only k=3 was measured at concurrency {concurrency}" in message
    assert f"speculators eval DRAFT -k 1 2 3 --concurrency {concurrency}" in message
    assert "--speculative-tokens" in message


def test_a_sweep_of_several_k_chooses_the_fastest(tmp_path):
    results = write_results(tmp_path / "results.json", [(1, 1, 30.0), (1, 2, 50.0), (1, 3, 45.0)])
    chosen, sweep = k_from_sweep(results, 1)
    assert chosen == 2 and len(sweep["points"]) == 3


def test_export_with_a_one_point_evaluation_is_one_error_line(tmp_path, small_verifier_dir, capsys):
    run = make_run(
        tmp_path / "run", str(small_verifier_dir), {10: build_draft(small_verifier_dir, 256)}, best_step=10
    )
    results = write_results(tmp_path / "results.json", [(1, 3, 40.0)])
    out = tmp_path / "out"
    assert cli_main(["export", str(run), str(out), "--k-from-eval", str(results)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "nothing to choose from" in lines[0] and "--speculative-tokens" in lines[0]
    assert not out.exists()
