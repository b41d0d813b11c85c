"""What each bench lane's training spent (bench/acceptance_bench.py ``lane_training``): both trainers' optimizer-step
CPU estimated alike (mean CPU per step after the first, times the steps), read from each trainer's own record, and
shown in the bench's section."""

from __future__ import annotations

import json
from pathlib import Path

from bench import acceptance_bench
from bench.lanes import lanes


def lane(name: str):
    return next(x for x in lanes("extended") + lanes("headline") if x.name == name)


def test_ours_and_the_peers_training_cpu_are_estimated_alike(tmp_path: Path):
    ours, peer = lane("eagle3"), lane("peer")
    run = acceptance_bench.lane_output(tmp_path, ours)
    run.mkdir(parents=True)
    records = [
        {"kind": "train", "step": 1, "tokens": 500.0, "process_cpu_s": 10.0},  # start-up inside the first
        {"kind": "eval", "step": 2, "eval/acceptance_length": 1.1},
        {"kind": "train", "step": 2, "tokens": 400.0, "process_cpu_s": 11.0},
        {"kind": "train", "step": 5, "tokens": 600.0, "process_cpu_s": 14.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert acceptance_bench.lane_training(tmp_path, ours) == {
        "steps": 5,
        "training_tokens": 1500,
        "training_cpu_s": 5.0,  # (14 - 10) / 4 steps x 5
        "process_cpu_s_at_last_step": 14.0,
    }
    report = acceptance_bench.lane_output(tmp_path, peer)
    report.mkdir(parents=True)
    (report / "peer_lane.json").write_text(
        json.dumps({"steps": 9, "tokens_trained": 4000, "train_cpu_seconds": 6.04})
    )
    assert acceptance_bench.lane_training(tmp_path, peer) == {
        "steps": 9,
        "training_tokens": 4000,
        "training_cpu_s": 6.0,
    }
    assert acceptance_bench.lane_training(tmp_path, lane("hass")) == {}  # never trained here
    result = {
        "lanes": {
            "eagle3": {"trainer": "ours", "training": acceptance_bench.lane_training(tmp_path, ours)},
            "peer": {"trainer": "peer", "training": acceptance_bench.lane_training(tmp_path, peer)},
        }
    }
    lines = acceptance_bench.training_lines(result["lanes"])
    assert "| eagle3 | ours | 5 | 1500 | 5.0 | 300.0 |" in lines
    assert "| peer | peer | 9 | 4000 | 6.0 | 667.0 |" in lines
