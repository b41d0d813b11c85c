"""``train.max_cpu_seconds`` holds when the CPU per step rises after the budget was fitted (the machine got busier:
a 300 CPU-s budget once spent 503 CPU-s). The rise is real CPU spent in the training process, by a thread that
starts burning once the run has logged step ``BURN_FROM`` (after the fit at step 10), as another job would. It
hashes a large buffer, which releases the GIL: the training thread keeps its pace and the process simply spends more
CPU per step, as OpenMP threads spinning on a busier machine do."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from speculators.runs import list_checkpoints
from tests.train.conftest import compose, tiny_overrides
from train.trainer import Trainer, train

BUDGET = 6.0  # CPU-s
BURN_FROM = 15  # the step after which the extra CPU burns


def last_logged_step(run_dir: Path) -> int:
    """The latest step ``metrics.jsonl`` records (0 before the first record)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError):
            continue  # a line being written right now
    return max(steps)


def burn_after(run_dir: Path, step: int, stop: threading.Event) -> None:
    """Wait until the run logs ``step``, then spend CPU in this process until ``stop``."""
    while not stop.is_set() and last_logged_step(run_dir) < step:
        stop.wait(0.02)
    data = bytes(1 << 22)
    while not stop.is_set():
        hashlib.sha256(data).digest()


def test_the_budget_holds_when_the_cpu_per_step_rises_mid_run(sharp_verifier, tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "busier"
    overrides = tiny_overrides(
        sharp_verifier, tiny_data, run_dir, "train.epochs=400", "train.micro_batch_size=1"
    )
    overrides[0] = "recipe=tiny_dflash"
    budget = [f"train.max_cpu_seconds={BUDGET}", "train.eval_every=100000", "train.save_every=100000"]
    stop = threading.Event()
    burner = threading.Thread(target=burn_after, args=(run_dir, BURN_FROM, stop), daemon=True)
    burner.start()
    try:
        result = train(compose([*overrides, *budget, "logging.log_every=1"]), run_dir)
    finally:
        stop.set()
        burner.join()
    assert last_logged_step(run_dir) > BURN_FROM  # the burn did start mid-run
    step, final = list_checkpoints(run_dir)[-1]
    state = json.loads((final / "trainer_state.json").read_text())
    assert step == result["step"] == state["budget_steps"]  # the re-fitted length is what a resume would keep
    assert 0.7 * BUDGET <= state["budget_cpu_s"] <= 1.1 * BUDGET, state["budget_cpu_s"]
    out = capsys.readouterr().out
    assert "cpu budget" in out and ("(was " in out or "stopping here" in out)  # it said it re-fitted


@pytest.mark.parametrize(
    ("eval_every", "save_every", "window"),
    [(100, 100, 100), (50, 200, 200), (100_000, 100_000, 727 // 20), (0, 0, 727 // 20)],
)
def test_a_budget_window_spans_the_eval_and_save_intervals(eval_every, save_every, window):
    """A window shorter than the eval interval reads one evaluation's CPU as every step's and shortens the run for
    nothing (the bench's EAGLE-3 lane: 737 fitted steps cut to 614, 100 of 700 CPU-s unspent). Fitted at step 10
    of 737, the windows are the steps left / 20, or the eval or save interval when that is longer and falls within
    the run."""
    train_settings = SimpleNamespace(
        max_cpu_seconds=700.0, cpu_budget_hold=True, eval_every=eval_every, save_every=save_every
    )
    trainer = SimpleNamespace(settings=SimpleNamespace(train=train_settings), total_steps=737)
    Trainer._budget_checks_from(trainer, SimpleNamespace(step=10, budget_steps=737), 12.0)
    assert trainer._budget_every == window and trainer._budget_mark == (10, 12.0)
