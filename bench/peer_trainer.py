"""The peer lane's trainer: ``speculators==0.9.0``'s own trainer run on the converted data (in ``.venv-speculators``,
through ``bench/peer_launch.py``), its export taken and checked with OUR validator, optionally served by vLLM
(:mod:`bench.peer_lane` runs the lane).

The export is the peer's, unfixed: it writes ``architectures: ["Eagle3DraftModel"]`` (our validator warns, it
expects ``Eagle3Speculator``), an ``auto_map`` with its ``config.py`` and its ``train_command.txt``; vLLM serves
it as is (``--vllm-prompts``). Its DFlash export has no ``embed_tokens`` (speculators 0.9.0 rebuilds it from the
verifier on load, vLLM shares the target's; our validator and loader do the same: the DFlash unit declares
``embed_from_verifier``). Our validator's verdict is recorded, not fatal (``--require-valid`` makes it the exit
status).
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from bench.peer_algorithms import PeerAlgorithm
from bench.record import REPO
from speculators.atomic import atomic_directory
from speculators.format.validate import errors, validate_checkpoint
from speculators.local_paths import scrub
from speculators.serving.speculators_package import speculators_package_python

LAUNCHER = REPO / "bench" / "peer_launch.py"
TRAINING_STATE_FILES = ("optimizer_state_dict.pt", "scheduler_state_dict.pt", "training_state.json")


# ---- the peer's trainer ----------------------------------------------------------------------------------------
def peer_flags(
    algorithm: PeerAlgorithm,
    conversion: dict[str, Any],
    peer_data: Path,
    run_dir: Path,
    *,
    draft_vocab_size: int | None,
    verifier: str,
    lr: float,
    warmup_ratio: float,
    total_seq_len: int,
    seed: int,
    draft: dict[str, Any],
    dry_run: bool = False,
) -> list[str]:
    """The ``speculators train`` flags of the lane (real flag names of speculators 0.9.0): the data, vocabulary,
    optimizer and schedule every algorithm shares, then ``algorithm``'s draft and objective flags. A
    ``draft_vocab_size`` of None is the verifier's whole vocabulary: no mapping files, and no size (the peer then
    uses the verifier's vocabulary, DFlash2's only one)."""
    flags = [
        "--speculator-type", algorithm.speculator_type,
        "--verifier-name-or-path", verifier,
        "--data-path", str(peer_data / "dataset"),
        "--hidden-states-path", str(peer_data / "hidden_states"),
        "--on-missing", "raise",
        "--train-data-ratio", repr(conversion["train_data_ratio"]),
        "--total-seq-len", str(total_seq_len),
        "--hidden-states-dtype", "float32",
        "--num-workers", "0",
        "--target-layer-ids", *map(str, conversion["aux_layer_ids"]),
        "--num-layers", str(draft["num_layers"]),
        "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager",
        "--loss-fn", "kl_div",  # forward KL to the verifier's distribution: our soft cross-entropy's gradient
        "--optimizer", "adamw",
        "--lr", repr(lr),
        "--weight-decay", "0",
        "--scheduler-type", "cosine",
        "--scheduler-warmup-ratio", repr(warmup_ratio),
        "--seed", str(seed),
        "--save-path", str(run_dir / "checkpoints"),
        "--log-dir", str(run_dir / "logs"),
        "--no-resume-from-checkpoint",
    ]  # fmt: skip
    if draft_vocab_size is not None:
        flags += [
            "--d2t-path", str(peer_data / "d2t.npy"),
            "--t2d-path", str(peer_data / "t2d.npy"),
            "--draft-vocab-size", str(draft_vocab_size),
        ]  # fmt: skip
    flags += algorithm.draft_flags(draft)
    return flags + (["--dry-run"] if dry_run else [])


def run_peer(flags: list[str], run_dir: Path, *, steps: int, threads: int) -> dict[str, Any]:
    """Run the peer's trainer through the shim; wall and CPU seconds of the child (rusage of children)."""
    report, metrics = run_dir / "launch_report.json", run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    command = [
        str(speculators_package_python()),
        str(LAUNCHER),
        "--threads",
        str(threads),
        "--steps",
        str(steps),
    ]
    command += ["--report", str(report), "--metrics", str(metrics), "--", *flags]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(Path.home()),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "OPENBLAS_NUM_THREADS": str(threads),
    }
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (run_dir / "peer_stdout.log").write_text(result.stdout)
    (run_dir / "peer_stderr.log").write_text(result.stderr)
    if result.returncode != 0:
        raise RuntimeError(
            f"the peer's trainer failed ({result.returncode}); see {run_dir}/peer_stderr.log:\n"
            + result.stderr[-3000:]
        )
    return {
        "command": scrub(command, REPO),  # committed with the bench results: no local path
        "wall_seconds": wall,
        "cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "launch": json.loads(report.read_text()),
        "metrics": [json.loads(line) for line in metrics.read_text().splitlines()]
        if metrics.exists()
        else [],
    }


