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


def online_overrides(verifier, chats, run_dir, *extra: str) -> list[str]:
    return [
        "recipe=tiny_eagle3",
        f"verifier.name_or_path={verifier}",
        f"data.source={chats}",
        "data.heldout_fraction=0.0",
        "data.max_length=64",
        "train.max_length=64",
        "train.epochs=1",
        "train.data_mode=online",
        "model.draft_vocab_size=null",
        "logging=disabled",
        f"run_dir={run_dir}",
        *extra,
    ]


def launch_probe(tmp_path, overrides: list[str]) -> list[dict]:
    """2 processes (gloo) through the probe script: every rank's report on its verifier."""
    import subprocess

    from tests.train.conftest import REPO_ROOT, accelerate_launch, launch_env

    report = tmp_path / "verifier.json"
    cmd = accelerate_launch(2, [str(report), *overrides], tmp_path)
    cmd[-len(overrides) - 2] = str(REPO_ROOT / "tests" / "train" / "online_zero3_probe.py")
    result = subprocess.run(
        cmd, cwd=REPO_ROOT, env=launch_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return [json.loads((tmp_path / f"verifier-rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow  # two processes under DeepSpeed, plus the reference run: ~40-60 s on 2 shared cores
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_online_zero3_keeps_the_verifier_whole(tiny_llama_dir, tmp_path, dtype):
    """Under ZeRO-3 the frozen verifier is loaded outside deepspeed.zero.Init: every rank holds all of its weights
    (no ds_id/ds_status, full sizes), and 2 processes train the same first-step loss as 1 process (bf16: the same
    within bf16 rounding)."""
    from transformers import AutoModelForCausalLM

    chats = write_chats(tmp_path / "chats.jsonl")
    dtypes = [f"train.dtype={dtype}", f"verifier.dtype={'bfloat16' if dtype == 'bf16' else 'float32'}"]
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    # global batch 8 = every sample, whatever order each process's split lists them in
    train(
        compose(online_overrides(tiny_llama_dir, chats, one_dir, "train.micro_batch_size=8", *dtypes)),
        one_dir,
    )
    reports = launch_probe(
        tmp_path,
        online_overrides(
            tiny_llama_dir, chats, two_dir, "train.micro_batch_size=4", "deepspeed=zero3", *dtypes
        ),
    )
    whole = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_llama_dir).parameters())
    for report in reports:
        assert report["distributed_type"] == "DEEPSPEED"
        expected = "torch.bfloat16" if dtype == "bf16" else "torch.float32"
        assert report["compute_dtype"] == report["dtype"] == expected  # the recipe's dtype, also on CPU
        assert report["ds_attributes"] == [] and report["empty"] == 0 and report["numel"] == whole
    one, two = first_train_record(one_dir), first_train_record(two_dir)
    assert one["tokens"] == two["tokens"]
    tolerance = 2e-2 if dtype == "bf16" else 1e-4
    assert two["train/loss"] == pytest.approx(one["train/loss"], rel=tolerance), (one, two)
