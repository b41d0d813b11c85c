"""Fixtures for the trainer tests: a tiny sharp verifier (vocab 512) and feature data written through the real
data_gen store, so the trainer reads exactly what data_gen produces.

The sequences are prompts of random tokens followed by the verifier's own greedy continuation (loss mask on the
continuation): the "regenerated" data the paper recommends, which a draft can fit perfectly — so overfitting must
drive the simulated acceptance length to its ceiling.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT
from train.assemble import free_port

VOCAB = 512
NUM_SAMPLES = 8


def build_sharp_verifier(directory: Path, seed: int = 0) -> Path:
    """A random 6-layer Llama (hidden 64, vocab 512) whose lm_head is scaled so its distributions are peaked."""
    from transformers import AutoModelForCausalLM

    from tests.support.verifiers import tiny_verifier_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_verifier_config("llama", vocab_size=VOCAB))
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(directory)
    return directory


def greedy_samples(model, count: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        prompt_len = int(torch.randint(6, 12, (1,), generator=gen))
        new_tokens = int(torch.randint(20, 36, (1,), generator=gen))
        prompt = torch.randint(3, VOCAB, (1, prompt_len), generator=gen)
        with torch.no_grad():
            ids = prompt
            for _ in range(new_tokens):  # plain greedy loop: no generation-config surprises
                nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
        mask = torch.zeros(ids.shape[1], dtype=torch.bool)
        mask[prompt_len:] = True
        samples.append({"sample_id": f"s{seed}-{index}", "input_ids": ids[0], "loss_mask": mask})
    return samples


def write_features(
    data_dir: Path,
    verifier_dir: Path,
    train_count: int,
    heldout_same: bool,
    seed: int,
    aux_layer_ids: list[int] | None = None,
) -> Path:
    """Capture features with data_gen's FeatureCapture and write train/ heldout/ + token counts with its store
    (``aux_layer_ids``: the recipe's, None for the default ids)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from data_gen.capture import LAYER_CONVENTION, FeatureCapture
    from data_gen.store import TOKEN_COUNTS_NAME, Sample, finalize_split, write_shard

    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    capture = FeatureCapture(model, aux_layer_ids)
    train = greedy_samples(model, train_count, seed)
    heldout = train if heldout_same else greedy_samples(model, 4, seed + 1)
    header = {
        "aux_layer_ids": capture.aux_layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "num_hidden_layers": capture.num_layers,
        "hidden_size": capture.hidden_size,
        "vocab_size": VOCAB,
        "storage_dtype": "bfloat16",
        "verifier": {"name_or_path": str(verifier_dir), "architectures": list(model.config.architectures)},
        "tokenizer": {},
    }
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    for split, items in (("train", train), ("heldout", heldout)):
        rows = []
        for item in items:
            out = capture.capture(item["input_ids"][None])
            rows.append(
                Sample(
                    item["sample_id"],
                    item["input_ids"],
                    item["loss_mask"],
                    out["aux_hidden"][0],
                    out["last_hidden"][0],
                )
            )
            if split == "train":
                counts += torch.bincount(item["input_ids"][item["loss_mask"]], minlength=VOCAB)
        for shard, start in enumerate(range(0, len(rows), 4)):
            write_shard(
                data_dir / split, shard, rows[start : start + 4], len(capture.aux_layer_ids), "bfloat16"
            )
        finalize_split(data_dir / split, (len(rows) + 3) // 4, header)
    save_file({"counts": counts}, str(data_dir / TOKEN_COUNTS_NAME), metadata={"provenance": "{}"})
    return data_dir


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors on a shared 2-core host: one intra-op thread is 10-40x faster than two fighting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def sharp_verifier(tmp_path_factory) -> Path:
    return build_sharp_verifier(tmp_path_factory.mktemp("verifier") / "tiny-sharp")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, sharp_verifier) -> Path:
    """8 training samples; held-out = the same samples (what an overfit check measures)."""
    return write_features(
        tmp_path_factory.mktemp("data"), sharp_verifier, NUM_SAMPLES, heldout_same=True, seed=0
    )


def tiny_overrides(verifier: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "recipe=tiny_eagle3",
        f"verifier.name_or_path={verifier}",
        f"train.data_dir={data}",
        f"run_dir={run_dir}",
        "logging=disabled",
        *extra,
    ]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipes"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def launch_env(tmp: Path) -> dict[str, str]:
    """Environment of `accelerate launch` test runs: offline, no JIT builds, a private extensions dir."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        DS_ACCELERATOR="cpu",
        DS_BUILD_OPS="0",
        OMP_NUM_THREADS="1",
        TORCH_EXTENSIONS_DIR=str(tmp / "torch_extensions"),
        PYTHONPATH=str(REPO_ROOT),
    )
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def accelerate_launch(num_processes: int, args: list[str], tmp: Path, **popen) -> list[str]:
    """The command line: ``accelerate launch [--multi_gpu] --num_processes N train/run.py args``."""
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--num_machines", "1"]
    cmd += ["--num_processes", str(num_processes), "--dynamo_backend", "no", "--mixed_precision", "no"]
    if num_processes > 1:
        cmd += ["--multi_gpu", "--main_process_port", str(free_port())]
    return cmd + [str(REPO_ROOT / "train" / "run.py"), *args]


def run_launch(
    num_processes: int, args: list[str], tmp: Path, timeout: int = 240
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        accelerate_launch(num_processes, args, tmp),
        cwd=REPO_ROOT,
        env=launch_env(tmp),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise AssertionError(
            f"launch failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result
