"""The GPU check (driven by scripts/gpu_check.sh): what the CPU suite cannot prove, measured in minutes on one GPU.

Writes one JSON file with four sections:

1. ``flex_vs_dense``: compiled flex attention against the dense float32 reference, values and gradients, in fp32
   and bf16 (tolerances in the output);
2. ``train``: the exact eagle3_llama8b draft (from the shipped Llama-3.1-8B config) trained in bf16 for a few dozen
   steps on random 8B-shaped features at the recipe's micro batch and length: tokens/s, peak GPU memory
   (``torch.cuda.max_memory_allocated``), recompiles, first and last loss;
3. ``capture``: tokens/s of a full-depth, randomly initialised Llama-3.1-8B-shaped verifier capturing features;
4. ``export``: the trained draft written as a speculators checkpoint and validated.

Needs only torch, transformers, accelerate, safetensors and numpy: no hydra, omegaconf, deepspeed, datasets or
vLLM (train/ modules that import omegaconf are not used; the recipe's values are below, read through
:class:`train.settings.TrainSettings` as the trainer reads them, and a CPU test checks them against the composed
recipe). ``--cpu-smoke`` runs the same code with tiny shapes on CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
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
        "hass": {"detach_context": True},
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
    from train.settings import TrainSettings

    model, draft_config, _ = build_meta_draft(
        TrainSettings.from_config(recipe), verifier_config, torch.float32
    )
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
    from train.settings import TrainSettings
    from train.targets import needed_positions, target_draft_ids, target_logits

    dtype = torch.bfloat16
    model, head, draft_config = build_draft(recipe, verifier_config, device, dtype)
    train = TrainSettings.from_config(recipe).train
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
    sections = [
        ("flex_vs_dense", lambda: flex_vs_dense(device, (2, 4, 2, 64, 16) if cpu_smoke else (4, 32, 8, 2048, 128), 3)),
        ("train", lambda: train_draft(recipe, verifier_config, device, 10 if cpu_smoke else steps)),
        ("capture", lambda: capture_speed(verifier_config, device, 2 if cpu_smoke else 8, 64 if cpu_smoke else 2048, 1 if cpu_smoke else 3)),
    ]  # fmt: skip
    trained = None
    for name, section in sections:
        began = time.perf_counter()
        try:
            result = section()
            if name == "train":
                trained = result.pop("model")
                result.pop("draft_config")
            report[name] = {**result, "seconds": round(time.perf_counter() - began, 2)}
        except Exception as error:  # noqa: BLE001 - every section reports; one failure must not hide the rest
            report[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        _write(out, report)
        if device == "cuda":
            torch.cuda.empty_cache()
    if trained is not None:
        report["export"] = export_and_validate(trained, verifier_config, workdir / "draft")
    else:
        report["export"] = {"error": "no trained draft (see train)"}
    report["seconds"] = round(time.perf_counter() - started, 2)
    report["ok"] = (
        all("error" not in report[name] for name in ("flex_vs_dense", "train", "capture", "export"))
        and all(report["flex_vs_dense"][dtype]["ok"] for dtype in ("float32", "bfloat16"))
        and report["train"]["loss_fell"]
        and report["export"]["ok"]
    )
    _write(out, report)
    return report


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
