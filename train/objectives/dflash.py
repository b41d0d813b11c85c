"""DFlash: anchor-block training from the EAGLE-3 offline features (no new capture).

Its settings are the ``block`` group (:class:`BlockSettings`, recipes/block/default.yaml), which every block
drafter (this objective's subclasses) reads. Per micro batch, up to ``block.max_anchors`` positions t are sampled
among those whose first draft token has a target (a loss token x_{t+2} in the same document). Each sampled t
anchors one block, exactly as decoding builds it after the verifier confirmed x_0..x_t and emitted x_{t+1}:

    slot 0 = x_{t+1} at position pos_t + 1,   slots s >= 1 = mask_token_id at pos_t + 1 + s
    context = the draft's context K/V of positions 0..t of the same document (a sliding window if the layout has one)

Slot s = j + 1 is step j of the shared statistics: it targets the verifier's distribution at t+1+j (token
x_{t+2+j}). Every block of the micro batch is one forward, its attention chosen by ``train.attention_backend``
(``auto``: flex on CUDA, chunked elsewhere). Chunked: anchor chunks whose scores ``anchors · slots · (L + slots)``
are recomputed in backward; flex (:mod:`train.anchor_attention`): one block-sparse flex_attention over the whole
micro batch. Either way memory is linear in the number of anchors.

Loss: soft cross-entropy (forward KL) per slot, weighted per position by ``block.position_weighting``:
``exp_decay`` (w_j = exp(-j / γ)) or ``dpace`` (each slot weighs the expected number of accepted tokens it
unlocks: w_j = Σ_{i ≥ j} Π_{m ≤ i} s_m with s_m = (1 - α)·exp(-CE_m) + α, detached). The normaliser is the global
batch's trained count per slot, as for EAGLE-3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from speculators.algorithms.dflash.config import DFlashConfig
from speculators.algorithms.dflash.model import ContextKV, DFlashDraftModel
from speculators.models.layers import AttendFn
from speculators.verifier import resolve_verifier_path, verifier_embedding
from speculators.vocab import DraftVocab
from train.anchor_attention import flex_anchor_attention, flex_held_bytes
from train.assemble import draft_mask_token, scale_fc_by_feature_rms
from train.data import MicroBatch
from train.losses import StepMasks, StepTerms, soft_cross_entropy
from train.objectives import MemoryTerms, Objective, Plan, register
from train.settings import TrainSettings, at_least, one_of
from train.step_stats import StepStats
from train.targets import TargetHead
from train.ttt_attention import resolve_backend

POSITION_WEIGHTINGS = ("exp_decay", "dpace")


@dataclass(frozen=True)
class BlockSettings:
    """``block``: every block drafter's blocks, anchor sampling and per-slot loss weighting
    (recipes/block/default.yaml)."""

    block_size: int = 8  # slots per forward: the anchor + block_size - 1 draft slots
    block_causal: bool = True  # a slot sees the earlier slots of its block only
    mask_token_id: int | None = None  # null: chosen by speculators.mask_token
    max_anchors: int = 512  # blocks per micro batch
    anchor_chunk: int = 64  # blocks per chunk of the chunked attention
    position_weighting: str = "exp_decay"
    decay_gamma: float = 4.0
    dpace_alpha: float = 0.5

    def problems(self, prefix: str) -> list[str]:
        found = at_least(f"{prefix}.block_size", self.block_size, 2)
        found += at_least(f"{prefix}.mask_token_id", self.mask_token_id, 0)
        found += at_least(f"{prefix}.max_anchors", self.max_anchors, 1)
        found += at_least(f"{prefix}.anchor_chunk", self.anchor_chunk, 1)
        found += one_of(f"{prefix}.position_weighting", self.position_weighting, POSITION_WEIGHTINGS)
        if not self.decay_gamma > 0 or not 0 < self.dpace_alpha <= 1:
            found.append(
                f"{prefix}.decay_gamma={self.decay_gamma} must be > 0 and {prefix}.dpace_alpha={self.dpace_alpha} "
                "in (0, 1]"
            )
        return found


class AnchorBlockDraft(nn.Module):
    """Wraps a block drafter (its parameters are ``draft.*``): one forward = every sampled anchor's block."""

    def __init__(
        self,
        draft: DFlashDraftModel,
        anchor_chunk: int,
        attention_backend: str = "chunked",
        max_anchors: int = 0,
    ) -> None:
        super().__init__()
        self.draft = draft
        self.anchor_chunk = anchor_chunk
        # train.attention_backend (auto: flex on CUDA, else chunked); flex pads the anchors to max_anchors, so
        # it compiles one shape per row bucket
        self.attention_backend = attention_backend
        self.max_anchors = max_anchors

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        slots: int,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Draft logits ``[N, slots - 1, Vd]`` of the draft slots (1..) of the blocks anchored after positions
        ``(rows[n], cols[n])`` (the anchor slot proposes nothing: its head is never computed), and the
        draft's other heads' outputs (e.g. a confidence head's ``[N, slots]``). Each slot's previous token (what a
        Markov head reads) is the data token before its target: teacher forcing. ``backend`` overrides the
        attention backend for this call (evaluation runs ``chunked``: see :mod:`train.anchor_attention`)."""
        draft = self.draft
        context = draft.project_context(aux_hidden.to(draft.fc.weight.dtype))
        context_kv = draft.context_kv(context, position_ids)
        length = input_ids.shape[1]
        window, causal = draft.config.sliding_window, draft.config.block_causal
        block_ids, block_pos = draft.block_inputs(
            input_ids[rows, (cols + 1).clamp(max=length - 1)], position_ids[rows, cols] + 1
        )
        block_ids, block_pos = block_ids[:, :slots], block_pos[:, :slots]
        if resolve_backend(backend or self.attention_backend, input_ids.device) == "flex":
            attend: AttendFn = flex_anchor_attention(
                context_kv, rows, cols, document_ids, position_ids, block_pos, causal, window,
                max(rows.numel(), self.max_anchors),
            )  # fmt: skip
        else:
            attend = self.chunked_attend(context_kv, rows, cols, document_ids, position_ids, block_pos)
        prev_cols = (cols[:, None] + torch.arange(slots, device=cols.device)[None]).clamp(max=length - 1)
        prev_ids = input_ids[rows[:, None], prev_cols]
        hidden = draft.block_hidden(block_ids, block_pos, attend)
        drafted, prev = hidden[:, 1:], prev_ids[:, 1:]
        return draft.slot_logits(drafted, prev), draft.aux_outputs(drafted, prev)

    def chunked_attend(
        self,
        context_kv: ContextKV,
        rows: torch.Tensor,
        cols: torch.Tensor,
        document_ids: torch.Tensor,
        position_ids: torch.Tensor,
        block_pos: torch.Tensor,
    ) -> AttendFn:
        """The chunked callback: anchors in chunks of ``anchor_chunk`` within one row, each chunk against that row's
        context (:func:`anchored_attention`); runs anywhere."""
        config = self.draft.config
        chunks = row_chunks(rows, self.anchor_chunk, document_ids.shape[0])
        seen_by_chunk = [  # the same for every layer
            context_visible(cols[start:stop], document_ids[row], position_ids[row], block_pos[start:stop],
                            config.sliding_window)
            for start, stop, row in chunks
        ]  # fmt: skip

        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # every module runs once per micro batch whatever the anchor count (ZeRO-3 gathers per module call)
            ctx_k, ctx_v = context_kv[layer_idx]
            out = [
                anchored_attention(
                    q[start:stop], k[start:stop], v[start:stop], ctx_k[row], ctx_v[row], seen, config.block_causal
                )
                for (start, stop, row), seen in zip(chunks, seen_by_chunk, strict=True)
            ]  # fmt: skip
            return torch.cat(out) if out else q.new_zeros(q.shape)

        return attend


def context_visible(
    cols: torch.Tensor,
    document_ids: torch.Tensor,
    position_ids: torch.Tensor,
    block_pos: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """``[A, S, L]``: which context columns of ONE row each slot of the blocks anchored at ``cols [A]`` sees:
    columns <= the anchor of the anchor's own document, and with a ``window`` only positions > the slot's
    position (``block_pos [A, S]``) - window. The rule :func:`train.anchor_attention.anchor_mask_mod` encodes."""
    columns = torch.arange(document_ids.shape[0], device=cols.device)
    seen = (columns[None] <= cols[:, None]) & (document_ids[None] == document_ids[cols][:, None])
    seen = seen[:, None, :].expand(-1, block_pos.shape[1], -1)
    if window is not None:
        seen = seen & (position_ids[None, None, :] > block_pos[:, :, None] - window)
    return seen


def row_chunks(rows: torch.Tensor, size: int, num_rows: int) -> list[tuple[int, int, int]]:
    """``(start, stop, row)`` chunks of at most ``size`` anchors (sorted row-major) that never straddle two rows: a
    chunk attends to ONE row's context keys, shared, never copied per anchor. (On the meta device, for the memory
    plan, the anchors are taken as spread evenly over the rows: memory is linear in the anchors, so any split costs
    the same.)"""
    total = rows.numel()
    if rows.is_meta:
        per_row = -(-total // num_rows) if total else 1
        bounds = [(start, min(start + per_row, total), 0) for start in range(0, total, per_row)]
    else:
        counts = torch.bincount(rows, minlength=num_rows).tolist()
        ends = torch.tensor(counts).cumsum(0).tolist()
        bounds = [
            (end - count, end, row)
            for row, (count, end) in enumerate(zip(counts, ends, strict=True))
            if count
        ]
    return [
        (start, min(start + size, last), row)
        for first, last, row in bounds
        for start in range(first, last, size)
    ]


def _anchored_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    visible: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    anchors, heads, slots, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.view(anchors, kv_heads, heads // kv_heads, slots, dim)  # GQA without repeating k/v
    scale = 1.0 / math.sqrt(dim)
    on_context = torch.einsum("akgsd,kld->akgsl", grouped, context_k).float() * scale
    on_context = on_context.masked_fill(~visible[:, None, None], float("-inf"))
    on_block = torch.einsum("akgsd,aktd->akgst", grouped, k).float() * scale
    if causal:
        own = torch.ones(slots, slots, dtype=torch.bool, device=q.device).tril()
        on_block = on_block.masked_fill(~own, float("-inf"))
    probs = torch.softmax(torch.cat([on_context, on_block], dim=-1), dim=-1).to(v.dtype)
    length = context_k.shape[1]
    out = torch.einsum("akgsl,kld->akgsd", probs[..., :length], context_v)
    out = out + torch.einsum("akgst,aktd->akgsd", probs[..., length:], v)
    return out.reshape(anchors, heads, slots, dim)


def anchored_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    visible: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    """Blocks of one row against that row's context: ``q [A, H, S, D]``, block ``k``/``v [A, Hkv, S, D]``, the row's
    ``context_k``/``context_v [Hkv, L, D]`` (shared by every anchor), ``visible [A, S, L]``. Exact softmax over
    context and block keys (fp32 scores); with gradients the chunk runs under checkpointing, so only its inputs
    and output are kept and the ``A·S·L`` scores are recomputed in backward: memory linear in the anchors. The same
    rule as :func:`speculators.algorithms.dflash.model.block_attention` (the engine's), a test checks they agree."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or context_k.requires_grad):
        return checkpoint(
            _anchored_chunk, q, k, v, context_k, context_v, visible, causal, use_reentrant=False
        )
    return _anchored_chunk(q, k, v, context_k, context_v, visible, causal)


@dataclass
class BlockTerms:
    """One forward's slot scores: logits ``[N, k, Vd]`` of the draft slots, other heads' outputs, per-anchor CE and agreement
    ``1 - TV(draft, verifier)`` ``[N, k]`` (0 where untrained), and each step's summed terms."""

    logits: torch.Tensor
    extras: dict[str, torch.Tensor]
    ce: torch.Tensor
    agreement: torch.Tensor
    terms: list[StepTerms]


def sample_anchors(
    valid_first: torch.Tensor, max_anchors: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``max_anchors`` positions where ``valid_first`` holds, uniformly without replacement (``seed``:
    reproducible, so a resumed run samples what it would have), in row-major order."""
    rows, cols = valid_first.nonzero(as_tuple=True)
    if rows.numel() > max_anchors:
        generator = torch.Generator().manual_seed(seed)
        keep = torch.randperm(rows.numel(), generator=generator)[:max_anchors].sort().values.to(rows.device)
        rows, cols = rows[keep], cols[keep]
    return rows, cols


def at_anchors(masks: StepMasks, rows: torch.Tensor, cols: torch.Tensor) -> StepMasks:
    """The step masks of the sampled anchors only, as ``[k, 1, N]`` (what the loss normaliser counts)."""
    return StepMasks(
        masks.valid[:, rows, cols][:, None],
        masks.trained[:, rows, cols][:, None],
        masks.target_draft_id[:, rows, cols][:, None],
    )


def dpace_weights(ce: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE per-slot weights ``[N, k]`` from per-slot CE ``[N, k]`` (module docstring), detached."""
    with torch.no_grad():
        mask = trained.to(ce.dtype)
        smooth = torch.where(trained, (1.0 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
        prefix = torch.cumprod(smooth, dim=-1) * mask
        return prefix.flip(-1).cumsum(-1).flip(-1) * mask


@register
class AnchorBlocks(Objective):
    """DFlash's objective (module docstring); a variant subclasses it with its draft's classes, its own settings
    group beside ``block`` and the hooks below."""

    algorithms = ("dflash",)
    groups = {"block": BlockSettings}
    steps_key = "block.block_size"
    config_class = DFlashConfig
    model_class = DFlashDraftModel
    # the module accelerate prepares around the draft (a block drafter with heads scored in its forward subclasses it)
    wrapper: ClassVar[type[AnchorBlockDraft]] = AnchorBlockDraft

    @property
    def block(self) -> BlockSettings:
        """The recipe's ``block`` group."""
        return self.settings.group("block")

    @property
    def steps(self) -> int:
        return self.block.block_size - 1

    @property
    def weights(self) -> list[float]:
        gamma = self.block.decay_gamma
        return [math.exp(-j / gamma) for j in range(self.steps)]

    def build(
        self, verifier_config: dict[str, Any], features: Any, vocab: DraftVocab, head: TargetHead, fresh: bool
    ) -> tuple[Any, nn.Module]:
        draft = self.fresh_draft(verifier_config, features, vocab, head)
        block, backend = self.block, self.settings.train.attention_backend
        return draft.config, self.wrapper(draft, block.anchor_chunk, backend, block.max_anchors)

    def fresh_draft(
        self, verifier_config: dict[str, Any], features: Any, vocab: DraftVocab, head: TargetHead
    ) -> nn.Module:
        """A fresh block drafter (same init on every rank): the mask token resolved (:mod:`speculators.mask_token`,
        the reason written into the config), the verifier's embedding, its lm_head rows of the draft vocabulary.
        The final norm stays at ones: the verifier's gain on an untrained draft's state makes its logits
        over-confident (measured on EAGLE-3's demo recipe: step-0 held-out loss 53.4 vs 28.8)."""
        settings, model = self.settings, self.settings.model
        embedding = verifier_embedding(settings.verifier.name_or_path)
        mask_id, reason = draft_mask_token(
            settings, features, embedding.shape[0], self.block.mask_token_id, "block.mask_token_id"
        )
        config = self.draft_config(
            verifier_config, features.aux_layer_ids, vocab.draft_vocab_size, mask_id, reason
        )
        torch.manual_seed(settings.seed)
        draft = self.model_class(config)
        draft.set_vocab(vocab.d2t, vocab.t2d)
        draft.embed_tokens.weight.data.copy_(embedding.to(draft.embed_tokens.weight.dtype))
        if model.init_lm_head_from_verifier:
            draft.lm_head.weight.data.copy_(head.draft_weight.to(draft.lm_head.weight.dtype))
        if model.fc_init == "feature_rms":
            scale_fc_by_feature_rms(draft, features.feature_rms().to(draft.fc.weight.device))
        return draft

    def draft_config(
        self,
        verifier_config: dict[str, Any],
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        mask_token_id: int,
        mask_token_source: str,
        name_or_path: str | None = None,
    ) -> Any:
        """The recipe's config.json (the trainer's and the memory plan's, which passes the verifier's name as
        written: it must not convert the embedded verifier just to name it)."""
        settings, block = self.settings, self.block
        config = self.config_class.from_verifier(
            verifier_config,
            name_or_path=name_or_path or resolve_verifier_path(settings.verifier.name_or_path),
            mask_token_id=mask_token_id,
            mask_token_source=mask_token_source,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=aux_layer_ids,
            num_layers=settings.model.num_layers,
            block_size=block.block_size,
            block_causal=block.block_causal,
            torch_dtype="float32",
            **self.config_fields(),
        )
        config.speculators_config.proposal_methods[0].speculative_tokens = config.draft_slots
        return config

    def memory_terms(self, draft_config: Any, dtype: torch.dtype) -> MemoryTerms:
        """Block flex attention keeps the context copy, the per-anchor part and the block mask for backward, at
        ``block.max_anchors`` (flex pads to it) and full blocks (train.anchor_attention.flex_held_bytes); nothing
        when the recipe asks for the chunked (or dense) kernel."""
        train, block = self.settings.train, self.block
        held = {}
        if train.attention_backend in ("auto", "flex"):  # auto: flex on the CUDA GPUs this plans for
            held = flex_held_bytes(
                train.micro_batch_size,
                train.max_length,
                block.max_anchors,
                draft_config.block_size,
                draft_config,
                dtype,
            )
        return MemoryTerms(block_attention_bytes=held, max_anchors=block.max_anchors)

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
        config = self.draft_config(verifier_config, aux_layer_ids, draft_vocab_size, 0, "memory plan", name)
        with torch.device("meta"):
            draft = self.model_class(config).to(dtype)
        return config, self.wrapper(draft, self.block.anchor_chunk)

    # ---- what a variant adds (its config fields, heads, terms) ------------------------------------------------
    def config_fields(self) -> dict[str, Any]:
        """The variant's own fields of its config class, from its settings group (none for DFlash)."""
        return {}

    def forward_kwargs(self, plan: Plan, steps: int) -> dict[str, torch.Tensor]:
        """Keyword arguments of the wrapper's forward beyond the blocks (none for DFlash)."""
        return {}

    def extra_loss(
        self, out: BlockTerms, weights: torch.Tensor, mask: torch.Tensor, norm: torch.Tensor
    ) -> torch.Tensor | None:
        """A term beside the token loss, weighted and normalised like it (``weights``/``mask`` ``[N, k]``, ``norm``
        ``[1, k]``); None for DFlash."""
        return None

    # ---- training -------------------------------------------------------------------------------------------
    def plan(self, batch: MicroBatch, loss_mask: torch.Tensor, head: TargetHead, seed: int) -> Plan:
        masks, needed = self.step_masks(batch, loss_mask, head, self.steps)
        rows, cols = sample_anchors(masks.valid[0], self.block.max_anchors, seed)
        return Plan(at_anchors(masks, rows, cols), needed, {"rows": rows, "cols": cols})

    def _terms(
        self,
        model: nn.Module,
        batch: MicroBatch,
        plan: Plan,
        head: TargetHead,
        steps: int,
        backend: str | None = None,
    ) -> BlockTerms:
        """One forward over the plan's blocks, scored slot by slot against the verifier (``backend``: the
        attention backend of this forward, default the model's)."""
        rows, cols = plan.extra["rows"], plan.extra["cols"]
        logits, extras = model(
            batch.input_ids, batch.aux_hidden, batch.position_ids, batch.document_ids, rows, cols, steps + 1,
            backend, **self.forward_kwargs(plan, steps),
        )  # fmt: skip
        # what the engine would draft at each slot (teacher forced): the argmax, unless the draft picks otherwise
        chosen = extras.get("chosen", logits.argmax(-1))
        masks = plan.masks
        length = batch.input_ids.shape[1]
        ce = logits.new_zeros(rows.numel(), steps, dtype=torch.float32)
        agreement = logits.new_zeros(rows.numel(), steps, dtype=torch.float32)  # 1 - TV(draft, verifier)
        terms = []
        for j in range(steps):
            trained = masks.trained[j, 0]
            if trained.any():
                target_cols = (cols[trained] + 1 + j).clamp(max=length - 1)
                verifier = head.draft_logits(batch.last_hidden[rows[trained], target_cols])
                draft = logits[trained, j]
                ce[trained, j] = soft_cross_entropy(draft, verifier)
                if "confidence" in extras:
                    with torch.no_grad():
                        tv = 0.5 * (torch.softmax(draft.float(), -1) - torch.softmax(verifier, -1)).abs().sum(
                            -1
                        )
                    agreement[trained, j] = 1.0 - tv
            with torch.no_grad():
                hits = (chosen[:, j] == masks.target_draft_id[j, 0]) & masks.valid[j, 0]
            terms.append(StepTerms(ce=ce[:, j].sum(), topk=ce.new_zeros(()), correct=hits.sum().double()))
        return BlockTerms(logits, extras, ce, agreement, terms)

    def loss(
        self,
        model: nn.Module,
        batch: MicroBatch,
        plan: Plan,
        head: TargetHead,
        trained: torch.Tensor,
        stats: StepStats,
    ) -> torch.Tensor:
        block = self.block
        out = self._terms(model, batch, plan, head, self.steps)
        mask = plan.masks.trained[:, 0].T  # [N, k]
        if block.position_weighting == "dpace":
            weights = dpace_weights(out.ce, mask, block.dpace_alpha)
        else:
            weights = out.ce.new_tensor(self.weights)[None].expand_as(out.ce)
        norm = trained[None, : self.steps].float()
        loss = (weights * out.ce / norm).sum()
        extra = self.extra_loss(out, weights, mask, norm)
        if extra is not None:
            loss = loss + extra
        for j, term in enumerate(out.terms):
            stats.add_terms(j, term)
        return loss

    # ---- validation -----------------------------------------------------------------------------------------
    def evaluate(
        self, model: nn.Module, batch: MicroBatch, head: TargetHead, stats: StepStats, steps: int
    ) -> None:
        """Every held-out position that starts a draft anchors a block of ``steps`` draft slots, through the chunked
        kernel whatever the backend (a varying anchor count, and no backward: see :mod:`train.anchor_attention`)."""
        steps = min(steps, self.steps)
        masks, needed = self.step_masks(batch, batch.loss_mask, head, steps, evaluating=True)
        rows, cols = masks.valid[0].nonzero(as_tuple=True)
        plan = Plan(at_anchors(masks, rows, cols), needed, {"rows": rows, "cols": cols})
        out = self._terms(model, batch, plan, head, steps, backend="chunked")
        chosen = out.extras.get("chosen", out.logits.argmax(-1))
        for j, term in enumerate(out.terms):
            stats.add_terms(j, term, batch.weight)
        stats.add_positions(plan.masks, batch.weight)
        correct = torch.stack([chosen[:, j] == plan.masks.target_draft_id[j, 0] for j in range(steps)])
        stats.add_chain(correct[:, None], plan.masks.valid, batch.weight)


class CandidateHeadBlocks(AnchorBlocks):
    """A block drafter with a head over each slot's candidates, verifier ids from the frozen unary head (DFlash2's
    selector, LiLiCorr's lattice): it needs the full verifier vocabulary and the verifier's own head, its wrapper
    is given the verifier's argmax per draft slot (``target_ids``), and the head's per-slot cross-entropy (the
    wrapper's ``head_ce_key`` extra) joins the loss weighted and normalised like the token loss, scaled by
    :meth:`head_weight`. The vocabulary's why is its config class's ``FULL_VOCABULARY``; the head's, a variant's
    ``verifier_head_because``."""

    head_ce_key: ClassVar[str] = ""
    verifier_head_because: ClassVar[str] = ""  # "<Name>'s ... is the verifier's, frozen (why)"

    @classmethod
    def settings_problems(cls, settings: TrainSettings) -> list[str]:
        found = super().settings_problems(settings)
        algorithm = settings.train.algorithm
        if settings.model.draft_vocab_size is not None:
            name, why = cls.config_class.FULL_VOCABULARY
            found.append(
                f"model.draft_vocab_size={settings.model.draft_vocab_size} with train.algorithm={algorithm}: "
                f"{name} requires the full verifier vocabulary ({why}); set model.draft_vocab_size=null"
            )
        if not settings.model.init_lm_head_from_verifier:
            found.append(
                f"model.init_lm_head_from_verifier=false with train.algorithm={algorithm}: "
                f"{cls.verifier_head_because}"
            )
        return found

    def head_weight(self) -> float:
        """The head loss's weight beside the token loss (the variant's settings group)."""
        raise NotImplementedError

    def forward_kwargs(self, plan: Plan, steps: int) -> dict[str, torch.Tensor]:
        return {"target_ids": plan.masks.target_draft_id[:steps, 0].T}

    def extra_loss(
        self, out: BlockTerms, weights: torch.Tensor, mask: torch.Tensor, norm: torch.Tensor
    ) -> torch.Tensor:
        return self.head_weight() * (weights * out.extras[self.head_ce_key] * mask / norm).sum()
