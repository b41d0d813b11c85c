"""Everything built once before the loop: the accelerator (single process, DDP or DeepSpeed ZeRO), the draft and
its vocabulary, the optimizer (train/optimizers.py, re-exported here) and the learning-rate schedule.

CPU/GPU differ only in choices made here at run time (dtype, process-group backend, attention kernel):

* no CUDA → gloo. accelerate needs ``cpu=True`` for DDP on CPU (otherwise 2 launched processes silently train
  independently) and ``InitProcessGroupKwargs(backend="gloo")`` for DeepSpeed (otherwise a batch-size assertion);
  ``ACCELERATE_USE_CPU=true`` would silently turn a DeepSpeed run into DDP, so it is refused.
* DeepSpeed's shared-memory comm op JIT-compiles for a minute on first use on CPU; ``deepspeed.build_cpu_shm_op``
  (default false) skips it — gloo is used instead.
* The schedule is a pure function of the optimizer step (no LR-scheduler state to save or to double-step: accelerate
  steps a prepared scheduler ``num_processes`` times per call), applied to the param groups before every step.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from speculators import algorithms, runs
from speculators.algorithms.eagle3 import norm_flags
from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.precision import Precision, choose
from speculators.verifier import (
    read_verifier_tensors,
    resolve_verifier_path,
    verifier_config_dict,
    verifier_embedding,
)
from speculators.vocab import DraftVocab
from train.optimizers import make_optimizer
from train.settings import TrainSettings
from train.targets import TargetHead


# ---- precision and processes --------------------------------------------------------------------------------
def compute_precision(name: str) -> Precision:
    """``train.dtype``'s decision (speculators.precision): the recipe's value, else SPECULATORS_COMPUTE_DTYPE, else
    bf16 where the device runs it natively (CUDA with bf16, a CPU with avx512_bf16/AMX) and fp32 elsewhere. bf16
    means autocast over fp32 master weights (accelerate's mixed precision, or DeepSpeed's bf16 with an fp32
    copy); the losses are summed in fp32."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    choice = choose(name, device, key="train.dtype")
    if choice.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"train.dtype={name!r} ({choice.reason}): use auto, bf16 or fp32 (fp16 needs loss scaling, not supported)"
        )
    return choice


def compute_dtype(name: str) -> torch.dtype:
    """The dtype of :func:`compute_precision`."""
    return compute_precision(name).dtype


def free_port() -> int:
    """A TCP port free on this host now (for MASTER_PORT / ``--main_process_port``): the one port finder."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_launcher_env() -> None:
    """A lone DeepSpeed process without launcher variables fails (``No module named 'mpi4py'``): provide them."""
    if "LOCAL_RANK" in os.environ:
        return
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )


@contextmanager
def outside_zero3_init(accelerator) -> Iterator[None]:
    """A context in which transformers' ``from_pretrained`` builds whole, unpartitioned parameters.

    Under ZeRO-3 accelerate registers its DeepSpeed config with transformers, whose ``from_pretrained`` then
    creates every model inside ``deepspeed.zero.Init``, partitioned across ranks. Only the engine-wrapped draft
    gets the hooks that gather them, so a frozen model loaded there (the online verifier) would run on empty
    shards. accelerate's ``zero3_init_context_manager(enable=False)`` does not help (accelerate 1.15 re-registers
    the config even with the flag off), so the registration itself is lifted here and restored afterwards.
    No-op without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    flag, plugin.zero3_init_flag = plugin.zero3_init_flag, False
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.zero3_init_flag = flag
        if getattr(plugin, "dschf", None) is not None:
            set_hf_deepspeed_config(plugin.dschf)


def deepspeed_config(settings: TrainSettings, dtype: torch.dtype) -> dict[str, Any]:
    """The recipe's DeepSpeed dict with the values the trainer owns filled in (no ``auto`` left to guess)."""
    config = copy.deepcopy(settings.deepspeed.config or {})
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro, accum = settings.train.micro_batch_size, settings.train.grad_accum
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = accum
    config["train_batch_size"] = micro * accum * world
    config["gradient_clipping"] = settings.optim.clip_norm
    config["bf16"] = {"enabled": dtype == torch.bfloat16}
    config.pop("fp16", None)
    config["zero_allow_untested_optimizer"] = True
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if offload.get("device") not in (None, "none"):
        config["zero_force_ds_cpu_optimizer"] = False  # our client torch AdamW runs on the offloaded params
    config.setdefault("steps_per_print", 1 << 30)
    config.setdefault("wall_clock_breakdown", False)
    return config


