"""The training settings: the recipe's train-side groups read once into typed, frozen dataclasses and checked as a
whole before anything starts (an accelerator, a process group, a data pass).

A typo in ``schedule.name`` or a zero ``train.ttt_steps`` would otherwise surface only where the value is first
used — after warmup, or thousands of steps into a long run. :meth:`TrainSettings.from_config` reports every
problem of a recipe at once, each naming its key and what it accepts.

Groups (see the commented recipes/<group>/*.yaml): ``verifier``, ``model``, ``train``, ``optim``, ``schedule``,
``deepspeed``, ``logging``, ``eval`` and ``export``, shared by every algorithm; beside them the groups
``train.algorithm``'s objective declares (e.g. the block drafters' ``block``), built the same way into
:attr:`TrainSettings.objective` (:class:`AlgorithmRules`), so no algorithm's knob sits in a shared group. ``data``
and ``data_gen`` belong to :mod:`data_gen`; ``data`` is carried as given for online training, which encodes
conversations exactly as data_gen does. A missing key takes its recipe default (so a partial plain dict, as
scripts/gpu_check.py has, builds settings too); an unknown key in a group is an error, and so is a group of another
algorithm. No omegaconf import at module level: a plain dict builds settings without it.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Protocol

from speculators import draft_layer_types

DATA_MODES = (
    "offline",
    "online",
    "stream",
    "cache-first-epoch",
)  # train.data_modes.SOURCES (a test compares)
ATTENTION_BACKENDS = ("auto", "chunked", "flex", "dense")  # train.ttt_attention.BACKENDS (a test compares)
TRAIN_DTYPES = ("auto", "bf16", "bfloat16", "fp32", "float32")
VERIFIER_DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32", "float16", "fp16")
SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "muon")  # train.optimizers.BUILDERS (a test compares)
MUON_LR_ADJUSTMENTS = ("original", "match_rms_adamw")
FC_INITS = ("default", "feature_rms")
WARM_STARTS = ("none", "top_layer")
LOSS_POSITIONS = ("assistant", "all")
INIT_VOCABS = ("data", "parent")  # train.init_vocab: rebuild from this data's counts, or keep the parent's
WANDB_MODES = ("online", "offline", "disabled")
ZERO_STAGES = (0, 1, 2, 3)


class SettingsError(ValueError):
    """Every problem found in a recipe, one per line, each naming its key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            "invalid training settings (fix the recipe or the override):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


# ---- the groups ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VerifierSettings:
    """``verifier``: which model the draft serves (shared with data_gen)."""

    name_or_path: str = "smollm2"
    dtype: str = "auto"
    aux_layer_ids: tuple[int, ...] | None = None

    def problems(self) -> list[str]:
        return one_of("verifier.dtype", self.dtype, VERIFIER_DTYPES)


@dataclass(frozen=True)
class ModelSettings:
    """``model``: the draft architecture (recipes/model/eagle3.yaml)."""

    num_layers: int = 1
    draft_vocab_size: int | None = 32000
    norm_before_residual: bool = True
    layer_type: str | None = None
    fc_init: str = "default"
    init_lm_head_from_verifier: bool = True
    # false: lm_head stays at its initial rows (speculators 0.9.0 freezes it); fewer trained parameters per step
    train_lm_head: bool = True
    warm_start: str = "none"
    # long-context drafts: every draft layer attends over this many positions (null: all); an objective whose
    # layers take no window refuses it (``Objective.sliding_window_layers``)
    sliding_window: int | None = None
    # optional norms (RMSNorm over the concatenated aux states before fc; the normed hidden state carried to the
    # next step). None: what train.algorithm's variant declares, else false
    norm_before_fc: bool | None = None
    norm_output: bool | None = None

    def problems(self) -> list[str]:
        found = at_least("model.num_layers", self.num_layers, 1)
        found += one_of("model.warm_start", self.warm_start, WARM_STARTS)
        found += at_least("model.draft_vocab_size", self.draft_vocab_size, 1)
        found += at_least("model.sliding_window", self.sliding_window, 1)
        found += one_of("model.fc_init", self.fc_init, FC_INITS)
        if not self.train_lm_head and not self.init_lm_head_from_verifier:
            found.append(
                "model.train_lm_head=false with model.init_lm_head_from_verifier=false would freeze a random "
                "lm_head: start it from the verifier's rows (init_lm_head_from_verifier=true) or train it"
            )
        if self.layer_type is not None:
            found += one_of("model.layer_type", self.layer_type, draft_layer_types.names())
        return found


