"""The drafter levers bench's plan and verdicts (bench/drafter_levers_bench.py): a two-stage lane trains after
its first stage in the same queue, both queues carry about the same budget, every lane's command trains its
drafter's recipe at its share of the budget, and a lever wins only beyond its drafter's seed spread."""

from __future__ import annotations

from pathlib import Path

from bench import drafter_levers_bench as bench


def test_a_second_stage_follows_its_first_in_one_queue_and_the_queues_balance():
    lanes = bench.lanes()
    queues = bench.queues(lanes)
    assert sorted(lane.name for q in queues for lane in q) == sorted(lane.name for lane in lanes)
    for lane in (lane for lane in lanes if lane.after):
        queue = next(q for q in queues if lane in q)
        names = [x.name for x in queue]
        assert names.index(lane.after) == names.index(lane.name) - 1
    loads = [sum(lane.budget_share for lane in q) for q in queues]
    assert abs(loads[0] - loads[1]) <= 1.0


def test_each_command_trains_its_drafters_recipe_at_its_budget_share(tmp_path: Path):
    lanes = {lane.name: lane for lane in bench.lanes()}
    second = bench.train_command(lanes["peagle_from_eagle3"], bench.FULL, tmp_path / "data", tmp_path)
    assert "recipe=peagle_smollm2" in second and "eval.k=4" in second
    assert "train.max_cpu_seconds=150" in second
    assert f"train.init_from={tmp_path / 'runs' / 'eagle3_half_for_peagle'}" in second
    lever = bench.train_command(lanes["peagle_frozen_lm_head"], bench.FULL, tmp_path / "data", tmp_path)
    assert lever[-1] == "model.train_lm_head=false" and "train.max_cpu_seconds=300" in lever


def test_a_lever_wins_only_beyond_the_seed_spread():
    def result(al: float) -> dict:
        return {"heldout_simulated_al": al}

    results = {name: result(1.2) for name in (lane.name for lane in bench.lanes())}
    results["peagle_seed1"] = result(1.22)  # spread: (0.22 / 0.20 - 1) = 10 %
    results["peagle_clip"] = result(1.21)  # +5 %: inside the spread
    results["peagle_betas"] = result(1.23)  # +15 %: beyond it
    verdicts = bench.verdicts(results, bench.lanes())
    assert verdicts["seed_spread_pct"]["peagle"] == 10.0
    assert not verdicts["levers"]["peagle_clip"]["wins"]
    assert verdicts["levers"]["peagle_betas"]["wins"]
    assert verdicts["levers"]["hass_base"]["vs"] == "eagle3_base"
    assert "eagle3_half" not in verdicts["levers"] and "peagle_seed1" not in verdicts["levers"]
    # a lane whose CPU-seconds were a small share of its wall time ran beside other work: no verdict from it
    results["peagle_betas"]["cpu_share_of_wall"] = 0.7
    contended = bench.verdicts(results, bench.lanes())["levers"]["peagle_betas"]
    assert contended["contended"] == ["peagle_betas"] and not contended["wins"]
    assert bench.share_of_wall({"cpu_s": 300.0, "wall_s": 400.0}) == 0.75


def test_the_defaults_set_trains_each_recipe_beside_its_previous_defaults():
    lanes = bench.default_lanes()
    for drafter, previous in bench.PREVIOUS_DEFAULTS.items():
        now, before = (
            next(x for x in lanes if x.name == f"{drafter}_{which}") for which in ("defaults", "previous")
        )
        assert now.overrides == [] and before.overrides == previous and bench.base_of(now) == before.name
        queues = bench.queues(lanes)
        # the two sides of a comparison run at the same time, one per queue
        assert [q.index(now) for q in queues if now in q] == [q.index(before) for q in queues if before in q]
    results = {lane.name: {"heldout_simulated_al": 1.2} for lane in lanes}
    results["eagle3_defaults"] = {"heldout_simulated_al": 1.3}  # +50 %
    verdicts = bench.verdicts(results, lanes, {"eagle3": 5.0, "peagle": 5.0})
    assert verdicts["levers"]["eagle3_defaults"]["wins"] and not verdicts["levers"]["peagle_defaults"]["wins"]
    assert set(verdicts["levers"]) == {"eagle3_defaults", "peagle_defaults"}
