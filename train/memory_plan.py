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
and log-sum-exp, never a score matrix), plus, where the recipe's backend is flex (auto on CUDA), the keys and values
flex concatenates and zero-pads to the unroll's full key length at every step and keeps for backward, and whatever
else the objective's kernel keeps for backward beyond the chunked trace (its ``memory_terms``: e.g. an anchor-block
flex attention's context copy, per-anchor outputs and block mask at the recipe's anchor count); gradients are
freed as they are accumulated (DeepSpeed reduces them into its own buffers, counted in the static part), and
allocator fragmentation and the CUDA context (~0.5-1 GB) are not in the count.

The recipe's ``memory_plan`` section names the hardware it is meant for (``gpu``, ``gpus``, ``gpu_memory_gib``) and
optionally a Ulysses ``sequence_parallel`` degree; the plan then says, under ``hardware``, which layouts (ZeRO 0-3 and
ZeRO-3 with CPU offload) fit that GPU with :data:`RESERVE_GIB` to spare, the least sharding that fits, and whether
the recipe's own layout does. Sequence parallelism splits each sequence across ``sequence_parallel`` ranks (DeepSpeed
Ulysses: an all-to-all hands each rank all positions of 1/sp of the heads inside attention, 1/sp of the positions
elsewhere), so the per-GPU batch and activations are divided by the degree; the static and frozen parts are not.
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

from speculators import algorithms
from speculators.atomic import atomic_write_json
from speculators.local_paths import public_name, scrub
from train.objectives import train_settings
from train.settings import TrainSettings

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_VERIFIERS = REPO_ROOT / "recipes" / "verifiers"
STAGES = (0, 1, 2, 3)
PROCESS_COUNTS = (1, 8)
GIB = 2**30
OFFLOAD = "zero3_offload"
RESERVE_GIB = 4  # per GPU, not counted by the trace: CUDA context, NCCL buffers, allocator fragmentation
LAYOUTS = ("zero0", "zero1", "zero2", "zero3", OFFLOAD)  # least sharded first (zero0: DDP, fp32 weights)
RULES = {
    "zero0": "accelerate DDP, fp32 weights under bf16 autocast: 4 (param) + 4 (grad) + 8 (AdamW m, v) bytes per "
    "trainable param, + 4 (DDP gradient buckets) with more than one process",
    "zero1": "DeepSpeed bf16: 2 (bf16 param) + 2 (bf16 grad) + (4 fp32 master + 8 AdamW m, v) / N",
    "zero2": "DeepSpeed bf16: 2 (bf16 param) + (2 bf16 grad + 4 fp32 master + 8 AdamW m, v) / N",
    "zero3": "DeepSpeed bf16: (2 bf16 param + 2 bf16 grad + 4 fp32 master + 8 AdamW m, v) / N",
    "fp32": "with train.dtype=fp32 the bf16 copies are fp32 and there is no separate master copy",
    "zero3_offload": "DeepSpeed ZeRO-3 with offload_param and offload_optimizer on CPU: no trainable bytes stay on "
    "the GPU but the gathered bf16 copy of the tensor in use and of the prefetch bucket, 2 x (largest trainable "
    "tensor + stage3_prefetch_bucket_size); host RAM per rank (2 bf16 param + 4 fp32 grad + 4 fp32 master + 8 "
    "AdamW m, v) / N; the frozen embedding is offloaded too and gathered whole for the lookup",
    "frozen": "draft embedding (the verifier's, frozen): bf16 under DeepSpeed (ZeRO-3: / N), fp32 under DDP; "
    "target head (verifier lm_head + its draft-vocab rows + final norm): compute dtype, every rank; online mode: "
    "the whole verifier in its dtype, every rank",
}


# ---- the verifier's shape ------------------------------------------------------------------------------------
def shipped_verifier_dir(name_or_path: str) -> Path | None:
    """``recipes/verifiers/<org>/<model>`` when the repository ships that verifier's config, else None."""
    candidate = SHIPPED_VERIFIERS / name_or_path
    return candidate if (candidate / "config.json").is_file() else None


