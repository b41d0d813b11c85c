"""Benchmark of the data-generation stage on the embedded verifier (SmolLM2-135M-Instruct).

Measures, over the SAME length-sorted batches of real ShareGPT conversations (chat template applied):
  * tokens/s of a bare verifier forward (the decoder stack ``model.model``, and the full causal LM with lm_head),
  * tokens/s of :class:`data_gen.capture.FeatureCapture` (hooks + concatenation), and of capture + packing +
    writing a shard; capture overhead = bare-decoder time / capture time - 1 (goal <= 10 %),
  * bytes per token on disk for bf16 and fp8 storage against the naive 4 x H x 2 bytes, and the fp8 error.
Bare and capture runs alternate batch by batch (repeated), so load from other processes hits both alike.

    .venv/bin/python bench/data_gen_bench.py [--conversations 32] [--batch-size 4] [--max-length 512]

Writes bench/results/data_gen.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.record import REPO, bullet, num, pct
from data_gen.capture import FeatureCapture, base_model
from data_gen.capture_backends import TransformersCapture
from data_gen.masks import ChatMasker, MaskingError
from data_gen.pipeline import capture_samples
from data_gen.sources import DataSettings, load_conversations
from data_gen.store import FeatureDataset, finalize_split, write_shard
from speculators.atomic import atomic_write_json
from speculators.verifier import load_verifier


def encode(tokenizer, count: int, max_length: int):
    masker = ChatMasker(tokenizer)
    conversations, _ = load_conversations(DataSettings(max_conversations=count * 2))
    encoded = []
    for conversation in conversations:
        try:
            encoded += masker.encode(conversation, max_length)
        except MaskingError:
            continue
        if len(encoded) >= count:
            break
    return encoded[:count]


def batches(encoded, batch_size: int, pad_id: int):
    order = sorted(encoded, key=lambda s: -len(s.input_ids))
    out = []
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = len(rows[0].input_ids)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, sample in enumerate(rows):
            ids[r, : len(sample.input_ids)] = torch.tensor(sample.input_ids)
            mask[r, : len(sample.input_ids)] = 1
        out.append((ids, mask))
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)  # ~15k tokens
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "data_gen.json"))
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_verifier("smollm2", "auto", device)
    dtype = next(model.parameters()).dtype
    capture = FeatureCapture(model, out_dtype=None)
    encoded = encode(tokenizer, args.conversations, args.max_length)
    work = batches(encoded, args.batch_size, tokenizer.pad_token_id or 0)
    real_tokens = sum(len(s.input_ids) for s in encoded)
    padded_tokens = sum(ids.numel() for ids, _ in work)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def bare(ids, mask):
        with torch.no_grad():
            base_model(model)(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        sync()

    def full(ids, mask):
        with torch.no_grad():
            model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        sync()

    def captured(ids, mask):
        out = capture.capture(ids, mask)
        out["aux_hidden"].cpu(), out["last_hidden"].cpu()
        sync()

    for ids, mask in work[:1]:  # warm-up
        bare(ids, mask), captured(ids, mask), full(ids, mask)
    times = {"bare_decoder": 0.0, "capture": 0.0, "full_forward": 0.0}
    for _ in range(args.repeats):
        for ids, mask in work:
            times["bare_decoder"] += timed(lambda: bare(ids, mask))  # noqa: B023
            times["capture"] += timed(lambda: captured(ids, mask))  # noqa: B023
            times["full_forward"] += timed(lambda: full(ids, mask))  # noqa: B023
    rates = {name: args.repeats * real_tokens / seconds for name, seconds in times.items()}

    hidden = int(model.config.hidden_size)
    storage = {}
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        for storage_dtype in ("bfloat16", "fp8"):
            split = Path(tmp) / storage_dtype / "train"
            start = time.perf_counter()
            backend = TransformersCapture(
                model, capture.aux_layer_ids, args.batch_size, tokenizer.pad_token_id or 0
            )
            samples = capture_samples(backend, encoded)
            record = write_shard(split, 0, samples, len(capture.aux_layer_ids), storage_dtype)
            elapsed = time.perf_counter() - start
            finalize_split(split, 1, {"aux_layer_ids": capture.aux_layer_ids})
            entry = {
                "bytes": record["bytes"],
                "bytes_per_token": record["bytes"] / record["num_tokens"],
                "vs_naive": record["bytes"] / record["num_tokens"] / (4 * hidden * 2),
                "capture_and_write_tokens_per_s": real_tokens / elapsed,
            }
            if reference is None:
                reference = [s.aux_hidden.float() for s in samples]
            dataset = FeatureDataset(split)
            errors = [
                float(
                    ((dataset[i]["aux_hidden"] - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).mean()
                )
                for i, ref in enumerate(reference)
            ]
            entry["aux_relative_l2_error_vs_capture"] = sum(errors) / len(errors)
            storage[storage_dtype] = entry

    result = {
        "benchmark": "data_gen",
        "verifier": "SmolLM2-135M-Instruct (embedded)",
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "samples": len(encoded),
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "real_tokens": real_tokens,
        "padded_tokens": padded_tokens,
        "repeats": args.repeats,
        "tokens_per_s": rates,
        "capture_overhead_vs_bare_decoder": times["capture"] / times["bare_decoder"] - 1,
        "capture_overhead_vs_full_forward": times["capture"] / times["full_forward"] - 1,
        "overhead_goal": 0.10,
        "hidden_size": hidden,
        "aux_layer_ids": capture.aux_layer_ids,
        "naive_bytes_per_token": 4 * hidden * 2,
        "storage": storage,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.output, result)
    print(json.dumps(result, indent=1))


# ---- its section of bench/results/SUMMARY.md ------------------------------------------------------------------
RESULTS = ("data_gen",)  # the result files this bench writes (bench/results/<stem>.json)


def render(result: dict[str, Any]) -> list[str]:
    """data_gen.json's section of SUMMARY.md."""
    tps = result.get("tokens_per_s", {})
    lines = [
        bullet("capture tokens/s", num(tps.get("capture"))),
        bullet("bare decoder tokens/s", num(tps.get("bare_decoder"))),
        bullet("capture overhead vs bare forward", pct(result.get("capture_overhead_vs_bare_decoder"))),
    ]
    for dtype, info in result.get("storage", {}).items():
        lines.append(
            bullet(
                f"bytes/token {dtype}",
                f"{num(info.get('bytes_per_token'))} ({num(info.get('vs_naive'), 3)}x naive)",
            )
        )
    return lines


if __name__ == "__main__":
    run()
