"""Online training (verifier in the loop, data_gen's FeatureCapture) sees the same batch as offline training on the
features data_gen wrote for the same conversations: same tokens, same loss up to the bf16 storage of features."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from data_gen.pipeline import run_data_gen
from tests.train.conftest import compose
from train.trainer import train

TOPICS = ["rivers", "bread", "stars", "chess", "tides", "bees", "glass", "maps"]


def write_chats(path):
    lines = []
    for i, topic in enumerate(TOPICS):
        messages = [
            {"role": "user", "content": f"Tell me one fact about {topic}."},
            {"role": "assistant", "content": f"Here is a fact about {topic}: it is number {i} on my list."},
        ]
        lines.append(json.dumps({"id": f"chat-{i}", "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def first_train_record(run_dir):
    return next(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())


def test_online_matches_offline(tiny_llama_dir, tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl")
    common = [
        "recipe=tiny_eagle3",
        f"verifier.name_or_path={tiny_llama_dir}",
        f"data.source={chats}",
        "data.heldout_fraction=0.0",
        "data.max_length=64",
        "train.max_length=64",
        "train.epochs=1",
        "train.micro_batch_size=8",  # one global batch = every sample, whatever order each source lists them in
        "model.draft_vocab_size=null",  # a random verifier's argmax is rarely a frequent token: keep them all
        "logging=disabled",
    ]
    offline_dir, online_dir, data_dir = tmp_path / "offline", tmp_path / "online", tmp_path / "data"
    offline_cfg = compose([*common, f"run_dir={offline_dir}", f"data_gen.output_dir={data_dir}"])
    run_data_gen(OmegaConf.to_container(offline_cfg, resolve=True))
    train(offline_cfg, offline_dir)
    train(compose([*common, f"run_dir={online_dir}", "train.data_mode=online"]), online_dir)
    offline, online = first_train_record(offline_dir), first_train_record(online_dir)
    assert online["tokens"] == offline["tokens"]
    assert offline["train/loss"] > 1.0 and offline["train/acc_0"] >= 0.0
    assert online["train/loss"] == pytest.approx(offline["train/loss"], rel=1e-4)
    assert (online_dir / "checkpoints" / "step-1" / "draft" / "model.safetensors").is_file()