def shipped_config_name(name_or_path: str) -> str:
    """Where the plan's verifier shape came from, said without a local path: the repository-relative shipped
    directory, else the verifier's own config."""
    shipped = shipped_verifier_dir(name_or_path)
    if shipped is None or not shipped.resolve().is_relative_to(
        SHIPPED_VERIFIERS
    ):  # an absolute name joins as itself
        return "the verifier's own config.json"
    return shipped.resolve().relative_to(REPO_ROOT).as_posix()


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
def trace_step(model: torch.nn.Module, head: Any, batch: dict[str, torch.Tensor], objective: Any) -> int:
    """Peak bytes allocated by one training step of ``model`` on ``batch`` as the objective runs it (targets,
    sampled positions, forward, loss, backward); gradients are dropped as they are accumulated (see the module
    docstring)."""
    from train.data import MicroBatch
    from train.step_stats import StepStats

    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        for p in model.parameters()
        if p.requires_grad
    ]
    tracker = LiveBytes()
    micro = MicroBatch(
        input_ids=batch["input_ids"],
        loss_mask=batch["loss_mask"],
        document_ids=batch["document_ids"],
        position_ids=batch["position_ids"],
        aux_hidden=batch["aux_hidden"],
        last_hidden=batch["last_hidden"],
        num_documents=1,
    )
    try:
        with WorstCaseMeta(), tracker:
            plan = objective.plan(micro, micro.loss_mask, head, seed=0)
            device = micro.input_ids.device
            trained = torch.ones(objective.steps, dtype=torch.float64, device=device)
            stats = StepStats(objective.steps, device)
            loss = objective.loss(model, micro, plan, head, trained, stats)
            del plan, stats
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


def flex_padded_key_bytes(
    rows: int, length: int, ttt_steps: int, draft_config: Any, dtype: torch.dtype, backend: str
) -> int:
    """Bytes of the padded key and value tensors flex attention holds until backward, which the chunked trace does
    not allocate: at each of the ``ttt_steps`` steps every draft layer builds ``cat(K_0..K_j, zeros)`` and the same
    for V, ``[rows, kv_heads, ttt_steps * length, head_dim]`` each (train.ttt_attention.padded_step_keys), so the
    future steps keep one compiled shape. About 1.6 GB at the 8B recipe (4 x 2048 tokens, 7 steps, 8 kv heads of
    128). Zero when the recipe asks for the chunked (or dense) kernel."""
    if backend not in ("auto", "flex"):  # auto: flex on the CUDA GPUs this plans for
        return 0
    layer = draft_config.transformer_layer_config
    kv_heads = int(layer.get("num_key_value_heads") or layer["num_attention_heads"])
    one = rows * kv_heads * ttt_steps * length * draft_config.head_dim * dtype.itemsize
    return 2 * one * ttt_steps * draft_config.num_layers


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


def offload_bytes(
    trainable: int,
    largest_tensor: int,
    prefetch: int,
    draft_frozen: int,
    head_params: int,
    verifier_params: int,
    processes: int,
    bf16: bool,
) -> tuple[int, int, int]:
    """(GPU static, GPU frozen, host RAM) bytes per rank under ZeRO-3 with parameter and optimizer offload (see
    :data:`RULES`)."""
    compute = 2 if bf16 else 4
    gpu_static = 2 * (largest_tensor + prefetch) * compute
    gpu_frozen = draft_frozen * compute + head_params * compute + verifier_params * 2
    host = trainable * (compute + 4 + 4 + 8) // processes
    return gpu_static, gpu_frozen, host


def recipe_layout(settings: TrainSettings) -> str:
    """The recipe's layout as one of :data:`LAYOUTS` (ZeRO-3 with CPU offload of params or optimizer: ``zero3_offload``)."""
    zero = (settings.deepspeed.config or {}).get("zero_optimization") or {}
    offloaded = any(
        (zero.get(key) or {}).get("device") not in (None, "none")
        for key in ("offload_param", "offload_optimizer")
    )
    stage = settings.deepspeed.zero_stage
    return OFFLOAD if settings.deepspeed.enabled and stage == 3 and offloaded else f"zero{stage}"


def planned_hardware(settings: TrainSettings) -> dict[str, Any] | None:
    """The recipe's ``memory_plan`` section (the hardware it is planned for), checked; None when it names none."""
    section = settings.resolved.get("memory_plan")
    if not section:
        return None
    wanted = ("gpu", "gpus", "gpu_memory_gib", "sequence_parallel")
    unknown = sorted(set(section) - set(wanted))
    missing = sorted({"gpus", "gpu_memory_gib"} - set(section))
    if unknown or missing:
        raise ValueError(
            f"recipe {settings.recipe_name}: memory_plan section has unknown key(s) {unknown} / lacks {missing}; "
            f"it takes {sorted(wanted)}"
        )
    hardware = {"gpu": section.get("gpu", "GPU"), "sequence_parallel": 1, **section}
    if (
        hardware["gpus"] < 1
        or hardware["sequence_parallel"] < 1
        or hardware["gpus"] % hardware["sequence_parallel"]
    ):
        raise ValueError(
            f"recipe {settings.recipe_name}: memory_plan.sequence_parallel={hardware['sequence_parallel']} must "
            f"divide memory_plan.gpus={hardware['gpus']} (both at least 1)"
        )
    return hardware


