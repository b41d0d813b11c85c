"""The memory plan of a recipe, without a GPU: ``python train/run.py recipe=NAME train.dry_run=true``.

Builds the recipe's exact draft on the meta device from the verifier's config (the shipped
``recipes/verifiers/<org>/<model>/config.json`` for the 8B recipes, so no hub and no weights are needed), runs ONE
training-time-test step (forward over ``ttt_steps``, the loss, backward) on meta tensors at the recipe's micro batch
and length, counting the bytes of every tensor while it is alive, and adds the per-rank static memory under each
ZeRO stage and process count. Writes ``<run_dir>/memory_plan.json`` and prints one line.

Why meta tensors and not a GPU: the plan must exist before anyone rents GPUs. Two data-dependent steps of the real
loss (which positions carry a loss token, ``nonzero``) have no meta kernel; :class:`WorstCaseMeta` answers them as
if every position were a trained position (packing fills every row), which is the worst case the GPU must hold.

Assumptions (also written into the JSON): micro batches are ``micro_batch_size`` rows of ``max_length`` tokens
(packed full); the traced kernel is the linear-memory chunked TTT attention (flex attention keeps the same q/k/v/out
and log-sum-exp, never a score matrix); gradients are freed as they are accumulated (DeepSpeed reduces them into
its own buffers, counted in the static part), and allocator fragmentation and the CUDA context (~0.5-1 GB) are not
in the count.
"""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from speculators.atomic import atomic_write_json
from speculators.format.config import Eagle3Config
from speculators.models.eagle3 import Eagle3DraftModel
from train.losses import step_weights
from train.settings import TrainSettings

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_VERIFIERS = REPO_ROOT / "recipes" / "verifiers"
STAGES = (0, 1, 2, 3)
PROCESS_COUNTS = (1, 8)
GIB = 2**30
RULES = {
    "zero0": "accelerate DDP, fp32 weights under bf16 autocast: 4 (param) + 4 (grad) + 8 (AdamW m, v) bytes per "
    "trainable param, + 4 (DDP gradient buckets) with more than one process",
    "zero1": "DeepSpeed bf16: 2 (bf16 param) + 2 (bf16 grad) + (4 fp32 master + 8 AdamW m, v) / N",
    "zero2": "DeepSpeed bf16: 2 (bf16 param) + (2 bf16 grad + 4 fp32 master + 8 AdamW m, v) / N",
    "zero3": "DeepSpeed bf16: (2 bf16 param + 2 bf16 grad + 4 fp32 master + 8 AdamW m, v) / N",
    "fp32": "with train.dtype=fp32 the bf16 copies are fp32 and there is no separate master copy",
    "frozen": "draft embedding (the verifier's, frozen): bf16 under DeepSpeed (ZeRO-3: / N), fp32 under DDP; "
    "target head (verifier lm_head + its draft-vocab rows + final norm): compute dtype, every rank; online mode: "
    "the whole verifier in its dtype, every rank",
}


# ---- the verifier's shape ------------------------------------------------------------------------------------
def shipped_verifier_dir(name_or_path: str) -> Path | None:
    """``recipes/verifiers/<org>/<model>`` when the repository ships that verifier's config, else None."""
    candidate = SHIPPED_VERIFIERS / name_or_path
    return candidate if (candidate / "config.json").is_file() else None


def plan_verifier_config(name_or_path: str) -> dict[str, Any]:
    """The verifier's HF config as a dict: the shipped copy first (offline), else the verifier itself."""
    from speculators.verifier import verifier_config_dict

    shipped = shipped_verifier_dir(name_or_path)
    return verifier_config_dict(str(shipped) if shipped else name_or_path)


