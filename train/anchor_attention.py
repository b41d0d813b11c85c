"""Anchor-block attention with ``flex_attention``: the block drafters' training kernel on CUDA
(train/objectives/dflash.py and its variants).

Every sampled anchor t of a micro batch owns one block of ``S`` slots; a slot's query sees

* the injected context features of its anchor's prefix: columns s <= t of the anchor's own row and document (and,
  in a sliding layout, with position > the slot's position - window), and
* its own block's slots: all of them, or only the earlier ones when the config's blocks are causal.

Here the whole micro batch is ONE flex problem: the queries are the anchors' slots laid end to end
(``[1, H, P·S, D]``, P = the padded anchor count), the keys are every row's context followed by every block's keys
(``[1, Hkv, R·L + P·S, D]``), and :func:`anchor_mask_mod` encodes the rule above, turned into a block-sparse
``BlockMask`` once per micro batch and shared by every layer. Nothing the size of a score matrix is kept: flex
saves q, the concatenated keys/values, its output and log-sum-exp for backward, all linear in the anchors
(:func:`flex_held_bytes`; the block mask's indices are ``(P·S/128)·((R·L + P·S)/128)`` int32s, a few hundred KB
at the 8B recipes).

Fixed shapes: compiled flex (``dynamic=False``) is specialised to its shapes, and the trainer makes a recompile past
the row buckets fatal (:func:`train.ttt_attention.limit_flex_recompiles`). So the anchors are padded to
``block.max_anchors`` (a padded anchor sees only its own zero block, never a context key, so no row of the softmax
is empty and its output is dropped), and rows are already padded to a bucket. Evaluation anchors every valid
position (a varying count) and has no backward, so it runs the chunked kernel.

On CPU (torch 2.13) flex attention runs forward only, eager or compiled; its backward raises ``NotImplementedError``
("FlexAttention does not support backward on CPU"), so training on CPU uses the chunked kernel
(:func:`train.objectives.dflash.anchored_attention`), ``auto`` picks it, and forcing flex fails at start-up
(:func:`train.ttt_attention.resolve_backend`). The CPU tests compare flex's forward and its mask with the chunked
path; ``scripts/gpu_check.py`` compares training steps (values and gradients) on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from train.ttt_attention import _compiled, default_compile_backend

BLOCK = 128  # flex's default sparse block size (create_block_mask's Q_BLOCK_SIZE and KV_BLOCK_SIZE)


def padded(values: torch.Tensor, count: int, fill: int) -> torch.Tensor:
    """``values`` (anchors first) extended to ``count`` anchors with ``fill``."""
    missing = count - values.shape[0]
    if missing < 0:
        raise ValueError(f"{values.shape[0]} anchors, but the flex shapes were set up for {count}")
    return torch.cat([values, values.new_full((missing, *values.shape[1:]), fill)])


def anchor_mask_mod(
    anchor_rows: torch.Tensor,
    anchor_cols: torch.Tensor,
    document_ids: torch.Tensor,
    position_ids: torch.Tensor,
    block_positions: torch.Tensor,
    causal: bool,
    window: int | None,
):
    """The ``mask_mod(b, h, q_idx, kv_idx)`` of one micro batch (module docstring).

    ``anchor_rows``/``anchor_cols [P]`` (-1: a padded anchor), ``document_ids``/``position_ids [R, L]`` of the
    packed rows, ``block_positions [P, S]`` the slots' rope positions. Every index is clamped into range: a
    mask_mod is evaluated on every (q, kv) pair, both branches of each ``where`` included."""
    rows, length = document_ids.shape
    anchors, slots = block_positions.shape
    context = rows * length
    real = anchor_rows >= 0
    safe_rows, safe_cols = anchor_rows.clamp(min=0), anchor_cols.clamp(min=0)
    anchor_docs = document_ids[safe_rows, safe_cols]

    def mask_mod(b, h, q_idx, kv_idx):
        anchor = (q_idx // slots).clamp(max=anchors - 1)
        slot = q_idx % slots
        key_row = (kv_idx // length).clamp(max=rows - 1)
        key_col = kv_idx % length
        row = safe_rows[anchor]
        seen = (kv_idx < context) & real[anchor] & (key_row == row) & (key_col <= safe_cols[anchor])
        seen = seen & (document_ids[key_row, key_col] == anchor_docs[anchor])
        if window is not None:
            seen = seen & (position_ids[key_row, key_col] > block_positions[anchor, slot] - window)
        block_key = (kv_idx - context).clamp(min=0)
        own = (kv_idx >= context) & ((block_key // slots).clamp(max=anchors - 1) == anchor)
        if causal:
            own = own & (block_key % slots <= slot)
        return seen | own

    return mask_mod


def anchor_block_mask(
    rows: torch.Tensor,
    cols: torch.Tensor,
    document_ids: torch.Tensor,
    position_ids: torch.Tensor,
    block_positions: torch.Tensor,
    causal: bool,
    window: int | None,
    padded_anchors: int,
    compile_backend: str | None,
):
    """The micro batch's ``BlockMask`` over ``P·S`` queries and ``R·L + P·S`` keys (``P = padded_anchors``),
    built by ``create_block_mask`` (compiled with ``compile_backend``; ``None``: eager, which evaluates the mask
    densely: CPU tests only)."""
    slots = block_positions.shape[1]
    mask_mod = anchor_mask_mod(
        padded(rows, padded_anchors, -1),
        padded(cols, padded_anchors, -1),
        document_ids,
        position_ids,
        padded(block_positions, padded_anchors, 0),
        causal,
        window,
    )
    create = _compiled("create_block_mask", compile_backend)
    queries, keys = padded_anchors * slots, document_ids.numel() + padded_anchors * slots
    return create(mask_mod, None, None, queries, keys, device=document_ids.device)


def as_sequence(x: torch.Tensor, count: int) -> torch.Tensor:
    """``[N, heads, T, D]`` (N anchors or rows) → ``[1, heads, count·T, D]``, zero-padded to ``count``."""
    x = padded(x, count, 0)
    return x.transpose(0, 1).reshape(1, x.shape[1], -1, x.shape[-1])


class FlexAnchorAttention:
    """The ``attend(layer_idx, q, k, v)`` callback of one micro batch's blocks: ``q [N, H, S, D]``, block
    ``k``/``v [N, Hkv, S, D]`` against ``context_kv[layer_idx]`` (``[R, Hkv, L, D]`` each) under one shared
    block mask (:func:`anchor_block_mask`)."""

    def __init__(
        self, context_kv: list[tuple[torch.Tensor, torch.Tensor]], block_mask: Any, padded_anchors: int,
        compile_backend: str | None,
    ) -> None:  # fmt: skip
        self.context_kv = context_kv
        self.block_mask = block_mask
        self.padded_anchors = padded_anchors
        self.compile_backend = compile_backend

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        anchors, heads, slots, dim = q.shape
        ctx_k, ctx_v = self.context_kv[layer_idx]
        rows = ctx_k.shape[0]
        # one dtype for flex: under bf16 autocast the q/k norms leave q and k in fp32 while v is bf16 (the chunked
        # kernel's einsums are autocast instead)
        dtype = v.dtype
        keys = torch.cat([as_sequence(ctx_k, rows), as_sequence(k, self.padded_anchors)], dim=2).to(dtype)
        values = torch.cat([as_sequence(ctx_v, rows), as_sequence(v, self.padded_anchors)], dim=2).to(dtype)
        flex = _compiled("flex_attention", self.compile_backend)
        out = flex(
            as_sequence(q, self.padded_anchors).to(dtype), keys, values, block_mask=self.block_mask,
            enable_gqa=heads != keys.shape[1],
        )  # fmt: skip
        return out.view(heads, self.padded_anchors, slots, dim)[:, :anchors].transpose(0, 1)


def flex_anchor_attention(
    context_kv: list[tuple[torch.Tensor, torch.Tensor]],
    rows: torch.Tensor,
    cols: torch.Tensor,
    document_ids: torch.Tensor,
    position_ids: torch.Tensor,
    block_positions: torch.Tensor,
    causal: bool,
    window: int | None,
    padded_anchors: int,
    compile_backend: str | None = "auto",
) -> FlexAnchorAttention:
    """The flex callback of one micro batch (``compile_backend`` ``auto``: inductor on CUDA, eager elsewhere)."""
    if compile_backend == "auto":
        compile_backend = default_compile_backend(document_ids.device)
    block_mask = anchor_block_mask(
        rows,
        cols,
        document_ids,
        position_ids,
        block_positions,
        causal,
        window,
        padded_anchors,
        compile_backend,
    )
    return FlexAnchorAttention(context_kv, block_mask, padded_anchors, compile_backend)


def flex_held_bytes(
    rows: int, length: int, anchors: int, slots: int, draft_config: Any, dtype: torch.dtype
) -> dict[str, int]:
    """What flex attention keeps for backward beyond the chunked kernel's trace (which the memory plan runs), per
    micro batch, split by what it scales with:

    * ``context``: the copy of every row's context keys and values flex reads as one sequence, per draft layer
      (``2 · R·L · Hkv · D``), independent of the anchors;
    * ``anchors``: per layer its output ``P·S · H · D`` (saved for backward; the chunked kernel recomputes its
      chunks) and log-sum-exp ``P·S · H`` fp32: linear in the anchors (the queries and block keys it saves are
      the same bytes the chunked kernel saves);
    * ``block_mask``: the BlockMask's int32 indices (kv and q directions, partial and full blocks), shared by the
      layers: ``4 · ceil(P·S/128) · ceil((R·L + P·S)/128)`` entries, quadratic in the anchors only through
      128-token blocks (negligible: hundreds of KB at the 8B recipes)."""
    layer = draft_config.transformer_layer_config
    heads = int(layer["num_attention_heads"])
    kv_heads = int(layer.get("num_key_value_heads") or heads)
    dim, layers, size = int(draft_config.head_dim), int(draft_config.num_layers), dtype.itemsize
    queries = anchors * slots
    q_blocks, kv_blocks = -(-queries // BLOCK), -(-(rows * length + queries) // BLOCK)
    return {
        "context": layers * 2 * rows * length * kv_heads * dim * size,
        "anchors": layers * queries * heads * (dim * size + 4),
        "block_mask": 4 * q_blocks * kv_blocks * 4,
    }


__all__ = [
    "FlexAnchorAttention",
    "anchor_block_mask",
    "anchor_mask_mod",
    "flex_anchor_attention",
    "flex_held_bytes",
]