def make_accelerator(settings: TrainSettings, dtype: torch.dtype):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    deepspeed = settings.deepspeed
    distributed = deepspeed.enabled or int(os.environ.get("WORLD_SIZE", "1")) > 1
    # gloo only where a process group is made: forcing a backend on a lone plain process breaks accelerate
    handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed and not cuda else []
    grad_accum = settings.train.grad_accum
    if deepspeed.enabled:
        if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
            raise RuntimeError(
                "ACCELERATE_USE_CPU=true turns a DeepSpeed run into plain DDP; unset it and launch with "
                "`accelerate launch --multi_gpu --num_processes N train/run.py ...` (DeepSpeed picks gloo on CPU)"
            )
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
        if not cuda and not deepspeed.build_cpu_shm_op:
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        ensure_launcher_env()
        plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(settings, dtype))
        return Accelerator(
            deepspeed_plugin=plugin, gradient_accumulation_steps=grad_accum, kwargs_handlers=handlers
        )
    return Accelerator(
        cpu=not cuda,
        mixed_precision="bf16" if dtype == torch.bfloat16 else "no",
        gradient_accumulation_steps=grad_accum,
        kwargs_handlers=handlers,
    )


# ---- the draft ----------------------------------------------------------------------------------------------
def draft_config(
    settings: TrainSettings, verifier_config: dict[str, Any], aux_layer_ids: list[int], draft_vocab_size: int
) -> Eagle3Config:
    """The draft's config for a training run: :func:`recipe_draft_config` with the run's vocabulary and the
    verifier's resolved path (``smollm2`` → the converted directory vLLM loads)."""
    return recipe_draft_config(
        settings,
        verifier_config,
        aux_layer_ids,
        draft_vocab_size,
        resolve_verifier_path(settings.verifier.name_or_path),
    )


def recipe_draft_config(
    settings: TrainSettings,
    verifier_config: dict[str, Any],
    aux_layer_ids: list[int],
    draft_vocab_size: int,
    name_or_path: str,
) -> Eagle3Config:
    """The one mapping from a recipe to a draft config, shared by the trainer and the memory planner (which has
    no vocabulary yet and must not convert the embedded verifier just to name it), so the plan is of the draft
    the trainer builds. The optional norms are the recipe's, else what ``train.algorithm`` declares (EAGLE-3.1)."""
    config = Eagle3Config.from_verifier(
        verifier_config,
        name_or_path=name_or_path,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=aux_layer_ids,
        speculative_tokens=settings.export.speculative_tokens,
        num_layers=settings.model.num_layers,
        layer_type=settings.model.layer_type,
        norm_before_residual=settings.model.norm_before_residual,
        torch_dtype="float32",
        sliding_window=settings.model.sliding_window,
    )
    for flag, value in norm_flags(settings.train.algorithm, settings.model).items():
        setattr(config, flag, value)
    return config


@torch.no_grad()
def scale_fc_by_feature_rms(draft: Eagle3DraftModel, feature_rms: torch.Tensor) -> None:
    """Data-dependent fc init (``model.fc_init=feature_rms``): divide each fc input column by the RMS of its
    feature dimension, so every dimension of every aux layer starts with an equal say.

    Llama-family states carry a few "massive activation" dimensions hundreds of times larger than the rest (in
    SmolLM2's deep aux layer two dims hold ~40% of the energy). With the default init they dominate the fc output,
    which hidden_norm turns into a nearly constant vector: the draft starts blind to the features and spends its
    first steps unlearning them. Only the initial weights change; the architecture (and vLLM) are untouched."""
    draft.fc.weight.mul_(feature_rms.clamp_min(1e-6).reciprocal().to(draft.fc.weight))