# ---- live bytes of meta tensors ------------------------------------------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage created while active (forward and backward) until it is freed;
    ``peak`` is the maximum. Works for meta tensors (keyed by storage identity) and real ones alike."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._keys: set[int] = set()
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._count(item.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage._cdata, storage.nbytes()
        with self._lock:
            if key in self._keys or size == 0:
                return
            self._keys.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        with self._lock:
            if key in self._keys:
                self._keys.discard(key)
                self.live -= size


class WorstCaseMeta(TorchDispatchMode):
    """Runs the data-dependent ops of the loss on meta tensors as if every mask were all true: ``nonzero`` returns
    every index, boolean indexing selects everything, and a tensor's truth value is True."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.nonzero.default and args[0].is_meta:
            (mask,) = args
            return torch.empty((mask.numel(), mask.dim()), dtype=torch.long, device=mask.device)
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return True if args[0].dtype == torch.bool else 1
        if func in (
            torch.ops.aten.index.Tensor,
            torch.ops.aten.index_put_.default,
            torch.ops.aten.index_put.default,
        ):
            args = (args[0], _dense_indices(args[1]), *args[2:])
        return func(*args, **kwargs)


def _dense_indices(indices: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Boolean masks replaced by the long indices of an all-true mask of the same shape."""
    out: list[torch.Tensor | None] = []
    for index in indices:
        if index is not None and index.dtype == torch.bool and index.is_meta:
            out += [torch.empty(index.numel(), dtype=torch.long, device="meta")] * index.dim()
        else:
            out.append(index)
    return out


# ---- one training step ---------------------------------------------------------------------------------------
def trace_step(
    model: torch.nn.Module, head: Any, batch: dict[str, torch.Tensor], weights: list[float], topk: int
) -> int:
    """Peak bytes allocated by one TTT step (targets, unroll, loss, backward) of ``model`` on ``batch``, as the
    trainer runs it; gradients are dropped as they are accumulated (see the module docstring)."""
    from train.losses import step_masks, step_terms
    from train.targets import needed_positions, target_draft_ids, target_logits

    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        for p in model.parameters()
        if p.requires_grad
    ]
    tracker = LiveBytes()
    try:
        with WorstCaseMeta(), tracker:
            needed = needed_positions(batch["loss_mask"])
            masks = step_masks(
                batch["loss_mask"],
                batch["document_ids"],
                target_draft_ids(head, batch["last_hidden"], needed),
                len(weights),
            )
            logits = model(
                batch["input_ids"], batch["aux_hidden"], batch["position_ids"], batch["document_ids"]
            )
            verifier_logits = target_logits(head, batch["last_hidden"], needed)
            loss = logits[0].new_zeros((), dtype=torch.float32)
            for j, weight in enumerate(weights):
                terms = step_terms(logits[j], verifier_logits, masks, j, topk)
                loss = loss + weight * (terms.ce + terms.topk)
            del logits, verifier_logits, masks
            loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    return tracker.peak


