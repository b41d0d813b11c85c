"""Drafting with a block drafter (DFlash): one forward proposes the whole chain, fed exactly as vLLM feeds it.

The draft keeps no KV cache of its own tokens. What it caches is the *context*: for every position the verifier has
confirmed, each draft layer's keys and values of ``hidden_norm(fc(aux states at that position))``, with k-norm and
rope at that position (``DFlashDraftModel.context_kv``). Each round appends the segment the verifier confirmed last
step (rows accepting fewer tokens than others leave holes, masked out like the verifier cache's), then runs one
block ``[root at P, mask at P+1 .. P+k]`` over every cached context position of its row (inside the sliding window,
if the draft has one) plus the block itself (causal or bidirectional within the block). Slot ``s >= 1`` proposes the
token at ``P + s``. The block's own keys and values are never cached: next round's block is recomputed from scratch.

With ``k`` drafts the block has ``1 + k`` slots, not ``block_size``: vLLM feeds ``1 + num_speculative_tokens``
query slots, and a bidirectional block's outputs depend on how many mask slots follow, so this must match it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from speculators.algorithms.dflash.model import block_attention
from speculators.decoding.cache import StaticKV
from speculators.decoding.sampling import sample, target_probs
from speculators.decoding.segment import Segment
from speculators.decoding.tree import DraftTree, chain_tree


class ContextCache:
    """Every draft layer's context keys/values ``[B, kv_heads, C, D]`` with per-row ``valid`` and ``positions``.

    Storage grows by doubling (:class:`StaticKV`), so appending a few confirmed positions per step does not copy
    the whole context every step. Columns are shared across the batch; a column is real for a row only where
    ``valid`` says so (left padding, or the tail of a step in which this row accepted fewer tokens)."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.store: StaticKV | None = None  # created on the first append, when the kv shape is known
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=device)

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def append(
        self, kv: list[tuple[torch.Tensor, torch.Tensor]], valid: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Add ``S`` columns: per layer ``(k, v)`` each ``[B, kv_heads, S, D]``."""
        width = int(valid.shape[1])
        if self.store is None:
            first = kv[0][0]
            batch, heads, _, dim = first.shape
            self.store = StaticKV(len(kv), batch, heads, dim, first)
        self.store.reserve(self.length + width)
        start = self.length
        for layer, (k, v) in enumerate(kv):
            self.store.keys[layer][:, :, start : start + width] = k
            self.store.values[layer][:, :, start : start + width] = v
        self.store.length = start + width
        self.valid = torch.cat([self.valid, valid], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s keys and values over the columns in use."""
        assert self.store is not None, "the context is empty: append the prompt's segment first"
        return (
            self.store.keys[index][:, :, : self.length],
            self.store.values[index][:, :, : self.length],
        )

    def visible(self, query_positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """bool ``[B, S, C]``: which context columns each block slot sees. Every cached position precedes the
        block (only confirmed positions are cached), so only holes and the sliding window hide a column."""
        visible = self.valid[:, None, :].expand(-1, query_positions.shape[1], -1)
        if window is not None:
            visible = visible & (self.positions[:, None, :] > query_positions[:, :, None] - window)
        return visible

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.store is not None:
            self.store.select_rows(rows)
        self.valid = self.valid[rows]
        self.positions = self.positions[rows]


class BlockDrafter:
    """Owns one batch's context cache and turns each confirmed segment into a chain of up to ``draft_slots``
    tokens with ONE draft forward (``forwards`` counts them: one per verify step)."""

    supports_tree = False

    def __init__(self, draft: Any, batch: int, device: torch.device) -> None:
        config = draft.config
        if config.first_draft_slot != 1:
            raise ValueError(
                "this draft samples from its anchor slot (sample_from_anchor: true), which vLLM does not serve "
                "and the engine does not decode; export it with sample_from_anchor false"
            )
        self.draft = draft
        self.config = config
        self.cache = ContextCache(batch, device)
        self.dtype = next(draft.parameters()).dtype
        self.vocab_size = config.vocab_size
        self.target_ids = draft.draft_to_target(torch.arange(config.draft_vocab_size, device=device))
        self.seconds = 0.0  # time inside draft forwards (context projection included)
        self.forwards = 0

    # ---- what the engine asks before decoding --------------------------------------------------------------
    @staticmethod
    def max_k(config: Any) -> int | None:
        """The most drafts one block proposes."""
        return int(config.draft_slots)

    @staticmethod
    def default_k(config: Any) -> int:
        """A block drafter is trained to fill its whole block: draft every slot by default."""
        return int(config.draft_slots)

    # ---- one round -----------------------------------------------------------------------------------------
    def read_segment(self, segment: Segment) -> None:
        """Cache the context keys/values of the positions the verifier confirmed last step."""
        context = self.draft.project_context(segment.features.to(self.dtype))
        self.cache.append(self.draft.context_kv(context, segment.positions), segment.valid, segment.positions)

    def block_hidden(self, root: torch.Tensor, root_position: torch.Tensor, k: int) -> torch.Tensor:
        """The draft slots' final hidden states ``[B, k, H]`` of the block ``[root, mask × k]`` at ``root_position``."""
        ids, positions = self.draft.block_inputs(root, root_position)
        ids, positions = ids[:, : 1 + k], positions[:, : 1 + k]
        visible = self.cache.visible(positions, self.config.sliding_window)
        causal = self.config.block_causal

        def attend(layer: int, q: torch.Tensor, k_: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            context_k, context_v = self.cache.layer(layer)
            return block_attention(q, k_, v, context_k, context_v, visible, causal)

        return self.draft.block_hidden(ids, positions, attend)[:, 1 : 1 + k]

    def choose(
        self,
        hidden: torch.Tensor,
        root: torch.Tensor,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ids ``[B, k]`` and (T > 0) each slot's tempered draft distribution ``[B, k, Vd]``.

        A draft whose logits depend on the token before each slot (``reads_slots_in_turn``: DSpark's Markov bias)
        is read slot by slot through :meth:`slot_logits`, each slot given the token drafted before it (the root
        for the first); the backbone still ran once. Otherwise every slot is read at once."""
        if not self.reads_slots_in_turn():
            return self._pick(self.draft.slot_logits(hidden), temperature, top_p, generator)
        prev, choices, dists = root, [], []
        for slot_input in self.slot_inputs(hidden):
            choice, dist = self._pick(self.slot_logits(slot_input, prev), temperature, top_p, generator)
            choices.append(choice)
            dists.append(dist)
            prev = self.target_ids[choice]
        stacked = torch.stack(dists, dim=1) if temperature > 0 else None
        return torch.stack(choices, dim=1), stacked

    def reads_slots_in_turn(self) -> bool:
        """Whether a slot's logits depend on the token drafted before it (a draft with ``markov_bias``)."""
        return bool(getattr(self.draft, "markov_bias", False))

    def slot_inputs(self, hidden: torch.Tensor) -> list[Any]:
        """What :meth:`slot_logits` reads per slot, in slot order: each slot's hidden state ``[B, H]`` (a draft
        that scores all slots jointly first, LiLiCorr's lattice, hands each slot its share of that instead)."""
        return list(hidden.unbind(1))

    def slot_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """One slot's draft logits ``[B, Vd]`` given the token drafted before it (verifier ids ``[B]``)."""
        return self.draft.slot_logits(hidden, prev)

    @staticmethod
    def _pick(
        logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if temperature > 0:
            q_draft = target_probs(logits, temperature, top_p)
            return sample(q_draft, generator), q_draft
        return logits.argmax(dim=-1), None

    def chain(
        self,
        segment: Segment,
        root: torch.Tensor,
        k: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> DraftTree:
        """``k`` tokens from one block: per slot the argmax at temperature 0, else a draw from that slot's own
        tempered distribution, which is the ``q`` rejection sampling checks it against."""
        most = self.max_k(self.config)
        if not 1 <= k <= most:
            raise ValueError(f"k={k}: this block drafter proposes 1 to {most} tokens per step")
        start = time.perf_counter()
        self.read_segment(segment)
        # the root follows the last confirmed position of its row
        root_position = segment.positions.gather(1, segment.last[:, None])[:, 0] + 1
        hidden = self.block_hidden(root, root_position, k)
        choice, q_draft = self.choose(hidden, root, temperature, top_p, generator)
        proposals = None
        if q_draft is not None:  # [B, k, Vd] -> the verifier vocabulary
            proposals = q_draft.new_zeros(*q_draft.shape[:2], self.vocab_size)
            proposals[:, :, self.target_ids] = q_draft
        self.seconds += time.perf_counter() - start
        self.forwards += 1
        return chain_tree(root, self.target_ids[choice], proposals)

    def tree(self, *args: Any, **kwargs: Any) -> DraftTree:
        """Refused (``supports_tree`` is False; the engine says so before decoding): one block is one chain."""
        raise ValueError(
            f"tree drafting is not supported for block drafters ({self.config.SPECULATORS_MODEL_TYPE}): one "
            "forward proposes one chain; use method 'chain'"
        )

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows)


__all__ = ["BlockDrafter", "ContextCache"]