def build_draft(
    settings: TrainSettings,
    config: Eagle3Config,
    vocab: DraftVocab,
    head: TargetHead,
    model_class: type[Eagle3DraftModel] = Eagle3DraftModel,
) -> Eagle3DraftModel:
    """A fresh draft (same init on every rank) with the verifier's embedding and, optionally, its lm_head rows.
    ``model_class``: the EAGLE-3 family member to build (P-EAGLE adds its mask feature to the same layers)."""
    torch.manual_seed(settings.seed)
    draft = model_class(config)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    embedding = verifier_embedding(settings.verifier.name_or_path)
    draft.embed_tokens.weight.data.copy_(embedding.to(draft.embed_tokens.weight.dtype))
    if settings.model.init_lm_head_from_verifier:
        draft.lm_head.weight.data.copy_(head.draft_weight.to(draft.lm_head.weight.dtype))
    draft.lm_head.weight.requires_grad_(settings.model.train_lm_head)
    if settings.model.warm_start == "top_layer":
        warm_start_from_verifier(draft, settings.verifier.name_or_path)
    if settings.train.init_from:
        init_from_checkpoint(draft, Path(settings.train.init_from), vocab)
    return draft


def draft_mask_token(
    settings: TrainSettings, features: Any, embedding_rows: int, wanted: int | None, key: str
) -> tuple[int, str]:
    """``(mask_token_id, reason)`` of a draft with mask slots (:mod:`speculators.mask_token`): the recipe's id
    (``wanted``, set under the objective group's ``key``), else one chosen from the verifier's tokenizer (if its
    directory has one) and the training data's token counts."""
    from transformers import AutoTokenizer

    from speculators.mask_token import resolve_mask_token

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_verifier_path(settings.verifier.name_or_path))
    except (OSError, ValueError):  # a verifier directory without tokenizer files
        tokenizer = None
    return resolve_mask_token(tokenizer, embedding_rows, features.counts, wanted, key)


@torch.no_grad()
def warm_start_from_verifier(draft: Eagle3DraftModel, name_or_path: str) -> None:
    """``model.warm_start=top_layer``: start the draft's decoder layers from the verifier's top layers instead of
    a random layer (the head's rows come from the verifier already: ``init_lm_head_from_verifier``).

    The draft's final norm stays at ones: copying the verifier's made the untrained draft's logits over-confident
    and nearly doubled its held-out loss at step 0 (53.4 vs 28.8 on the demo recipe; 29.9 with the layer copied and
    the norm left at ones). The trainer then divides the residual writes by the data's residual RMS
    (:func:`calibrate_warm_start`), which needs the training data, hence outside this function.

    The draft's ``num_layers`` layers take the verifier's last ``num_layers`` layers, in order. Everything is a
    plain copy except layer 0's q/k/v, which read ``[input_layernorm(embed(x_{t+1})) ‖ hidden_norm(g_t)]`` (2H)
    where the verifier's read ``input_layernorm(residual)`` (H). The verifier's residual stream at position t+1 is
    the token's embedding plus what the layers below wrote about the context, so the nearest equivalent of its
    input is the sum of the two halves: both halves get the verifier's matrix, scaled by 1/√2 so that two
    independent unit-RMS halves give the unit RMS the verifier's layer expects. A zero embedding half would be the
    other choice, but then the next token (which reaches the draft only through attention: the residual is
    ``hidden_norm(g)``) would be invisible at the start. The verifier's ``input_layernorm`` weight goes to the
    draft's ``input_layernorm`` (embedding half only) and is folded into the hidden half's columns, so
    ``hidden_norm`` stays at ones: its output is also the draft's residual, which a per-dimension gain tuned for
    attention inputs would distort. ``fc`` keeps its own init (``model.fc_init``): it learns to map the aux states
    into the residual basis these copied weights and the head already speak."""
    verifier_layers = int(verifier_config_dict(name_or_path)["num_hidden_layers"])
    first = verifier_layers - len(draft.layers)
    if first < 0:
        raise ValueError(
            f"model.warm_start=top_layer: the draft has {len(draft.layers)} layers but {name_or_path} only "
            f"{verifier_layers}; lower model.num_layers or use model.warm_start=none"
        )
    for offset, layer in enumerate(draft.layers):
        own = {name: t for name, t in layer.state_dict().items() if name != "hidden_norm.weight"}
        prefix = f"model.layers.{first + offset}."
        found = read_verifier_tensors(name_or_path, {name: (prefix + name,) for name in own})
        missing = sorted(set(own) - set(found))
        if missing:
            raise KeyError(
                f"model.warm_start=top_layer: {name_or_path} has no {[prefix + n for n in missing]}; "
                "warm start needs a Llama/Qwen3-style verifier with the draft's layer shapes (or warm_start=none)"
            )
        if offset == 0:
            found = widen_first_layer_inputs(found)
        for name, tensor in own.items():
            if found[name].shape != tensor.shape:
                raise ValueError(
                    f"model.warm_start=top_layer: {prefix}{name} of {name_or_path} has shape "
                    f"{tuple(found[name].shape)}, the draft's is {tuple(tensor.shape)}; use model.warm_start=none"
                )
            tensor.copy_(found[name].to(tensor.dtype))