def meta_batch(
    rows: int, length: int, aux_width: int, hidden: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A full micro batch on the meta device: ``rows`` packed rows of ``length`` tokens, features in ``dtype``."""
    device = "meta"
    return {
        "input_ids": torch.empty(rows, length, dtype=torch.long, device=device),
        "position_ids": torch.empty(rows, length, dtype=torch.long, device=device),
        "document_ids": torch.empty(rows, length, dtype=torch.long, device=device),
        "loss_mask": torch.empty(rows, length, dtype=torch.bool, device=device),
        "aux_hidden": torch.empty(rows, length, aux_width, dtype=dtype, device=device),
        "last_hidden": torch.empty(rows, length, hidden, dtype=dtype, device=device),
    }


def batch_bytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


# ---- static memory -------------------------------------------------------------------------------------------
def trainable_bytes_per_param(stage: int, processes: int, bf16: bool) -> float:
    """Bytes per trainable parameter on one rank (see :data:`RULES`)."""
    optimizer = 8.0
    if stage == 0:
        return 4 + 4 + optimizer + (4 if processes > 1 else 0)
    low, master = (2.0, 4.0) if bf16 else (4.0, 0.0)
    partitioned = {1: master + optimizer, 2: low + master + optimizer, 3: 2 * low + master + optimizer}[stage]
    replicated = {1: 2 * low, 2: low, 3: 0.0}[stage]
    return replicated + partitioned / processes


def frozen_bytes(
    draft_frozen: int, head_params: int, verifier_params: int, stage: int, processes: int, bf16: bool
) -> float:
    """Bytes of frozen tensors on one rank (see :data:`RULES`)."""
    compute = 2 if bf16 else 4
    embedding = draft_frozen * (4 if stage == 0 else compute)
    if stage == 3:
        embedding /= processes
    return embedding + head_params * compute + verifier_params * 2


# ---- the plan ------------------------------------------------------------------------------------------------
def build_meta_draft(
    config: TrainSettings | dict[str, Any], verifier_config: dict[str, Any], dtype: torch.dtype
):
    """The recipe's draft (``TTTDraft`` around ``Eagle3DraftModel``) with meta parameters, and its config."""
    from data_gen.capture import resolve_aux_layer_ids
    from train.unroll import TTTDraft

    settings = TrainSettings.from_config(config)
    model_cfg, wanted = settings.model, settings.verifier.aux_layer_ids
    aux_ids = resolve_aux_layer_ids(
        list(wanted) if wanted is not None else None, int(verifier_config["num_hidden_layers"])
    )
    draft_config = Eagle3Config.from_verifier(
        verifier_config,
        name_or_path=settings.verifier.name_or_path,
        draft_vocab_size=model_cfg.draft_vocab_size or int(verifier_config["vocab_size"]),
        aux_layer_ids=aux_ids,
        speculative_tokens=settings.export.speculative_tokens,
        num_layers=model_cfg.num_layers,
        layer_type=model_cfg.layer_type,
        norm_before_residual=model_cfg.norm_before_residual,
        torch_dtype="float32",
    )
    with torch.device("meta"):
        draft = Eagle3DraftModel(draft_config).to(dtype)
    # a trained embedding (P-EAGLE) moves from the frozen to the trainable bytes; its activations are the TTT
    # unroll's (same attention, one draft pass per depth), so the traced step stands for it as it is
    draft.embed_tokens.weight.requires_grad_(model_cfg.embed_requires_grad)
    model = TTTDraft(
        draft,
        settings.train.ttt_steps,
        detach_context=settings.train.detach_context,
        attention_backend="chunked",
        chunk_size=settings.train.attention_chunk,
    )
    return model, draft_config


def meta_head(verifier_config: dict[str, Any], draft_vocab: int, dtype: torch.dtype):
    """The frozen target head (verifier norm + lm_head) with meta tensors."""
    from train.targets import TargetHead

    hidden, vocab = int(verifier_config["hidden_size"]), int(verifier_config["vocab_size"])
    with torch.device("meta"):
        head = TargetHead(torch.empty(hidden), torch.empty(vocab, hidden), 1e-6, torch.arange(draft_vocab))
    return head.to(dtype)


def online_verifier_params(verifier_config: dict[str, Any]) -> int:
    """Parameters of the whole verifier (online mode keeps it on every rank), counted on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(verifier_config)
    hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def plan_memory(config: TrainSettings | dict[str, Any]) -> dict[str, Any]:
    """The memory plan of a recipe: its settings, or the resolved recipe (a plain dict)."""
    started = time.perf_counter()
    settings = TrainSettings.from_config(config)
    train_cfg = settings.train
    verifier_name = settings.verifier.name_or_path
    verifier_config = plan_verifier_config(verifier_name)
    bf16 = train_cfg.dtype in ("auto", "bf16", "bfloat16")  # auto = bf16 on the GPUs this plans for
    dtype = torch.bfloat16 if bf16 else torch.float32
    model, draft_config = build_meta_draft(settings, verifier_config, dtype)
    head = meta_head(verifier_config, draft_config.draft_vocab_size, dtype)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    draft_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    head_params = sum(t.numel() for t in head.buffers() if t.is_floating_point())
    head_params += sum(p.numel() for p in head.parameters())
    online = train_cfg.data_mode == "online"
    verifier_params = online_verifier_params(verifier_config) if online else 0
    rows, length = train_cfg.micro_batch_size, train_cfg.max_length
    hidden = int(verifier_config["hidden_size"])
    aux_width = len(draft_config.eagle_aux_hidden_state_layer_ids) * hidden
    batch = meta_batch(rows, length, aux_width, hidden, dtype)
    ttt = train_cfg.ttt_steps
    weights = step_weights(ttt, train_cfg.step_weight_decay)
    activations = trace_step(model, head, batch, weights, train_cfg.topk)
    static, peak, frozen = {}, {}, {}
    for stage in STAGES:
        key = f"zero{stage}"
        static[key], peak[key], frozen[key] = {}, {}, {}
        for n in PROCESS_COUNTS:
            static[key][str(n)] = int(trainable * trainable_bytes_per_param(stage, n, bf16))
            frozen[key][str(n)] = int(
                frozen_bytes(draft_frozen, head_params, verifier_params, stage, n, bf16)
            )
            peak[key][str(n)] = static[key][str(n)] + frozen[key][str(n)] + batch_bytes(batch) + activations
    recipe_stage = settings.deepspeed.zero_stage
    return {
        "recipe": settings.recipe_name,
        "verifier": verifier_name,
        "verifier_config": str(shipped_verifier_dir(verifier_name) or "the verifier's own config.json"),
        "dtype": "bfloat16" if bf16 else "float32",
        "data_mode": train_cfg.data_mode,
        "micro_batch_size": rows,
        "max_length": length,
        "ttt_steps": ttt,
        "draft_vocab_size": draft_config.draft_vocab_size,
        "params_trainable": trainable,
        "params_frozen": draft_frozen + head_params + verifier_params,
        "params_frozen_parts": {
            "draft_embedding": draft_frozen,
            "target_head": head_params,
            "verifier": verifier_params,
        },
        "batch_bytes": batch_bytes(batch),
        "activation_peak_bytes": activations,
        "static_bytes_per_rank": static,
        "frozen_bytes_per_rank": frozen,
        "peak_bytes_per_rank": peak,
        "recipe_zero_stage": recipe_stage,
        "rules": RULES,
        "assumptions": __doc__.split("Assumptions (also written into the JSON): ")[1]
        .split("\n\n")[0]
        .replace("\n", " "),
        "seconds": round(time.perf_counter() - started, 2),
    }


def summary_line(plan: dict[str, Any]) -> str:
    stage = f"zero{plan['recipe_zero_stage']}"
    peaks = plan["peak_bytes_per_rank"][stage]
    return (
        f"memory plan {plan['recipe']}: {plan['params_trainable'] / 1e6:.1f}M trainable, "
        f"{plan['params_frozen'] / 1e6:.1f}M frozen params; one TTT step ({plan['micro_batch_size']} x "
        f"{plan['max_length']} tokens, {plan['ttt_steps']} steps) {plan['activation_peak_bytes'] / GIB:.1f} GiB; "
        f"peak per rank ({stage}): " + ", ".join(f"{n} proc {b / GIB:.1f} GiB" for n, b in peaks.items())
    )


def write_plan(config: TrainSettings | dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """Plan, write ``<run_dir>/memory_plan.json`` atomically and print the one-line summary."""
    plan = plan_memory(config)
    target = Path(run_dir) / "memory_plan.json"
    atomic_write_json(target, plan)
    print(summary_line(plan) + f" -> {target}", flush=True)
    return plan


__all__ = ["LiveBytes", "WorstCaseMeta", "plan_memory", "summary_line", "trace_step", "write_plan"]
