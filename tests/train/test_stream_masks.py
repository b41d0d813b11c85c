"""Streamed training (train.data_mode=stream / cache-first-epoch) encodes its samples exactly as data_gen does,
for the verifier families whose chat format the masker cannot find by probing the template (issue 29).

Both streamed components encode the recipe's conversations themselves: the trainer (token counts for the draft
vocabulary, the sample digest in ``run.json``) and each capture producer (the ids and loss masks it writes into the
spool, which are what the trainer trains on). Without the family's chat format a Mistral 3 template is refused
and gpt-oss turns end at ``<|channel|>``: this compares both sides with the offline data_gen encoding, sample by
sample, on tiny gpt-oss and Mistral 3 verifiers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.families import CONVERSATIONS, build_family_verifier
from tests.train.conftest import compose

FAMILIES = ["gpt_oss", "mistral3"]
TOPICS = ["rivers", "bread", "stars", "chess"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """The family tests' conversations (multi-turn, with a system prompt) and a few single-turn ones."""
    records = [{"id": f"base-{i}", "messages": chat} for i, chat in enumerate(CONVERSATIONS)]
    for i, topic in enumerate(TOPICS):
        messages = [
            {"role": "user", "content": f"Tell me one fact about {topic}."},
            {"role": "assistant", "content": f"Here is a fact about {topic}: it is number {i} on my list."},
        ]
        records.append({"id": f"topic-{i}", "messages": messages})
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def stream_config(verifier: Path, chats: Path, root: Path) -> Any:
    return compose(
        [
            "recipe=tiny_eagle3",
            f"verifier.name_or_path={verifier}",
            "verifier.dtype=float32",
            f"data.source={chats}",
            "data.heldout_fraction=0.3",
            "data.max_length=256",
            f"data_gen.output_dir={root / 'data'}",
            f"run_dir={root / 'run'}",
            "logging=disabled",
            "train.data_mode=stream",
            "train.stream.local_producers=0",  # the producer is built in-process below
        ]
    )


def offline_samples(config: dict[str, Any]) -> dict[str, list[Any]]:
    """What a data_gen run writes into its shards (ids and masks), per split: its own masker and encoder."""
    from data_gen.pipeline import Distributed, encode_conversations, prepare

    prepared = prepare(config, Distributed())
    return {
        split: encode_conversations(prepared.masker, conversations, prepared.data)[0]
        for split, conversations in prepared.splits.items()
    }


def as_rows(samples: list[Any]) -> list[tuple[str, list[int], list[int]]]:
    return [(s.sample_id, list(s.input_ids), [int(m) for m in s.loss_mask]) for s in samples]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_streamed_trainer_and_producer_encode_the_offline_samples(model_type, chats, tmp_path):
    from accelerate import Accelerator
    from omegaconf import OmegaConf

    from data_gen.produce import Producer
    from data_gen.spool import sample_digest
    from speculators.verifier import verifier_config_dict
    from train.features import RowLayout, TokenDataset
    from train.objectives import train_settings
    from train.streaming import StreamFeatures

    verifier = build_family_verifier(tmp_path / "verifier", model_type)
    cfg = stream_config(verifier, chats, tmp_path)
    offline = offline_samples(OmegaConf.to_container(cfg, resolve=True))
    assert offline["train"] and offline["heldout"]
    assert all(any(s.loss_mask) for split in offline.values() for s in split)

    settings = train_settings(cfg)
    accelerator = Accelerator(cpu=True)
    verifier_config = verifier_config_dict(str(verifier))
    trainer_side = StreamFeatures(
        settings, accelerator, RowLayout.of(settings.train, accelerator.device), verifier_config
    )
    try:
        producer = Producer(trainer_side.spool, "mask-check", "cpu", None)
        producer.load()  # encodes for itself, and checks its digest against the trainer's run.json
    finally:
        trainer_side.close()

    assert as_rows(producer.train) == as_rows(offline["train"])
    assert as_rows(producer.heldout) == as_rows(offline["heldout"])
    assert producer.layout["hidden_size"] == int(verifier_config["hidden_size"])  # its spool byte bounds
    run = trainer_side.spool.read_json("run.json")
    assert run["train_digest"] == sample_digest(offline["train"])
    assert run["heldout_count"] == len(offline["heldout"])
    vocab_size = int(verifier_config["vocab_size"])
    assert torch.equal(trainer_side.counts, TokenDataset(offline["train"]).token_counts(vocab_size))