def final_losses(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The first and last training records and the last validation record the peer logged."""
    train = [m for m in metrics if "train" in m]
    val = [m for m in metrics if "val" in m]
    return {
        "first_train": train[0]["train"] if train else None,
        "last_train": train[-1]["train"] if train else None,
        "last_train_step": train[-1].get("global_step") if train else None,
        "last_val": val[-1]["val"] if val else None,
        "lr_by_step": [m.get("lr") for m in train],
    }


def step_timing(metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Seconds per optimizer step from the peer's own step profiles (fetch + forward + backward + optimizer: no
    start-up, validation or checkpointing), and its tokens/s."""
    profiles = [m["profile"] for m in metrics if isinstance(m.get("profile"), dict)]
    if not profiles:
        return None
    seconds = [p["step_ms"] / 1000 for p in profiles]
    return {
        "steps_profiled": len(seconds),
        "mean_seconds_per_step": sum(seconds) / len(seconds),
        "seconds_per_step": seconds,
        "mean_tokens_per_second": sum(p["tokens_per_s"] for p in profiles) / len(profiles),
    }


def last_checkpoint(checkpoints: Path) -> Path:
    """The newest epoch directory the peer's checkpointer wrote (``<save_path>/<epoch>/``)."""
    epochs = sorted((int(p.name), p) for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit())
    if not epochs:
        raise FileNotFoundError(f"the peer wrote no checkpoint under {checkpoints}")
    return epochs[-1][1]


def export_peer(checkpoint: Path, target: Path) -> list[str]:
    """The peer's export as it wrote it (its ``save_pretrained`` output), without its training state. No fixes."""
    with atomic_directory(target) as staging:
        for path in checkpoint.iterdir():
            if path.is_file() and path.name not in TRAINING_STATE_FILES:
                shutil.copy2(path, staging / path.name)
    return sorted(p.name for p in target.iterdir())


def validation_result(draft: Path) -> dict[str, Any]:
    """OUR validator's findings on the peer's export (the function behind ``speculators validate``)."""
    findings = validate_checkpoint(draft)
    return {
        "passed": not errors(findings),
        "errors": [str(f) for f in errors(findings)],
        "warnings": [str(f) for f in findings if f.severity == "warning"],
    }


def weight_changes(init_dir: Path, trained_dir: Path) -> dict[str, float]:
    """Max |trained - init| per tensor: proof that it trained. Its dry run saves the init in the features' dtype
    (fp32 here) and its checkpoints in bf16, so the init is rounded to the trained tensor's dtype first."""
    init, trained = (
        load_file(str(init_dir / "model.safetensors")),
        load_file(str(trained_dir / "model.safetensors")),
    )
    return {
        name: float((trained[name].float() - init[name].to(trained[name].dtype).float()).abs().max())
        for name in sorted(trained)
        if name in init and trained[name].is_floating_point()
    }


def vllm_check(
    algorithm: PeerAlgorithm,
    draft: Path,
    data_dir: Path,
    verifier: str,
    *,
    prompts: int,
    max_tokens: int = 64,
) -> dict:
    """Serve the peer's export in vLLM (our bridge, fp32, greedy) on the first held-out prompts, beside plain
    decoding: acceptance length, whether the greedy output is unchanged, and (parallel drafters) whether vLLM
    drafted in one forward. A refusal by vLLM is recorded with its reason, not raised: it is a finding."""
    from transformers import AutoTokenizer

    from speculators.eval.prompts import load_prompts, select_prompts
    from speculators.serving import VllmRequest, run_vllm
    from speculators.serving.vllm_bridge import VllmError

    tokenizer = AutoTokenizer.from_pretrained(verifier)
    ids, _, _ = select_prompts(
        tokenizer, load_prompts(data_dir / "heldout_conversations.jsonl"), 512, prompts
    )
    base = dict(model=verifier, prompts=ids, max_tokens=max_tokens, dtype="float32", max_model_len=1024)
    spec = algorithm.vllm_speculative_config(draft)
    k = int(spec["num_speculative_tokens"])
    try:
        plain, drafted = run_vllm(
            [
                VllmRequest(**base, name="plain"),
                VllmRequest(**base, speculative_config=spec, name=f"peer/k{k}", count_draft_forwards=True),
            ],
            log_path=draft.parent / "peer_vllm.log",
        )
    except VllmError as error:
        return {"served": False, "refused": str(error)[-2000:], "speculative_config": scrub(spec, REPO)}
    return {
        "served": True,
        "prompts": len(ids),
        "k": k,
        "speculative_config": scrub(spec, REPO),
        "acceptance_length": drafted.spec.mean_acceptance_length if drafted.spec else None,
        "per_position_acceptance": drafted.spec.per_position_acceptance_rate if drafted.spec else None,
        "num_drafts": drafted.spec.num_drafts if drafted.spec else None,
        "vllm_method": drafted.spec.method if drafted.spec else None,
        "parallel_drafting": drafted.spec.parallel_drafting if drafted.spec else None,
        "draft_forwards": drafted.spec.draft_forwards if drafted.spec else None,
        "greedy_output_unchanged": plain.token_ids == drafted.token_ids,
        "vllm_version": drafted.vllm_version,
    }