def hardware_verdict(
    hardware: dict[str, Any], static: dict[str, int], frozen: dict[str, int], per_sequence: int, layout: str
) -> dict[str, Any]:
    """Per-rank peak of every layout on the named hardware (``static``/``frozen`` at its GPU count, the batch and
    activations ``per_sequence`` split by the SP degree), which fit with :data:`RESERVE_GIB` to spare, the least
    sharded layout that fits and whether the recipe's does."""
    sp = int(hardware["sequence_parallel"])
    budget = (float(hardware["gpu_memory_gib"]) - RESERVE_GIB) * GIB
    peak = {key: static[key] + frozen[key] + per_sequence // sp for key in LAYOUTS}
    fits = {key: peak[key] <= budget for key in LAYOUTS}
    return {
        **hardware,
        "reserve_gib": RESERVE_GIB,
        "data_parallel": hardware["gpus"] // sp,
        "peak_bytes_per_rank": peak,
        "fits": fits,
        "least_sharding_that_fits": next((key for key in LAYOUTS if fits[key]), None),
        "recipe_layout": layout,
        "recipe_fits": fits[layout],
    }


# ---- the plan ------------------------------------------------------------------------------------------------
def build_meta_draft(
    config: TrainSettings | dict[str, Any], verifier_config: dict[str, Any], dtype: torch.dtype
) -> tuple[torch.nn.Module, Any, Any]:
    """The recipe's wrapped draft with meta parameters, its config and its objective (the same config builders
    as the trainer's: the objective's ``meta_model`` builds its config as its ``build`` does)."""
    from data_gen.capture import resolve_aux_layer_ids
    from train.objectives import objective_for

    settings = train_settings(config)
    wanted = settings.verifier.aux_layer_ids
    aux_ids = resolve_aux_layer_ids(
        list(wanted) if wanted is not None else None, int(verifier_config["num_hidden_layers"])
    )
    objective = objective_for(settings)
    draft_vocab = settings.model.draft_vocab_size or int(verifier_config["vocab_size"])
    draft_config, model = objective.meta_model(verifier_config, aux_ids, draft_vocab, dtype)
    return model, draft_config, objective


def meta_head(verifier_config: dict[str, Any], draft_vocab: int, dtype: torch.dtype):
    """The frozen target head (verifier norm + lm_head) with meta tensors."""
    from train.targets import TargetHead

    hidden, vocab = int(verifier_config["hidden_size"]), int(verifier_config["vocab_size"])
    with torch.device("meta"):
        head = TargetHead.with_rms_norm(
            torch.empty(hidden), torch.empty(vocab, hidden), 1e-6, torch.arange(draft_vocab)
        )
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
    settings = train_settings(config)
    hardware = planned_hardware(settings)  # checked before the trace: a wrong section fails in a second
    train_cfg = settings.train
    verifier_name = settings.verifier.name_or_path
    verifier_config = plan_verifier_config(verifier_name)
    bf16 = train_cfg.dtype in ("auto", "bf16", "bfloat16")  # auto = bf16 on the GPUs this plans for
    dtype = torch.bfloat16 if bf16 else torch.float32
    model, draft_config, objective = build_meta_draft(settings, verifier_config, dtype)
    head = meta_head(verifier_config, draft_config.draft_vocab_size, dtype)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    draft_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    head_params = sum(t.numel() for t in head.buffers() if t.is_floating_point())
    head_params += sum(p.numel() for p in head.parameters())
    online = train_cfg.data_mode == "online"
    verifier_params = online_verifier_params(verifier_config) if online else 0
    rows, length = train_cfg.micro_batch_size, train_cfg.max_length
    hidden = int(verifier_config["hidden_size"])
    algorithm = algorithms.get(draft_config.SPECULATORS_MODEL_TYPE)
    aux_width = len(algorithm.aux_layer_ids(draft_config)) * hidden
    batch = meta_batch(rows, length, aux_width, hidden, dtype)
    terms = objective.memory_terms(draft_config, dtype)  # its GPU kernel's held tensors, beyond the trace
    flex_keys, flex_blocks = terms.padded_keys_bytes, terms.block_attention_bytes
    activations = trace_step(model, head, batch, objective) + flex_keys + sum(flex_blocks.values())
    static, peak, frozen = {}, {}, {}
    hardware_gpus = (hardware or {}).get("gpus")
    process_counts = sorted({*PROCESS_COUNTS, *([hardware_gpus] if hardware_gpus else [])})
    for stage in STAGES:
        key = f"zero{stage}"
        static[key], peak[key], frozen[key] = {}, {}, {}
        for n in process_counts:
            static[key][str(n)] = int(trainable * trainable_bytes_per_param(stage, n, bf16))
            frozen[key][str(n)] = int(
                frozen_bytes(draft_frozen, head_params, verifier_params, stage, n, bf16)
            )
            peak[key][str(n)] = static[key][str(n)] + frozen[key][str(n)] + batch_bytes(batch) + activations
    recipe_stage = settings.deepspeed.zero_stage
    largest = max((p.numel() for p in model.parameters() if p.requires_grad), default=0)
    prefetch = int(
        ((settings.deepspeed.config or {}).get("zero_optimization") or {}).get("stage3_prefetch_bucket_size")
        or 50_000_000
    )
    host = {}
    static[OFFLOAD], frozen[OFFLOAD], peak[OFFLOAD] = {}, {}, {}
    for n in process_counts:
        gpu_static, gpu_frozen, host[str(n)] = offload_bytes(
            trainable, largest, prefetch, draft_frozen, head_params, verifier_params, n, bf16
        )
        static[OFFLOAD][str(n)], frozen[OFFLOAD][str(n)] = gpu_static, gpu_frozen
        peak[OFFLOAD][str(n)] = gpu_static + gpu_frozen + batch_bytes(batch) + activations
    verdict = None
    if hardware is not None:
        gpus = str(hardware["gpus"])
        verdict = hardware_verdict(
            hardware,
            {key: static[key][gpus] for key in LAYOUTS},
            {key: frozen[key][gpus] for key in LAYOUTS},
            batch_bytes(batch) + activations,
            recipe_layout(settings),
        )
    return {
        "recipe": settings.recipe_name,
        "verifier": public_name(verifier_name),  # a plan may be shared or committed: no local path in it
        "verifier_config": shipped_config_name(verifier_name),
        "dtype": "bfloat16" if bf16 else "float32",
        "data_mode": train_cfg.data_mode,
        "micro_batch_size": rows,
        "max_length": length,
        "algorithm": train_cfg.algorithm,
        "drafted_positions": objective.steps,  # TTT steps, or a block's draft slots
        "max_anchors": terms.max_anchors,
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
        "flex_padded_keys_bytes": flex_keys,  # included in activation_peak_bytes
        "flex_block_attention_bytes": flex_blocks,  # block drafters under flex, by part; included too
        "static_bytes_per_rank": static,
        "frozen_bytes_per_rank": frozen,
        "peak_bytes_per_rank": peak,
        "recipe_zero_stage": recipe_stage,
        "offload_host_bytes_per_rank": host,
        "hardware": verdict,  # null when the recipe names no hardware (memory_plan section)
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
        f"{plan['params_frozen'] / 1e6:.1f}M frozen params; one {plan['algorithm']} step ({plan['micro_batch_size']} x "
        f"{plan['max_length']} tokens, {plan['drafted_positions']} drafted positions) {plan['activation_peak_bytes'] / GIB:.1f} GiB; "
        f"peak per rank ({stage}): "
        + ", ".join(f"{n} proc {b / GIB:.1f} GiB" for n, b in peaks.items())
        + hardware_line(plan)
    )


def hardware_line(plan: dict[str, Any]) -> str:
    """The verdict on the named hardware, appended to the summary (empty when the recipe names none)."""
    verdict = plan.get("hardware")
    if not verdict:
        return ""
    layout = verdict["recipe_layout"]
    peak = verdict["peak_bytes_per_rank"][layout] / GIB
    sp = f", sequence parallel {verdict['sequence_parallel']}" if verdict["sequence_parallel"] > 1 else ""
    return (
        f"; on {verdict['gpus']} x {verdict['gpu']} ({verdict['gpu_memory_gib']} GiB{sp}): {layout} "
        f"{'fits' if verdict['recipe_fits'] else 'DOES NOT FIT'} ({peak:.1f} GiB per rank); least sharding that fits: "
        f"{verdict['least_sharding_that_fits']}"
    )


def write_plan(config: TrainSettings | dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """Plan, write ``<run_dir>/memory_plan.json`` atomically and print the one-line summary."""
    plan = scrub(plan_memory(config), Path(run_dir))  # relative to the run at most (speculators.local_paths)
    target = Path(run_dir) / "memory_plan.json"
    atomic_write_json(target, plan)
    print(summary_line(plan) + f" -> {target}", flush=True)
    return plan


__all__ = ["LiveBytes", "WorstCaseMeta", "plan_memory", "summary_line", "trace_step", "write_plan"]
