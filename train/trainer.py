"""The training loop: EAGLE-3 / HASS drafts with training-time test, under accelerate (single process, DDP or
DeepSpeed ZeRO-1/2/3).

One optimizer step = one global batch (``train.micro_batch_size × train.grad_accum × processes`` samples):

1. the step's micro batches are fetched (features from shards, or captured by the verifier online) and their
   targets prepared: the verifier's argmax over its full vocabulary and the per-step masks;
2. the number of trained positions per TTT step is summed over the whole global batch (all ranks), so every
   micro-batch loss is ``Σ_j w_j · (CE_j + topk_w · TopK_j) / N_j`` scaled by ``world × grad_accum`` (which the
   framework's gradient averaging undoes): the same loss on 1 or N processes;
3. forward (the k-step unroll), backward, and — on the last micro batch — clip and step (DeepSpeed steps inside
   ``backward``).

Evaluation, checkpointing (see :mod:`train.checkpointing`) and logging happen between steps, on every rank
where they are collective, written by the main process only.

What a run was made of beyond its recipe is written beside it: the draft vocabulary (with its provenance: built from
the data's counts, or kept from ``train.init_from`` with ``train.init_vocab=parent``), ``init_from.json`` and
``data_sources.json`` (the vocabulary's source, the replayed data of ``train.replay``, whether the data carried
per-token loss weights).
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from data_gen.batch_plan import BatchPlan
from speculators import families, runs
from speculators.atomic import atomic_write_json
from speculators.verifier import verifier_config_dict
from speculators.vocab import DraftVocab, build_draft_vocab
from train import checkpointing as ckpt
from train.assemble import (
    compute_precision,
    lr_at,
    make_accelerator,
    make_optimizer,
    outside_zero3_init,
    parent_draft_vocab,
    set_lr,
)
from train.data import row_buckets, run_loader, training_loss_mask
from train.data_modes import open_features
from train.evaluation import evaluate
from train.features import RowLayout
from train.logs import RunLogger, console_line, eval_line
from train.objectives import objective_for, train_settings
from train.resume_guard import check_same_run, resume_source
from train.settings import TrainSettings
from train.step_stats import StepStats
from train.ttt_attention import flex_shape_variants, limit_flex_recompiles

# <run_dir>/data_sources.json: the draft vocabulary's source, train.replay, loss weights (Trainer._data_sources)
DATA_SOURCES_NAME = "data_sources.json"
CPU_BUDGET_PROBE_STEPS = 10  # steps measured before a CPU budget fixes the run's length
# after the fit, the CPU per step is measured over this many windows of the rest of the run, and the run is re-fitted
# when a window's CPU per step projects this far over the budget: a busier machine (a 300 CPU-s budget once spent
# 503) is caught within a window, a wobble of a few percent changes nothing. The run stops once the budget is spent.
CPU_BUDGET_CHECKS = 20
CPU_BUDGET_TOLERANCE = 0.05


@dataclass
class Progress:
    """What a checkpoint's ``trainer_state.json`` holds besides the step's metrics."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    world_size: int = 1
    global_batch: int = 0
    best: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    # train.max_cpu_seconds: the steps the budget was fitted to (0: not yet) and the training loop's CPU-seconds
    # spent up to this checkpoint, so a resumed budgeted run keeps its schedule and spends only what is left
    budget_steps: int = 0
    budget_cpu_s: float = 0.0


