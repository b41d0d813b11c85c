"""P-EAGLE: K depths drafted in parallel, trained on chains sampled by COD (speculators.algorithms.peagle.model).

Depth d of the chain anchored at position t is the element at position t+d that one inference forward fills in
after the verifier accepted x_0..x_t and emitted x_{t+1}:

    depth 0     token x_{t+1}, feature fc(aux(t))           (EAGLE-3's ordinary input, every position t)
    depth d>=1  peagle.mask_token_id, feature fc(mask_hidden)   at rope position pos_t + d

It targets the verifier's distribution at t+1+d (token x_{t+2+d}): exactly step j = d at t of the shared convention
(train.losses.step_masks), so the per-step statistics and the simulated acceptance length mean what they mean for
EAGLE-3. Element (t, d) sees the depth-0 elements of positions <= t of its document and its own chain's
(t, d' <= d): the TTT "diagonal" attention (train/ttt_attention.py), reused as it is.

K is ``train.ttt_steps``: P-EAGLE's depths are the TTT steps of the shared convention (same targets, same
attention; only the inputs of steps >= 1 differ), so the loop, ``eval.k`` and the memory plan need no new key.
The export's ``speculative_tokens`` is K.

Compute: COD (:func:`sample_cod`) chooses which elements are TRAINED: depth 0 at every trained position (as
speculators does), and chains grown from up to ``peagle.max_anchors`` seeds, depth d keeping
``int((n_seeds - d) · max(0.7^d, 0.2))`` of the survivors of depth d-1 (speculators 0.9.0's rule: a fraction of the
seed count). The plan is made before the forward, so the training forward computes depth 0 at every position (every
element's context) and depth d >= 1 only at the sampled elements (:func:`chain_elements`, attention
:class:`train.ttt_attention.ChainAttention`). Chains are prefix-closed, so each sampled element's keys (depth 0 at
positions <= t of its document, and (t, 1..d)) are all computed: its logits, hence the loss and its gradients, are
the full unroll's (``tests/train/test_peagle_sparse.py``). The full unroll (every depth at every position) stays
the path of evaluation, which drafts K tokens at every held-out position, and of the meta-device memory plan, for
which it is an upper bound of the sampled one.

Loss: soft cross-entropy (forward KL up to the target entropy) per depth, depth d weighted
``train.step_weight_decay ** d`` (speculators: 1.0 for every depth), each depth normalised by the global batch's
trained count; data with per-token loss weights weighs each element's CE by its target token's
(train/losses.py), as EAGLE-3 does. Evaluation drafts K tokens at every held-out position from one (parallel) forward per anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speculators.algorithms.peagle.config import PEagleConfig
from speculators.algorithms.peagle.model import PEagleDraftModel
from speculators.verifier import resolve_verifier_path, verifier_embedding
from train.assemble import build_draft, calibrate_warm_start, draft_mask_token, scale_fc_by_feature_rms
from train.data import MicroBatch, training_loss_weight
from train.losses import RowTerm, StepMasks, StepTerms, element_terms, shift_left
from train.objectives import MemoryTerms, Plan, register
from train.objectives.eagle3 import TrainingTimeTest
from train.settings import at_least
from train.targets import TargetHead
from train.ttt_attention import ChainAttention, TTTAttention
from train.unroll import TTTDraft

# COD (speculators 0.9.0, models/peagle/data.py): depth d keeps max(COD_RATE^d, COD_FLOOR) of the seed count
COD_RATE = 0.7
COD_FLOOR = 0.2


@dataclass(frozen=True)
class PEagleSettings:
    """``peagle``: the mask token of the depths >= 1, COD's seed count and whether the embedding trains
    (recipes/peagle/default.yaml)."""

    mask_token_id: int | None = None  # null: chosen by speculators.mask_token
    max_anchors: int = 512  # COD seeds per micro batch (chains of depth >= 1); depth 0 trains everywhere
    embed_requires_grad: bool = (
        True  # train the embedding (the mask token's row above all); speculators 0.9.0 does
    )

    def problems(self, prefix: str) -> list[str]:
        return at_least(f"{prefix}.mask_token_id", self.mask_token_id, 0) + at_least(
            f"{prefix}.max_anchors", self.max_anchors, 1
        )


def cod_depth_size(seeds: int, depth: int) -> int:
    """How many chains depth ``depth`` >= 1 keeps out of ``seeds`` (speculators' rule, module docstring)."""
    return int((seeds - depth) * max(COD_RATE**depth, COD_FLOOR))


def sample_cod(trained: torch.Tensor, max_anchors: int, seed: int) -> torch.Tensor:
    """The trained elements bool ``[K, B, L]`` (depth, row, anchor) among ``trained`` (those with a target).

    Depth 0: every trained position. Seeds: anchors whose depth 1 has a target, at most ``max_anchors`` of them
    (uniform without replacement). Depth d >= 1: :func:`cod_depth_size` chains drawn uniformly from the depth-(d-1)
    survivors whose depth d has a target (all of them when fewer); sampling stops at the first empty depth.
    Reproducible from ``seed`` (a resumed run samples what it would have), independent of the device."""
    if trained.is_meta:  # the dry-run memory plan: every element trained (the dense unroll costs the same)
        return trained
    depths = trained.shape[0]
    selected = torch.zeros_like(trained)
    selected[0] = trained[0]
    if depths == 1:
        return selected
    generator = torch.Generator().manual_seed(seed)
    flat = trained.flatten(1).cpu()
    alive = flat[1].nonzero().flatten()
    if alive.numel() > max_anchors:
        alive = alive[torch.randperm(alive.numel(), generator=generator)[:max_anchors]].sort().values
    seeds = alive.numel()
    chosen = selected.flatten(1)
    for depth in range(1, depths):
        size = cod_depth_size(seeds, depth)
        alive = alive[flat[depth, alive]]
        if size <= 0 or alive.numel() == 0:
            break
        if alive.numel() > size:
            alive = alive[torch.randperm(alive.numel(), generator=generator)[:size]].sort().values
        chosen[depth, alive.to(chosen.device)] = True
    return selected


def chain_elements(sampled: torch.Tensor) -> list[torch.Tensor]:
    """The elements a sparse forward computes at depths 1..K-1, from the sampled (scored) elements bool
    ``[K, B, L]``: each depth's flat ``row · L + t`` indices (sorted, on the CPU), closed under prefixes (an element's
    lower depths of the same anchor are computed too: they are its diagonal keys). COD's chains are already
    prefix-closed; the closure makes the forward right for any choice."""
    computed = sampled[1:].flip(0).cummax(0).values.flip(0).cpu()  # depth d: sampled at some depth >= d
    return [depth.flatten().nonzero().flatten() for depth in computed]


class ParallelDraft(TTTDraft):
    """Wraps a :class:`PEagleDraftModel` (its parameters are ``draft.*``) like :class:`TTTDraft` wraps an EAGLE-3
    draft, with its own unroll: one module forward computes every depth (what DDP/DeepSpeed need: one forward per
    backward), at every position (K logits ``[B, L, Vd]``) or, in training, depth d >= 1 only at the sampled
    elements. No depth feeds the next one (the mask slots read ``mask_hidden``), so there is no context to detach."""

    def __init__(
        self, draft: PEagleDraftModel, depths: int, attention_backend: str = "auto", chunk_size: int = 256
    ) -> None:
        super().__init__(draft, depths, attention_backend=attention_backend, chunk_size=chunk_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        steps: int | None = None,
        elements: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Depth d's logits at every anchor t (module docstring); ``steps`` overrides K (evaluation). With
        ``elements`` (:func:`chain_elements`, K - 1 tensors) depth d >= 1 is computed only at ``elements[d - 1]`` and
        its logits are ``[N_d, Vd]`` in their order; depth 0 stays ``[B, L, Vd]``."""
        draft = self.draft
        features = draft.project_features(aux_hidden.to(draft.fc.weight.dtype))
        bonus = shift_left(input_ids, 1)
        if elements is not None:
            return self._sampled_depths(bonus, features, position_ids, document_ids, elements)
        steps = steps or self.steps
        attend = TTTAttention(document_ids, self.attention_backend, self.chunk_size, total_steps=steps)
        logits = []
        for depth in range(steps):
            ids, hidden = draft.slot_inputs(bonus, features, depth)
            depth_logits, _ = draft(ids, hidden, position_ids + depth, attend)
            logits.append(depth_logits)
        return tuple(logits)

    def _sampled_depths(
        self,
        bonus: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        elements: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        """Depth 0 everywhere, depth d >= 1 as one ``[1, N_d]`` sequence of mask slots at rope positions
        ``position_ids[b, t] + d`` (every depth runs, an empty one too: the module's parameters all take part)."""
        draft = self.draft
        attend = ChainAttention(document_ids, elements, self.attention_backend, self.chunk_size)
        logits, _ = draft(bonus, features, position_ids, attend)
        out = [logits]
        flat_positions = position_ids.flatten()
        for depth, gathered in enumerate(attend.elements, start=1):
            ids, hidden = draft.mask_slots((1, gathered.count), features)
            depth_logits, _ = draft(ids, hidden, flat_positions[gathered.flat][None] + depth, attend)
            out.append(depth_logits[0])
        return tuple(out)


@register
class ParallelDepths(TrainingTimeTest):
    """The TTT objective's loss and evaluation (the model returns per-depth logits in the same convention) with
    P-EAGLE's draft and COD's choice of trained elements."""

    algorithms = ("peagle",)
    groups = {"peagle": PEagleSettings}
    # the parallel unroll (and its sampled-chain attention) passes no window to its layers: a windowed P-EAGLE
    # recipe would train without the window it exports, so the settings refuse model.sliding_window for it
    sliding_window_layers = False

    @property
    def peagle(self) -> PEagleSettings:
        """The recipe's ``peagle`` group."""
        return self.settings.group("peagle")

    def build(
        self, verifier_config: dict[str, Any], features: Any, vocab: Any, head: TargetHead, fresh: bool
    ) -> tuple[Any, nn.Module]:
        settings, model = self.settings, self.settings.model
        embedding = verifier_embedding(settings.verifier.name_or_path)
        mask_id, reason = draft_mask_token(
            settings, features, embedding.shape[0], self.peagle.mask_token_id, "peagle.mask_token_id"
        )
        config = self._config(
            verifier_config,
            features.aux_layer_ids,
            vocab.draft_vocab_size,
            mask_id,
            reason,
            resolve_verifier_path(settings.verifier.name_or_path),
        )
        draft = build_draft(settings, config, vocab, head, PEagleDraftModel)
        if model.fc_init == "feature_rms" and fresh:
            scale_fc_by_feature_rms(draft, features.feature_rms().to(draft.fc.weight.device))
        if model.warm_start == "top_layer" and fresh:
            calibrate_warm_start(draft, features.residual_rms())
        train = settings.train
        return config, ParallelDraft(draft, self.steps, train.attention_backend, train.attention_chunk)

    def _config(
        self,
        verifier_config: dict[str, Any],
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        mask_token_id: int,
        mask_token_source: str,
        name_or_path: str,
    ) -> PEagleConfig:
        """The recipe's P-EAGLE config.json (the trainer's and the memory plan's)."""
        model = self.settings.model
        return PEagleConfig.from_verifier(
            verifier_config,
            name_or_path=name_or_path,
            mask_token_id=mask_token_id,
            mask_token_source=mask_token_source,
            embed_requires_grad=self.peagle.embed_requires_grad,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=aux_layer_ids,
            speculative_tokens=self.steps,
            num_layers=model.num_layers,
            layer_type=model.layer_type,
            norm_before_residual=model.norm_before_residual,
            torch_dtype="float32",
        )

    def memory_terms(self, draft_config: Any, dtype: torch.dtype) -> MemoryTerms:
        """None: the plan counts no padded keys for P-EAGLE's parallel unroll (its trace is the whole account)."""
        return MemoryTerms()

    def meta_model(
        self,
        verifier_config: dict[str, Any],
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        dtype: torch.dtype,
    ) -> tuple[Any, nn.Module]:
        name = (
            self.settings.verifier.name_or_path
        )  # as written: naming it must not convert the embedded verifier
        config = self._config(verifier_config, aux_layer_ids, draft_vocab_size, 0, "memory plan", name)
        with torch.device("meta"):
            draft = PEagleDraftModel(config).to(dtype)
        # a trained embedding (P-EAGLE's option) moves from the frozen to the trainable bytes
        draft.embed_tokens.weight.requires_grad_(self.peagle.embed_requires_grad)
        return config, ParallelDraft(draft, self.steps, "chunked", self.settings.train.attention_chunk)

    def plan(self, batch: MicroBatch, loss_mask: torch.Tensor, head: TargetHead, seed: int) -> Plan:
        masks, needed = self.step_masks(batch, loss_mask, head, self.steps)
        chosen = sample_cod(masks.trained, self.peagle.max_anchors, seed)
        sampled = StepMasks(masks.valid & chosen, masks.trained & chosen, masks.target_draft_id)
        if chosen.is_meta:  # the memory plan traces the full unroll (an upper bound of the sampled one)
            return Plan(sampled, needed, {})
        elements = {"elements": chain_elements(sampled.valid)}
        return Plan(sampled, needed, elements, training_loss_weight(batch))

    def forward_logits(self, model: nn.Module, batch: MicroBatch, plan: Plan) -> tuple[torch.Tensor, ...]:
        """The sampled elements' logits when the plan names them (training), else every depth everywhere."""
        elements = plan.extra.get("elements")
        if elements is None:
            return super().forward_logits(model, batch, plan)
        return model(
            batch.input_ids, batch.aux_hidden, batch.position_ids, batch.document_ids, elements=elements
        )

    def terms(
        self,
        logits: tuple[torch.Tensor, ...],
        verifier_logits: torch.Tensor,
        plan: Plan,
        step: int,
        topk: RowTerm | None,
    ) -> StepTerms:
        """Depth ``step``'s sums: from the gathered ``[N_d, Vd]`` logits of a sampled forward, else the grid's."""
        elements = plan.extra.get("elements")
        if elements is None or step == 0:
            return super().terms(logits, verifier_logits, plan, step, topk)
        return element_terms(
            logits[step], elements[step - 1], verifier_logits, plan.masks, step, topk, plan.loss_weight
        )


__all__ = [
    "COD_FLOOR",
    "COD_RATE",
    "PEagleSettings",
    "ParallelDepths",
    "ParallelDraft",
    "chain_elements",
    "cod_depth_size",
    "sample_cod",
]