@dataclass(frozen=True)
class StreamSettings:
    """``train.stream``: the spool of ``data_mode`` stream / cache-first-epoch (train/streaming.py,
    docs/streaming.md). Null directories sit under the run dir."""

    spool_dir: str | None = None
    cache_dir: str | None = None
    max_spool_gb: float = 20.0
    chunk_steps: int = 8
    local_producers: int = 1
    producer_threads: int | None = None
    producer_device: str = "auto"
    producer_timeout_s: float = 120.0
    max_restarts: int = 5

    def problems(self) -> list[str]:
        found = at_least("train.stream.chunk_steps", self.chunk_steps, 1)
        found += at_least("train.stream.local_producers", self.local_producers, 0)
        found += at_least("train.stream.producer_threads", self.producer_threads, 1)
        found += at_least("train.stream.max_restarts", self.max_restarts, 0)
        if not self.max_spool_gb > 0 or not self.producer_timeout_s > 0:
            found.append("train.stream.max_spool_gb and train.stream.producer_timeout_s must be > 0")
        return found


@dataclass(frozen=True)
class ReplaySettings:
    """``train.replay``: a share of another data directory's training split (the serving draft's original data)
    mixed into this run's, so an adapted draft does not forget it (train/features.py, issue 41)."""

    data_dir: str | None = None
    share: float = 0.0  # of the training samples, in [0, 1)

    def problems(self, data_mode: str) -> list[str]:
        found = []
        if not 0.0 <= self.share < 1.0:
            found.append(
                f"train.replay.share={self.share}: must be in [0, 1) (the replayed share of the samples)"
            )
        if self.share > 0 and not self.data_dir:
            found.append(
                f"train.replay.share={self.share} without train.replay.data_dir: name the data to replay"
            )
        if self.data_dir and data_mode != "offline":
            found.append(
                f"train.replay.data_dir with train.data_mode={data_mode}: replay mixes offline feature shards, use "
                "train.data_mode=offline or set train.replay.data_dir=null"
            )
        return found