class Trainer:
    def __init__(self, config: TrainSettings | Any, run_dir: str | Path) -> None:
        """``config``: the settings, or a composed recipe (checked here, before the accelerator starts)."""
        settings = train_settings(config)
        self.settings, self.run_dir = settings, Path(run_dir)
        train = settings.train
        # a resume is the same run or refused here, before any set-up or write (train.resume_guard)
        self.resume_from = resume_source(settings, self.run_dir)
        resume_note = check_same_run(settings, self.run_dir, self.resume_from)
        self.objective = objective_for(settings)
        self.steps = self.objective.steps
        self.weights = self.objective.weights
        self.precision = compute_precision(train.dtype)  # recorded in <run_dir>/precision.json
        self.dtype = self.precision.dtype
        logging.getLogger("accelerate").setLevel(logging.WARNING)  # our own lines say what was saved
        if train.cpu_threads and not torch.cuda.is_available():
            torch.set_num_threads(train.cpu_threads)  # small CPU ops drown in thread sync on a busy host
        self.accelerator = make_accelerator(settings, self.dtype)
        self.device = self.accelerator.device
        self.is_main = self.accelerator.is_main_process
        self.world = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        if resume_note and self.is_main:
            print(resume_note, flush=True)
        self.verifier_name = settings.verifier.name_or_path
        self._positions_checked = False
        self.verifier_config = verifier_config_dict(self.verifier_name)
        serving = families.vllm_serving_note(self.verifier_config)
        if serving and self.is_main:
            print(serving, flush=True)
        self._prepare_data()
        self._prepare_model()

    # ---- set-up -----------------------------------------------------------------------------------------
    def _prepare_data(self) -> None:
        settings, train = self.settings, self.settings.train
        layout = RowLayout.of(train, self.device)
        if layout.fixed_width:  # compiled flex: a fixed set of shapes, and recompiling past it is an error
            limit_flex_recompiles(flex_shape_variants(len(row_buckets(layout.max_rows))))
        self.features = open_features(settings, self.accelerator, layout, self.verifier_config)
        self.loss_weights = self._check_loss_weights()
        self.vocab = self._draft_vocab()
        self.plan = BatchPlan(  # the combined size with train.replay
            len(self.features.train_set),
            train.micro_batch_size,
            train.grad_accum,
            self.world,
            settings.seed,
            train.shuffle,
        )
        self.total_steps = train.epochs * self.plan.steps_per_epoch
        if train.max_steps:
            self.total_steps = min(self.total_steps, train.max_steps)
        self._require_heldout()

    def _draft_vocab(self) -> DraftVocab:
        """``train.init_vocab``: the vocabulary built from this data's token counts (``data``), or the one of
        ``train.init_from`` kept as it is (``parent``: the counts of traffic differ from the parent's data, and
        a rebuilt d2t would not fit the parent's lm_head)."""
        settings, features = self.settings, self.features
        size = settings.model.draft_vocab_size
        if settings.train.init_vocab == "parent":
            source = Path(settings.train.init_from)
            return parent_draft_vocab(source, features.counts, features.provenance, size)
        vocab_size = int(self.verifier_config["vocab_size"])
        return build_draft_vocab(features.counts, size or vocab_size, features.provenance)

    def _check_loss_weights(self) -> bool:
        """Whether the training data's per-token loss weights are applied. Weighted data is refused for an
        objective that would ignore the weights silently (the block drafters, MTP)."""
        if not self.features.carries_loss_weights():
            return False
        algorithm = self.settings.train.algorithm
        if not self.objective.uses_loss_weights:
            raise ValueError(
                f"{self.settings.train.data_dir} carries per-token loss weights (loss_weight) but "
                f"train.algorithm={algorithm} cannot use them: they are for the EAGLE-3 family (eagle3, eagle31, "
                "hass, peagle); train one of those, or regenerate the data without loss weights"
            )
        if self.is_main:
            print(
                f"per-token loss weights: the data's loss_weight weighs {algorithm}'s training loss",
                flush=True,
            )
        return True

    def _data_sources(self) -> dict[str, Any]:
        """What this run trained on beyond its recipe's names (``data_sources.json``)."""
        replay = self.features.replay
        provenance = self.vocab.provenance
        return {
            "draft_vocab": {
                "source": provenance.get("vocab_source", "data"),
                "parent": provenance.get("parent"),
                "file": provenance.get("parent_vocab"),
                "draft_vocab_size": self.vocab.draft_vocab_size,
                "assistant_token_coverage": provenance.get("assistant_token_coverage"),
            },
            "train_samples": len(self.features.train_set),
            "replay": replay.to_json() if replay is not None else None,
            "loss_weights": self.loss_weights,
        }

    def _require_heldout(self) -> None:
        """Without held-out data a run never evaluates and writes no ``checkpoints/best.json`` (export then takes
        the last checkpoint, not the best). Offline features with no ``heldout/`` split at all are refused unless
        the recipe holds out nothing on purpose (``data.heldout_fraction=0``); a split that came out empty (too few
        conversations for the fraction) is said."""
        heldout = self.features.heldout_set
        if heldout is not None and len(heldout) > 0:
            return
        train, fraction = self.settings.train, self.settings.data.get("heldout_fraction")
        if train.data_mode == "offline" and heldout is None and fraction != 0:
            raise ValueError(
                f"{train.data_dir}/heldout is missing: this run would never evaluate nor write "
                "checkpoints/best.json; regenerate the features with a held-out split (data_gen/run.py with "
                "data.heldout_fraction > 0, e.g. 0.02), or train without evaluation on purpose with "
                "data.heldout_fraction=0"
            )
        why = "" if fraction == 0 else " held out no conversation of this data"
        if self.is_main:
            print(
                f"no held-out data (data.heldout_fraction={fraction}{why}): this run does not evaluate and "
                "writes no checkpoints/best.json",
                flush=True,
            )

    def _check_head(self, head: Any) -> None:
        """Before any step: the head must reproduce the verifier's own logits on the positions its feature source
        recorded (speculators.head_check), else the run stops here with one line instead of training a wrong
        draft. Data generated before probes were recorded is said, not refused."""
        probe, where = self.features.head_probe()
        if probe is None:
            if self.is_main:
                print(f"head check skipped: {where}", flush=True)
            return
        agreement = head.check(probe, self.verifier_name, where)
        if self.is_main:
            print(
                f"head check: the training head reproduces the verifier's logits ({agreement.line()})",
                flush=True,
            )

    def _prepare_model(self) -> None:
        settings, train = self.settings, self.settings.train
        with outside_zero3_init(
            self.accelerator
        ):  # frozen and whole on every rank (its norm is built by transformers)
            head = self.features.target_head(self.vocab.target_ids)
        self._check_head(head)
        head_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.head = head.to(self.device, dtype=head_dtype)
        # a resumed run loads its weights from the checkpoint: data-dependent initialisation would be wasted
        fresh = not train.init_from and self.resume_from is None
        self.draft_config, model = self.objective.build(
            self.verifier_config, self.features, self.vocab, self.head, fresh
        )
        # train.init_from: which tensors came from the source and which start fresh (recorded in _start)
        self.init_from_report = next(
            (m.init_from_report for m in model.modules() if hasattr(m, "init_from_report")), None
        )
        optimizer = make_optimizer(settings.optim, model)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.is_deepspeed = self.accelerator.distributed_type.value == "DEEPSPEED"

    # ---- one optimizer step -----------------------------------------------------------------------------
    def _train_step(self, window: list[Any], stats: StepStats, step: int) -> None:
        plans = []
        positions = StepStats(self.steps, self.device)
        for micro, item in enumerate(window):
            batch = self.features.batch(item)
            # train.loss_positions applies to the training step only: validation stays on assistant text
            loss_mask = training_loss_mask(batch, self.settings.train.loss_positions)
            seed = ((self.settings.seed * 1_000_003 + step) * 4099 + self.rank) * 257 + micro  # resume-exact
            plan = self.objective.plan(batch, loss_mask, self.head, seed)
            positions.add_positions(plan.masks)
            plans.append((batch, plan))
        counted = positions.all_reduce(self.accelerator)
        if not self._positions_checked:  # the first step of this attempt, before it trains
            self._require_positions(counted, step)
            self._positions_checked = True
        trained = counted.trained.clamp_min(1.0)
        scale = float(self.world * self.plan.grad_accum)
        for batch, plan in plans:
            with self.accelerator.accumulate(self.model):
                loss = self.objective.loss(self.model, batch, plan, self.head, trained, stats)
                stats.add_positions(plan.masks)
                stats.add_batch(batch.num_tokens, batch.num_documents)
                self.accelerator.backward(loss * scale)
                clip = self.settings.optim.clip_norm
                if self.accelerator.sync_gradients and clip > 0 and not self.is_deepspeed:
                    self.accelerator.clip_grad_norm_(self.model.parameters(), clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)

    def _require_positions(self, counted: StepStats, step: int) -> None:
        """Before the first step of an attempt: a global batch with no trained position at any step means the run
        has nothing to learn (its loss is 0 and nothing moves), so it stops here naming the likely cause."""
        if float(counted.trained.sum()) > 0:
            return
        train, vocab = self.settings.train, self.vocab.draft_vocab_size
        if float(counted.valid.sum()) == 0:
            cause = (
                "none of its positions is a target: the loss mask holds no token "
                f"(train.loss_positions={train.loss_positions}: assistant tokens only; all: every token) or the "
                f"rows are too short (train.max_length={train.max_length}); check the data"
            )
        else:
            cause = (
                f"the verifier's next token at every one of its {float(counted.valid.sum()):.0f} target "
                f"positions lies outside the draft vocabulary (model.draft_vocab_size={vocab}: the most frequent "
                "tokens of the data's token counts); "
                "raise model.draft_vocab_size (null: the verifier's whole vocabulary), regenerate the data with the "
                "verifier's own answers (data_gen.regenerate.enabled=true) or set train.mask_out_of_vocab=false"
            )
        raise ValueError(
            f"nothing to learn: the first global batch of this attempt (step {step + 1}) has no trained position; "
            + cause
        )

    # ---- the loop ---------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        settings = self.settings
        progress = self._start()
        if settings.train.max_cpu_seconds and progress.budget_steps:
            self.total_steps = progress.budget_steps  # resumed: the schedule the budget was fitted to
        self.logger = RunLogger(settings, self.run_dir, self.is_main, self.total_steps, progress.step)
        self._announce(progress)
        per_epoch = self.plan.steps_per_epoch
        eval_every, save_every = settings.train.eval_every, settings.train.save_every
        features = self.features
        features.begin(self.plan, progress.step, self.total_steps)
        loader = run_loader(
            features.train_set,
            self.plan,
            self.rank,
            progress.step,
            self.total_steps,
            features.collate,
            settings.train.num_workers,
        )
        stream = iter(loader)
        self._window = {"stats": StepStats(self.steps, self.device), "seconds": 0.0, "since": progress.step}
        self._run_start = (time.time(), progress.step)
        self._cpu_start = time.process_time()
        self._cpu_before = progress.budget_cpu_s  # the budgeted CPU spent before a resume counts
        budget_fixed = not settings.train.max_cpu_seconds or progress.budget_steps > 0
        self._budget_checks_from(progress, 0.0)
        self._last_eval_step = self._last_save_step = progress.step if progress.step else -1
        while progress.step < self.total_steps:
            lr = lr_at(settings, progress.step, self.total_steps)
            set_lr(self.optimizer, lr)
            window = [next(stream) for _ in range(self.plan.grad_accum)]
            started = time.time()
            self._train_step(window, self._window["stats"], progress.step)
            self._window["seconds"] += time.time() - started
            progress.step += 1
            progress.epoch, progress.step_in_epoch = divmod(progress.step, per_epoch)
            if not budget_fixed and progress.step - self._run_start[1] >= CPU_BUDGET_PROBE_STEPS:
                budget_fixed = self._fit_cpu_budget(progress)
            elif budget_fixed:
                self._hold_cpu_budget(progress)
            progress.samples_seen += self.plan.global_batch
            last = progress.step == self.total_steps
            epoch_end = progress.step_in_epoch == 0
            log_every = settings.logging.log_every
            if (log_every and progress.step % log_every == 0) or last:
                self._log_train(progress, lr)
            improved = False
            if self._due(eval_every, progress.step, epoch_end) or last:
                improved = self._evaluate(progress)
            if improved or self._due(save_every, progress.step, epoch_end) or last:
                self._save(progress, improved)
        del stream, loader
        self.logger.close()
        return {"step": progress.step, "best": progress.best, "metrics": progress.metrics}

    def _fit_cpu_budget(self, progress: Progress) -> bool:
        """``train.max_cpu_seconds``: after a few steps, shorten the run (and its lr schedule) to the steps that fit
        the budget at the measured CPU-seconds per step (the slowest rank's), so runs of different algorithms can
        be compared at equal training CPU. The fitted step count and the CPU spent are checkpointed, so a resumed
        run keeps its schedule (exact resume) and spends only what is left of the budget."""
        this_attempt = time.process_time() - self._cpu_start
        per_step = torch.tensor(
            [this_attempt / max(progress.step - self._run_start[1], 1)], device=self.device
        )
        per_step = float(self.accelerator.gather(per_step).max())
        note, resumed_at = "", self._run_start[1]
        # a checkpoint that recorded no CPU (written before it was recorded): its steps at today's CPU per step
        if not self._cpu_before and resumed_at:
            self._cpu_before = resumed_at * per_step
            note = f", {self._cpu_before:.0f} CPU-s estimated for the {resumed_at} steps before the resume"
        remaining = max(self.settings.train.max_cpu_seconds - self._cpu_before - this_attempt, 0.0)
        fitted = max(
            progress.step, min(self.total_steps, progress.step + int(remaining / max(per_step, 1e-9)))
        )
        if self.is_main:
            print(
                f"cpu budget {self.settings.train.max_cpu_seconds:.0f} CPU-s at {per_step:.2f} CPU-s/step: "
                f"{fitted} steps (planned {self.total_steps}){note}",
                flush=True,
            )
        self.total_steps = progress.budget_steps = fitted
        self._budget_checks_from(progress, this_attempt)
        return True

    def _budget_checks_from(self, progress: Progress, cpu_so_far: float) -> None:
        """Measure the CPU per step over windows of the steps left / ``CPU_BUDGET_CHECKS``, from here
        (``cpu_so_far``: this attempt's CPU now). Nothing is checked without a budget or before it is fitted.

        A window is never shorter than the run's eval and save intervals (those that fall within the steps left):
        a shorter one that holds an evaluation reads its CPU as every step's. That is what cut the bench's EAGLE-3
        lane from 737 to 614 steps (1.18 CPU-s per step read in the window holding step 100's evaluation and
        checkpoint, 0.95 outside it) and left 100 of its 700 CPU-s unspent."""
        train = self.settings.train
        fitted = bool(train.max_cpu_seconds and train.cpu_budget_hold and progress.budget_steps)
        left = self.total_steps - progress.step
        cadence = [every for every in (train.eval_every, train.save_every) if every and every <= left]
        self._budget_every = max(1, left // CPU_BUDGET_CHECKS, *cadence) if fitted else 0
        self._budget_mark = (progress.step, cpu_so_far)

    def _hold_cpu_budget(self, progress: Progress) -> None:
        """Keep ``train.max_cpu_seconds`` when the CPU per step rises after the fit (the machine got busier). After
        every step (one small collective; the slowest rank's figures): the run stops here once it has spent the
        budget; and at the end of each measuring window it is re-fitted (shortened, the lr schedule decaying over
        the new length from here) when the steps left, at the window's CPU per step, would overrun the budget by
        more than ``CPU_BUDGET_TOLERANCE``. The new length is checkpointed as the fit is, so a
        resumed run starts from it. A run that re-plans cannot be resumed step for step (the resumed run measures
        its own machine); ``train.cpu_budget_hold=false`` keeps the fitted length instead, and resumes exact."""
        if not self._budget_every:
            return
        this_attempt = time.process_time() - self._cpu_start
        mark_step, mark_cpu = self._budget_mark
        window = progress.step - mark_step
        measured = torch.tensor(
            [self._cpu_before + this_attempt, (this_attempt - mark_cpu) / max(window, 1)], device=self.device
        )
        spent, per_step = (float(v) for v in self.accelerator.gather(measured[None]).max(dim=0).values)
        budget = float(self.settings.train.max_cpu_seconds)
        fitted = self.total_steps
        if spent >= budget:
            fitted = progress.step
        elif window >= self._budget_every:
            self._budget_mark = (progress.step, this_attempt)
            if spent + (self.total_steps - progress.step) * per_step > budget * (1 + CPU_BUDGET_TOLERANCE):
                fitted = min(self.total_steps, progress.step + int((budget - spent) / max(per_step, 1e-9)))
        if fitted == self.total_steps:
            return
        if self.is_main:
            print(
                f"cpu budget {budget:.0f} CPU-s: {spent:.1f} spent, now {per_step:.3f} CPU-s/step: "
                + (f"{fitted} steps (was {self.total_steps})" if fitted > progress.step else "stopping here"),
                flush=True,
            )
        self.total_steps = progress.budget_steps = max(fitted, progress.step)

    def _log_train(self, progress: Progress, lr: float) -> None:
        """One metrics record + console line for the steps since the last one (collective: all ranks call it)."""
        window = self._window
        record = self._train_record(window["stats"], progress, lr, window["seconds"], window["since"])
        progress.tokens_seen += int(record["tokens"])
        progress.train_seconds += window["seconds"]
        wall_start, first_step = self._run_start
        per_step = (time.time() - wall_start) / max(progress.step - first_step, 1)
        record["eta_s"] = per_step * (self.total_steps - progress.step)
        self.logger.log(record, console_line(record, self.total_steps))
        self.logger.advance(progress.step - window["since"], {"tok/s": f"{record['tokens_per_s']:.0f}"})
        self._window = {"stats": StepStats(self.steps, self.device), "seconds": 0.0, "since": progress.step}

    @staticmethod
    def _due(every: int, step: int, epoch_end: bool) -> bool:
        """Every ``every`` steps, or at epoch ends when ``every`` is 0."""
        return step % every == 0 if every else epoch_end

    def _start(self) -> Progress:
        """Fresh start or exact resume from the newest complete checkpoint (``train.resume``). Every refusal comes
        before the run directory is written."""
        acc = self.accelerator
        state = self._resume_state()
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.write_run_config(self.run_dir, self.settings.resolved, hydra_overrides())
            runs.write_precision(self.run_dir, {"train": self.precision.to_json()})
            ckpt.remove_partials(self.run_dir)
            self.vocab.save(self.run_dir / runs.DRAFT_VOCAB_NAME)
            atomic_write_json(self.run_dir / DATA_SOURCES_NAME, self._data_sources())
            if self.init_from_report is not None:
                runs.write_init_from(self.run_dir, self.init_from_report.to_json())
        acc.wait_for_everyone()
        torch.manual_seed(
            self.settings.seed * 1000 + self.rank
        )  # stray randomness: per rank, restored on resume
        progress = Progress(world_size=self.world, global_batch=self.plan.global_batch)
        if state is None:
            return progress
        path = self.resume_from
        ckpt.load_step(acc, path)
        known = {f for f in Progress.__dataclass_fields__}
        progress = Progress(**{k: v for k, v in state.items() if k in known})
        progress.world_size = self.world
        if self.is_main:
            print(f"resumed from {path} at step {progress.step}", flush=True)
        return progress

    def _resume_state(self) -> dict[str, Any] | None:
        """The trainer state of the checkpoint this launch resumes (None: a fresh start), refused when exact
        resume cannot load it here (the recipe was compared in ``__init__``)."""
        path = self.resume_from
        if path is None:
            return None
        state = runs.require_resumable(path)
        if self.is_deepspeed and int(state["world_size"]) != self.world:
            raise ValueError(
                f"{path} holds DeepSpeed ZeRO partitions of {state['world_size']} processes; resume it with "
                f"{state['world_size']} processes (this launch has {self.world}), or start a new run with "
                f"train.init_from={path}"
            )
        if int(state["global_batch"]) != self.plan.global_batch:
            raise ValueError(
                f"{path} was trained with global batch {state['global_batch']}, this launch has "
                f"{self.plan.global_batch} (micro_batch_size × grad_accum × processes): exact resume needs the "
                "same global batch; adjust train.micro_batch_size/grad_accum or the process count"
            )
        return state

    def _announce(self, progress: Progress) -> None:
        params = self.accelerator.unwrap_model(self.model).parameters()
        trainable = sum(
            getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad
        )  # ZeRO-3: full size
        self.logger.write(
            f"training {self.settings.train.algorithm} draft for {self.verifier_name}: {len(self.features.train_set)} "
            f"samples, {self.plan.steps_per_epoch} steps/epoch × {self.settings.train.epochs} epochs → {self.total_steps} steps "
            f"(global batch {self.plan.global_batch} on {self.world} process(es), "
            f"{self.accelerator.distributed_type.value}), draft vocab {self.vocab.draft_vocab_size} "
            f"({self._vocab_source()}), "
            f"{trainable / 1e6:.1f}M trainable parameters, dtype {self.precision.name} ({self.precision.source}: "
            f"{self.precision.reason}), "
            f"drafted positions per draft {self.steps}"
            + (f", starting at step {progress.step}" if progress.step else "")
        )

    def _vocab_source(self) -> str:
        """Where the draft vocabulary came from, for the run's opening line."""
        parent = self.vocab.provenance.get("parent")
        return f"kept from the parent {parent}" if parent else "built from the data's token counts"

    def _train_record(
        self, stats: StepStats, progress: Progress, lr: float, elapsed: float, since: int
    ) -> dict[str, Any]:
        total = stats.all_reduce(self.accelerator)
        tokens = float(total.tokens)
        return {
            "step": progress.step,
            "kind": "train",
            "epoch": round(progress.step / self.plan.steps_per_epoch, 4),
            "lr": lr,
            "train/loss": total.loss(self.weights, self.objective.topk_weight),
            "tokens": tokens,
            "tokens_per_s": tokens / max(elapsed, 1e-9),
            "steps_per_s": (progress.step - since) / max(elapsed, 1e-9),
            "process_cpu_s": time.process_time(),  # this rank's CPU so far, every thread: cost curves (bench)
            **total.per_step_metrics("train", with_topk=bool(self.objective.topk_weight)),
        }

    def _evaluate(self, progress: Progress) -> bool:
        """Validate if held-out data exists; returns True when the acceptance length is a new best."""
        heldout = self.features.heldout_set
        if heldout is None or len(heldout) == 0 or self._last_eval_step == progress.step:
            return False
        self._last_eval_step = progress.step
        metrics = evaluate(
            self.accelerator,
            self.model,
            self.objective,
            self.head,
            self.features.eval_batches(),
            self.settings.eval.k,
        )
        progress.metrics = metrics
        epoch = round(progress.step / self.plan.steps_per_epoch, 4)
        record = {"step": progress.step, "kind": "eval", "epoch": epoch, **metrics}
        self.logger.log(record, eval_line(record))
        accept = metrics["eval/acceptance_length"]
        if accept > progress.best.get("acceptance_length", -math.inf):
            progress.best = {"step": progress.step, "acceptance_length": accept}
            return True
        return False

    def _save(self, progress: Progress, improved: bool) -> None:
        if self._last_save_step == progress.step:
            return
        self._last_save_step = progress.step
        progress.budget_cpu_s = self._cpu_before + time.process_time() - self._cpu_start
        path = ckpt.save_step(
            self.accelerator, self.model, self.run_dir, progress.step, self.draft_config, asdict(progress)
        )
        if self.is_main:
            if improved:
                runs.write_best(
                    self.run_dir, progress.step, progress.best["acceptance_length"], progress.metrics
                )
            ckpt.prune(self.run_dir, self.settings.train.keep_checkpoints)
            self.logger.write(f"saved {path}" + (" (best so far)" if improved else ""))
        self.accelerator.wait_for_everyone()

    # ---- shutdown ---------------------------------------------------------------------------------------
    def close(self, failed: bool = False) -> None:
        """Clean shutdown (gloo DDP otherwise hangs at exit), and a reset so another job can run in-process.
        After a failure the barrier is skipped: the other ranks may be stuck in another collective."""
        acc = self.accelerator
        if not failed:
            acc.wait_for_everyone()
        if getattr(self, "logger", None) is not None and failed:
            self.logger.close()
        del self.model, self.optimizer
        if getattr(self, "features", None) is not None:
            self.features.close()
        # accelerate keeps the DeepSpeed engine; free_memory destroys it (ZeRO-3's optimizer drops its hooks and
        # pending gathers) before the process group goes: a gloo thread still holding a gather at interpreter exit
        # aborted one rank of a finished 2-process ZeRO-3 run ("terminate called without an active exception")
        acc.free_memory()
        gc.collect()
        acc.end_training()
        reset_distributed()


def hydra_overrides() -> list[str]:
    """The command-line overrides of this Hydra run (none when composed programmatically)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def reset_distributed() -> None:
    """Destroy the process group and forget accelerate's singletons (a Hydra multirun's next job starts clean)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState, PartialState

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


def train(config: TrainSettings | Any, run_dir: str | Path) -> dict[str, Any]:
    """Build, fit and shut down cleanly (also on errors, so an in-process sweep's next job starts clean).
    ``config``: the settings, or a composed recipe (validated before anything starts)."""
    settings = train_settings(config)
    try:
        trainer = Trainer(settings, run_dir)
    except BaseException:
        reset_distributed()
        raise
    try:
        result = trainer.fit()
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()
    return result


__all__ = ["DATA_SOURCES_NAME", "Progress", "Trainer", "reset_distributed", "train"]