@torch.no_grad()
def calibrate_warm_start(draft: Eagle3DraftModel, residual_rms: float) -> None:
    """Divide the copied layers' residual writes (``o_proj``, ``down_proj``) by the RMS of the verifier's residual
    stream at the top (measured on the training data's last states), after :func:`warm_start_from_verifier`.

    The verifier's top layer adds its updates to a residual of RMS ~30 (SmolLM2); the draft's residual is
    ``hidden_norm(g)``, of RMS ~1. Copied as they are, the updates are ~30x too large for it and swamp the
    residual (measured: held-out AL 1.121 vs 1.171 without warm start). Every norm inside the layer is
    scale-free, so dividing the two writes by that RMS gives the draft's layer the verifier's update-to-residual
    ratio exactly."""
    if not residual_rms > 0:
        raise ValueError(
            f"model.warm_start=top_layer: residual RMS {residual_rms} of the data is not positive"
        )
    for layer in draft.layers:
        layer.self_attn.o_proj.weight.div_(residual_rms)
        layer.mlp.down_proj.weight.div_(residual_rms)


def widen_first_layer_inputs(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The verifier layer's q/k/v ``[out, H]`` as layer 0's ``[out, 2H]``: ``[W, W·diag(γ)] / √2`` with γ the
    verifier's input_layernorm weight (see :func:`warm_start_from_verifier`)."""
    gain = tensors["input_layernorm.weight"].float()
    widened = dict(tensors)
    for proj in ("q_proj", "k_proj", "v_proj"):
        weight = tensors[f"self_attn.{proj}.weight"].float()
        widened[f"self_attn.{proj}.weight"] = torch.cat([weight, weight * gain], dim=1) / math.sqrt(2.0)
    return widened


@dataclass
class InitFromReport:
    """What ``train.init_from`` did: which of this draft's tensors came from the source and which start as a
    fresh run's (e.g. P-EAGLE's ``mask_hidden`` when starting from an EAGLE-3 run). Printed once and written to
    ``<run_dir>/init_from.json`` so a run says what it was started from."""

    source: str
    directory: str
    source_type: str  # speculators_model_type of the source
    loaded: list[str]
    new: list[str]  # this draft's tensors the source lacks: initialised as a fresh run initialises them
    ignored: list[str]  # the source's tensors this draft has no place for

    def line(self) -> str:
        return (
            f"train.init_from: loaded {len(self.loaded)} tensors from the {self.source_type} draft {self.directory}; "
            f"new (fresh init): {self.new or 'none'}; ignored from the source: {self.ignored or 'none'}"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def init_from_checkpoint(draft: Eagle3DraftModel, source: Path, vocab: DraftVocab) -> InitFromReport:
    """Start from another run's weights (HASS stage 2, or P-EAGLE from an EAGLE-3 run): a run dir (its best
    checkpoint) or a draft dir of any EAGLE-3-bodied type. Every tensor both drafts have is loaded; the ones only
    this draft has keep the fresh initialisation (the caller seeded it as a fresh run); shapes must agree. The
    first run's draft vocabulary must have been built for this run's tokenizer and size
    (``DraftVocab.check_compatible``)."""
    check_first_stage_vocab(source, vocab)
    directory = runs.resolve_draft_dir(source)
    loaded = algorithms.load_draft(directory)
    mine, theirs = draft.config, loaded.config
    for name in ("hidden_size", "vocab_size", "num_layers", "layer_type"):
        if getattr(mine, name, None) != getattr(theirs, name, None):
            raise ValueError(
                f"train.init_from={source}: its {name} is {getattr(theirs, name, None)}, this recipe builds "
                f"{getattr(mine, name)}; start from a checkpoint trained with the same verifier and model settings"
            )
    if mine.draft_vocab_size != theirs.draft_vocab_size or not torch.equal(draft.d2t, loaded.d2t):
        raise ValueError(
            f"train.init_from={source}: its draft vocabulary differs from this run's (rebuilt from the data's "
            "token counts); use the same data directory and model.draft_vocab_size as the first stage, or keep "
            "the source's vocabulary with train.init_vocab=parent"
        )
    ours, stored = draft.state_dict(), loaded.state_dict()
    shared = sorted(set(ours) & set(stored))
    mine_ids, their_ids = draft_aux_ids(draft), draft_aux_ids(loaded)
    for name in shared:
        if stored[name].shape != ours[name].shape:
            raise ValueError(
                f"train.init_from={source}: {name} in {weights_of(directory)} has shape {list(stored[name].shape)}, "
                f"this run's draft needs {list(ours[name].shape)} (aux layer ids: the source's {their_ids}, this "
                f"run's {mine_ids}); start from a checkpoint trained on the same verifier, aux layers and model "
                "settings, or drop train.init_from"
            )
    if their_ids != mine_ids:
        raise ValueError(
            f"train.init_from={source}: its fc reads aux layers {their_ids}, this run's data holds {mine_ids}; the "
            "columns would mean other layers (an export sorts the ids: start from the run directory instead, or "
            "capture the data with the first stage's verifier.aux_layer_ids)"
        )
    draft.load_state_dict({name: stored[name] for name in shared}, strict=False)
    report = InitFromReport(
        source=str(source),
        directory=str(directory),
        source_type=algorithms.of_config(theirs.to_dict()).name,
        loaded=[n for n in shared if n not in VOCAB_BUFFERS],
        new=sorted(set(ours) - set(stored)),
        ignored=sorted(set(stored) - set(ours)),
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(report.line(), flush=True)
    draft.init_from_report = report  # read by the trainer, which records it in the run directory
    return report


VOCAB_BUFFERS = ("d2t", "t2d")  # checked equal above, not weights


def draft_aux_ids(draft: Any) -> list[int]:
    """The aux-layer ids a draft of any type reads (its type declares the config key)."""
    return algorithms.of_config(draft.config.to_dict()).aux_layer_ids(draft.config)


def weights_of(directory: Path) -> str:
    """The weight file(s) of a draft directory, for error messages."""
    from speculators.format.checkpoint import weight_files

    return ", ".join(str(path) for path in weight_files(directory)) or str(directory)


def check_first_stage_vocab(source: Path, vocab: DraftVocab) -> None:
    """Refuse a first stage whose saved draft vocabulary was built for another tokenizer or size: the same d2t
    over another tokenizer's ids would silently train the draft on the wrong tokens."""
    run_dir = runs.locate_checkpoint(source).run_dir
    saved = run_dir / runs.DRAFT_VOCAB_NAME if run_dir is not None else None
    fingerprint = vocab.provenance.get("tokenizer_fingerprint")
    if saved is None or not saved.is_file() or not fingerprint:
        return  # a bare draft directory, or an online run (its counts carry no tokenizer fingerprint)
    DraftVocab.load(saved).check_compatible(
        fingerprint, vocab.draft_vocab_size, where=f"train.init_from={source}: its draft vocabulary ({saved})"
    )


def parent_draft_vocab(
    source: Path, counts: torch.Tensor, provenance: dict[str, Any], wanted_size: int | None
) -> DraftVocab:
    """``train.init_vocab=parent``: the draft vocabulary of ``train.init_from`` kept as it is, so a draft adapted
    to data of other token counts (served traffic) starts from its parent's weights *and* its parent's d2t.

    Read from the parent run's saved ``draft_vocab.safetensors``, or from an export's ``d2t``/``t2d`` buffers. A
    recipe size other than the parent's (``model.draft_vocab_size``; null takes the parent's) is refused, as is a
    vocabulary built for another tokenizer than this data's (``DraftVocab.check_compatible``). The provenance says
    where it came from and how much of this data's assistant tokens it covers; the parent's own is kept inside."""
    vocab, where = _read_parent_vocab(source)
    size = vocab.draft_vocab_size
    if wanted_size is not None and wanted_size != size:
        raise ValueError(
            f"model.draft_vocab_size={wanted_size} with train.init_vocab=parent: the parent {source} has {size} "
            "draft tokens; set model.draft_vocab_size to that or null"
        )
    fingerprint = provenance.get("tokenizer_fingerprint")
    if fingerprint:
        vocab.check_compatible(
            fingerprint, size, where=f"train.init_vocab=parent: the draft vocabulary of {where}"
        )
    total = counts.double().sum()
    covered = float(counts.double()[vocab.target_ids].sum() / total) if total > 0 else 0.0
    record = {
        **provenance,
        "draft_vocab_size": size,
        "vocab_size": vocab.vocab_size,
        "assistant_token_coverage": covered,  # of this run's data
        "vocab_source": "parent",
        "parent": str(source),
        "parent_vocab": where,
        "parent_provenance": vocab.provenance,
    }
    return DraftVocab(d2t=vocab.d2t.long(), t2d=vocab.t2d.bool(), provenance=record)


def _read_parent_vocab(source: Path) -> tuple[DraftVocab, str]:
    """The parent's vocabulary and where it was read: its run's saved file, else its draft's buffers."""
    run_dir = runs.locate_checkpoint(source).run_dir
    saved = run_dir / runs.DRAFT_VOCAB_NAME if run_dir is not None else None
    if saved is not None and saved.is_file():
        return DraftVocab.load(saved), str(saved)
    directory = runs.resolve_draft_dir(source)
    draft = algorithms.load_draft(directory)
    if getattr(draft, "d2t", None) is None or getattr(draft, "t2d", None) is None:
        raise ValueError(
            f"train.init_vocab=parent: {directory} has no d2t/t2d draft vocabulary; use train.init_vocab=data"
        )
    return DraftVocab(d2t=draft.d2t.clone(), t2d=draft.t2d.clone()), f"{directory} (d2t/t2d)"


# ---- the schedule -------------------------------------------------------------------------------------------
def warmup_steps(settings: TrainSettings, total_steps: int) -> int:
    if settings.schedule.warmup_steps is not None:
        return settings.schedule.warmup_steps
    return int(math.ceil(settings.schedule.warmup_ratio * total_steps))


def lr_at(settings: TrainSettings, step: int, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine/linear decay or constant
    (``schedule.name`` was checked with the settings, so an unknown name never gets this far)."""
    peak = settings.optim.lr
    floor = peak * settings.schedule.min_lr_ratio
    warm = warmup_steps(settings, total_steps)
    if step < warm:
        return peak * (step + 1) / warm
    if settings.schedule.name == "constant":
        return peak
    progress = min(1.0, (step - warm) / max(1, total_steps - warm))
    if settings.schedule.name == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (peak - floor) * (1.0 - progress)  # linear


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


__all__ = [
    "InitFromReport",
    "build_draft",
    "draft_mask_token",
    "calibrate_warm_start",
    "warm_start_from_verifier",
    "scale_fc_by_feature_rms",
    "compute_dtype",
    "compute_precision",
    "deepspeed_config",
    "draft_config",
    "init_from_checkpoint",
    "lr_at",
    "parent_draft_vocab",
    "make_accelerator",
    "make_optimizer",
    "outside_zero3_init",
    "set_lr",
]