@dataclass(frozen=True)
class LoopSettings:
    """``train``: the algorithm and the loop (recipes/train/eagle3.yaml)."""

    algorithm: str = "eagle3"
    data_mode: str = "offline"
    data_dir: str | None = None
    ttt_steps: int = 3
    step_weight_decay: float = 0.8
    mask_out_of_vocab: bool = True
    noise_std: float = 0.0
    epochs: int = 10
    max_steps: int | None = None
    max_samples: int | None = None
    micro_batch_size: int = 4
    grad_accum: int = 1
    max_length: int = 2048
    packing: bool = True
    shuffle: bool = True
    num_workers: int = 0
    eval_every: int = 0
    save_every: int = 0
    keep_checkpoints: int = 2
    dtype: str = "auto"
    attention_backend: str = "auto"
    attention_chunk: int = 256
    cpu_threads: int | None = None
    resume: str = "auto"
    dry_run: bool = False
    init_from: str | None = None
    init_vocab: str = "data"  # data: built from this data's token counts | parent: train.init_from's, kept
    replay: ReplaySettings = field(default_factory=ReplaySettings)
    loss_positions: str = "assistant"  # training step only: validation stays on assistant text
    max_cpu_seconds: float | None = None  # a CPU budget: the run (and its schedule) shortened to fit it
    # after the fit, hold the budget when the CPU per step rises (re-fit shorter, stop once spent); false: the
    # fitted length stands whatever the machine does, so a resumed run is step-for-step the uninterrupted one
    cpu_budget_hold: bool = True
    stream: StreamSettings = field(default_factory=StreamSettings)

    def problems(self) -> list[str]:
        """The loop's own checks; ``train.algorithm`` is checked by the objectives (:class:`AlgorithmRules`)."""
        found = one_of("train.data_mode", self.data_mode, DATA_MODES)
        found += one_of("train.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        found += one_of("train.loss_positions", self.loss_positions, LOSS_POSITIONS)
        found += one_of("train.init_vocab", self.init_vocab, INIT_VOCABS)
        if self.init_vocab == "parent" and not self.init_from:
            found.append(
                "train.init_vocab=parent needs train.init_from (the parent whose draft vocabulary is kept); set it "
                "or use train.init_vocab=data"
            )
        found += self.replay.problems(self.data_mode)
        if self.dtype in ("fp16", "float16"):
            found.append(
                f"train.dtype={self.dtype!r}: use auto, bf16 or fp32 (fp16 needs loss scaling, not supported)"
            )
        else:
            found += one_of("train.dtype", self.dtype, TRAIN_DTYPES)
        for key in ("ttt_steps", "epochs", "micro_batch_size", "grad_accum", "attention_chunk"):
            found += at_least(f"train.{key}", getattr(self, key), 1)
        for key in ("max_steps", "max_samples", "cpu_threads", "max_cpu_seconds"):
            found += at_least(f"train.{key}", getattr(self, key), 1)  # or null
        for key in ("num_workers", "eval_every", "save_every", "keep_checkpoints", "noise_std"):
            found += at_least(f"train.{key}", getattr(self, key), 0)
        found += at_least("train.max_length", self.max_length, 2)
        if not self.step_weight_decay > 0:
            found.append(
                f"train.step_weight_decay={self.step_weight_decay}: must be > 0 (step j weighs decay^j)"
            )
        if not self.resume:
            found.append("train.resume is empty: use auto, never or a checkpoint directory")
        return found + self.stream.problems()


@dataclass(frozen=True)
class MuonSettings:
    """``optim.muon``: torch Muon's settings for the 2-D hidden matrices under ``optim.name=muon``
    (recipes/optim/muon.yaml); speculators 0.9.0's defaults. Its lr is ``optim.lr``: ``match_rms_adamw`` scales
    Muon's update to AdamW's RMS, so one schedule serves both halves."""

    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.1
    ns_steps: int = 5
    adjust_lr_fn: str = "match_rms_adamw"

    def problems(self) -> list[str]:
        found = one_of("optim.muon.adjust_lr_fn", self.adjust_lr_fn, MUON_LR_ADJUSTMENTS)
        if not 0.0 <= self.momentum < 1.0:
            found.append(f"optim.muon.momentum={self.momentum}: must be in [0, 1)")
        return (
            found
            + at_least("optim.muon.weight_decay", self.weight_decay, 0)
            + at_least("optim.muon.ns_steps", self.ns_steps, 1)
        )


@dataclass(frozen=True)
class OptimSettings:
    """``optim``: torch AdamW, or Muon on the 2-D hidden matrices with AdamW on the rest (recipes/optim/*.yaml;
    train/optimizers.py builds them)."""

    name: str = "adamw"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = 0.5
    # torch's fused AdamW kernel (the same update rule, one kernel over every tensor): null uses it where the
    # parameters' device has one (CPU and CUDA), false keeps the per-tensor loop torch picks on a CPU by default
    fused: bool | None = None
    muon: MuonSettings = field(default_factory=MuonSettings)

    @property
    def clip_norm(self) -> float:
        """The max global grad norm; 0 (or null in the recipe) turns clipping off."""
        return self.grad_clip or 0.0

    def problems(self) -> list[str]:
        found = one_of("optim.name", self.name, OPTIMIZERS)
        if not self.lr > 0:
            found.append(f"optim.lr={self.lr}: must be > 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            found.append(f"optim.betas={list(self.betas)}: both must be in [0, 1)")
        if not self.eps > 0:
            found.append(f"optim.eps={self.eps}: must be > 0")
        return (
            found
            + at_least("optim.weight_decay", self.weight_decay, 0)
            + at_least("optim.grad_clip", self.grad_clip, 0)
            + self.muon.problems()
        )


@dataclass(frozen=True)
class ScheduleSettings:
    """``schedule``: linear warmup, then cosine / linear decay or constant (recipes/schedule/*.yaml)."""

    name: str = "cosine"
    warmup_steps: int | None = None
    warmup_ratio: float = 0.015
    min_lr_ratio: float = 0.0

    def problems(self) -> list[str]:
        found = one_of("schedule.name", self.name, SCHEDULES) + at_least(
            "schedule.warmup_steps", self.warmup_steps, 0
        )
        for key in ("warmup_ratio", "min_lr_ratio"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                found.append(f"schedule.{key}={getattr(self, key)}: must be in [0, 1]")
        return found


@dataclass(frozen=True)
class DeepSpeedSettings:
    """``deepspeed``: off, or the ZeRO config the trainer completes (recipes/deepspeed/*.yaml)."""

    enabled: bool = False
    build_cpu_shm_op: bool = False
    config: dict[str, Any] | None = None

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in force (0 without DeepSpeed)."""
        if not self.enabled:
            return 0
        return int(((self.config or {}).get("zero_optimization") or {}).get("stage", 0))

    def problems(self) -> list[str]:
        if not self.enabled:
            return []
        zero = (self.config or {}).get("zero_optimization")
        if not isinstance(zero, Mapping) or zero.get("stage") not in ZERO_STAGES:
            return [
                "deepspeed.config.zero_optimization.stage: DeepSpeed is enabled but the stage is missing or not one "
                f"of {ZERO_STAGES}; pick deepspeed=zero1|zero2|zero3|zero3_offload or deepspeed=none"
            ]
        return []


@dataclass(frozen=True)
class WandbSettings:
    mode: str = "offline"
    project: str = "speculators-train"
    entity: str | None = None
    name: str | None = None
    tags: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        return one_of("logging.wandb.mode", self.mode, WANDB_MODES)


@dataclass(frozen=True)
class LoggingSettings:
    """``logging``: console / metrics.jsonl cadence and Weights & Biases (recipes/logging/*.yaml)."""

    log_every: int = 10
    progress_bar: bool = True
    wandb: WandbSettings = field(default_factory=WandbSettings)

    def problems(self) -> list[str]:
        return at_least("logging.log_every", self.log_every, 0) + self.wandb.problems()


@dataclass(frozen=True)
class EvalSettings:
    """``eval``: held-out validation (``k`` null: ``train.ttt_steps``; ``max_samples`` null: all)."""

    k: int | None = None
    max_samples: int | None = 256

    def problems(self) -> list[str]:
        return at_least("eval.k", self.k, 1) + at_least("eval.max_samples", self.max_samples, 1)


@dataclass(frozen=True)
class ExportSettings:
    speculative_tokens: int = 3

    def problems(self) -> list[str]:
        return at_least("export.speculative_tokens", self.speculative_tokens, 1)


# ---- the whole ----------------------------------------------------------------------------------------------
class AlgorithmRules(Protocol):
    """What only the algorithm's training objective can say about a recipe. :mod:`train.objectives` implements it
    (``train.objectives.train_settings``), so this module names no algorithm and imports no objective (issue 30)."""

    def groups(self, algorithm: str) -> Mapping[str, type] | None:
        """The recipe groups ``algorithm``'s objective reads beside the shared ones: top-level key → the frozen
        dataclass it builds; None for an unknown algorithm (:meth:`problems` reports it)."""
        ...

    def readers(self) -> Mapping[str, tuple[str, ...]]:
        """Every objective group's key → the algorithms that read it (a group the chosen one does not read is an
        error, not silently ignored)."""
        ...

    def resolved(self, settings: TrainSettings) -> TrainSettings:
        """``settings`` with the defaults the algorithm decides filled in (``eval.k``: its drafted positions)."""
        ...

    def problems(self, settings: TrainSettings) -> list[str]:
        """A known ``train.algorithm``, and the combinations its objective cannot train."""
        ...


class ObjectiveGroup(Protocol):
    """A settings group an objective declares (a frozen dataclass): it checks its own values, each problem naming
    the full key under ``prefix`` (the group's top-level recipe key)."""

    def problems(self, prefix: str) -> list[str]: ...


GROUPS = {
    "verifier": VerifierSettings,
    "model": ModelSettings,
    "train": LoopSettings,
    "optim": OptimSettings,
    "schedule": ScheduleSettings,
    "deepspeed": DeepSpeedSettings,
    "logging": LoggingSettings,
    "eval": EvalSettings,
    "export": ExportSettings,
}


@dataclass(frozen=True)
class TrainSettings:
    """Everything the trainer, the memory plan and the GPU check read, typed and validated."""

    recipe_name: str | None = None
    seed: int = 0
    verifier: VerifierSettings = field(default_factory=VerifierSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    train: LoopSettings = field(default_factory=LoopSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    export: ExportSettings = field(default_factory=ExportSettings)
    # the groups train.algorithm's objective declares (train.objectives), by recipe key: e.g. ``block`` for the
    # block drafters; read through :meth:`group`
    objective: dict[str, ObjectiveGroup] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # data_gen's, as given
    resolved: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the whole recipe

    @classmethod
    def from_config(cls, config: Any, algorithm: AlgorithmRules) -> TrainSettings:
        """Settings of a composed recipe (an omegaconf ``DictConfig``, resolved here, or a plain dict), checked with
        the ``algorithm`` rules of the objectives (callers use ``train.objectives.train_settings``).

        Raises :class:`SettingsError` listing every problem: wrong types, out-of-range values, unknown keys and
        combinations the trainer cannot run. Settings already built are returned as they are."""
        if isinstance(config, cls):
            return config
        resolved = _plain(config)
        problems: list[str] = []
        values: dict[str, Any] = {}
        for name in ("recipe_name", "seed"):
            if resolved.get(name) is not None:
                values[name] = _field_value(cls, name, resolved[name], name, problems)
        for name, group in GROUPS.items():
            values[name] = _build(group, resolved.get(name), name, problems)
        values["objective"] = _objective_groups(resolved, values["train"].algorithm, algorithm, problems)
        if problems:  # a group that failed to build cannot be checked further
            raise SettingsError(problems)
        settings = cls(**values, data=dict(resolved.get("data") or {}), resolved=resolved)
        settings = algorithm.resolved(settings)
        problems = algorithm.problems(settings)
        problems += [p for group in GROUPS for p in getattr(settings, group).problems()]
        problems += [p for key, group in settings.objective.items() for p in group.problems(key)]
        problems += settings.combination_problems()
        if problems:
            raise SettingsError(problems)
        return settings

    def group(self, key: str) -> Any:
        """The objective group ``key`` (e.g. ``block``) of this recipe; a KeyError naming the groups
        ``train.algorithm`` reads when it reads no such group (a bug of the caller, not of the recipe)."""
        if key not in self.objective:
            raise KeyError(
                f"train.algorithm={self.train.algorithm} reads no {key!r} group (it reads {sorted(self.objective)})"
            )
        return self.objective[key]

    def combination_problems(self) -> list[str]:
        """Values each fine alone that the trainer cannot run together (the algorithm's own: its objective's)."""
        found = []
        if self.optim.name == "muon" and self.deepspeed.enabled:
            found.append(
                "optim=muon with DeepSpeed: ZeRO steps a client optimizer on flattened 1-D partitions, and Muon "
                "orthogonalizes 2-D matrices; train Muon with deepspeed=none (one process or DDP), or use optim=adamw "
                "under DeepSpeed"
            )
        return found


# ---- building ----------------------------------------------------------------------------------------------
def _objective_groups(
    resolved: Mapping[str, Any], algorithm: str, rules: AlgorithmRules, problems: list[str]
) -> dict[str, Any]:
    """The groups ``algorithm``'s objective declares, built from the recipe (defaults for a missing one), and a
    problem for each group of the recipe that another algorithm reads but this one does not."""
    declared = rules.groups(algorithm)
    if declared is None:  # an unknown train.algorithm: reported with the algorithm's problems
        return {}
    for key, readers in sorted(rules.readers().items()):
        given = resolved.get(key)
        if key not in declared and given is not None:
            names = ", ".join(f"{key}.{name}" for name in given) if isinstance(given, Mapping) else key
            problems.append(
                f"{key}: train.algorithm={algorithm} does not read the {key} group, so {names} would be ignored "
                f"(read by {', '.join(readers)}); remove {key} from the recipe or train one of those algorithms"
            )
    return {key: _build(group, resolved.get(key), key, problems) for key, group in declared.items()}


def _plain(config: Any) -> dict[str, Any]:
    """A plain, resolved dict of ``config``; omegaconf is imported only for its own containers."""
    if isinstance(config, dict):
        return config
    from omegaconf import OmegaConf

    return OmegaConf.to_container(config, resolve=True)


def _build(cls: type, mapping: Any, prefix: str, problems: list[str]) -> Any:
    """An instance of the dataclass ``cls`` from ``mapping`` (defaults for missing keys), noting problems."""
    if mapping is None:
        return cls()
    if not isinstance(mapping, Mapping):
        problems.append(f"{prefix}={mapping!r}: expected a mapping of {sorted(f.name for f in fields(cls))}")
        return cls()
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        problems.append(f"{prefix}: unknown key(s) {unknown}; known: {known}")
    values = {
        name: _field_value(cls, name, mapping[name], f"{prefix}.{name}", problems)
        for name in known
        if name in mapping
    }
    return cls(**values)


def _field_value(cls: type, name: str, value: Any, key: str, problems: list[str]) -> Any:
    kind = typing.get_type_hints(cls)[name]
    if isinstance(kind, type) and is_dataclass(kind):
        return _build(kind, value, key, problems)
    try:
        return _coerce(value, kind)
    except (TypeError, ValueError):
        problems.append(f"{key}={value!r}: expected {_describe(kind)}")
        return getattr(cls(), name)


def _coerce(value: Any, kind: Any) -> Any:
    """``value`` as ``kind`` (int, float, bool, str, tuples, dicts and ``X | None``), or TypeError/ValueError."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError(value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0]) for v in value)
        if len(value) != len(args):
            raise ValueError(value)
        return tuple(_coerce(v, a) for v, a in zip(value, args, strict=True))
    if origin is dict or kind is dict:
        if not isinstance(value, Mapping):
            raise TypeError(value)
        return dict(value)
    return _scalar(value, kind)


def _scalar(value: Any, kind: type) -> Any:
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError(value)
        return value
    if isinstance(value, bool) or value is None:
        raise TypeError(value)  # true is not 1, and null is not a number
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(value)
    if kind is float:
        return float(value)  # also "5e-5", which YAML 1.1 reads as a string
    if kind is str:
        if not isinstance(value, (str, int, float)):
            raise TypeError(value)
        return str(value)
    raise TypeError(kind)


def _describe(kind: Any) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is tuple:
        return "a list of " + (_describe(args[0]) if args[-1] is Ellipsis else f"{len(args)} numbers")
    if origin is dict or kind is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))


def one_of(key: str, value: Any, allowed: tuple[Any, ...]) -> list[str]:
    return [] if value in allowed else [f"{key}={value!r}: use one of {', '.join(map(str, allowed))}"]


def at_least(key: str, value: float | None, low: float) -> list[str]:
    """``value`` (null passes: the key's documented default) must be at least ``low``."""
    return [] if value is None or value >= low else [f"{key}={value}: must be at least {low}"]


__all__ = [
    "AlgorithmRules",
    "ObjectiveGroup",
    "DeepSpeedSettings",
    "EvalSettings",
    "ExportSettings",
    "LoggingSettings",
    "LoopSettings",
    "ModelSettings",
    "MuonSettings",
    "OptimSettings",
    "ReplaySettings",
    "ScheduleSettings",
    "SettingsError",
    "StreamSettings",
    "TrainSettings",
    "VerifierSettings",
    "WandbSettings",
    "at_least",
    "one_of",
]
