"""KV caches for the verifier and the draft, with per-row validity so rows of a batch can accept different numbers
of tokens without re-aligning anything.

Both caches share one column layout across the batch. A column that is not part of a row's sequence (left padding
of a short prompt, or the tail of a step in which this row accepted fewer tokens than another row) is marked
invalid for that row and masked out of every later attention. Positions are tracked per row, so rotary embeddings
never see the holes. This trades a little attention over masked columns for never copying the cache to re-pad it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool ``[B, Q, K]`` → float ``[B, 1, Q, K]`` with 0 where allowed and the dtype's minimum elsewhere.

    A float mask, not a boolean one: eager attention ADDS the mask, so a boolean 4D mask would be silently wrong
    there (docs/environment.md); sdpa accepts either. The minimum (not -inf) keeps fully masked rows finite.
    """
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


class VerifierCache:
    """An HF ``DynamicCache`` plus ``valid[B, C]`` (which columns are real for each row)."""

    def __init__(self, batch: int, device: torch.device) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def attention_mask(self, local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The 4D mask for ``Q`` new tokens: every valid cached column, plus ``local[B, Q, Q]`` among the new ones."""
        batch, queries, _ = local.shape
        cached = self.valid[:, None, :].expand(batch, queries, self.length)
        return additive_mask(torch.cat([cached, local], dim=-1), dtype)

    def extend(self, valid_new: torch.Tensor) -> None:
        """Record the columns the model just appended (the forward itself grew the DynamicCache)."""
        self.valid = torch.cat([self.valid, valid_new], dim=1)

    def keep_path(self, start: int, path: torch.Tensor, keep: torch.Tensor) -> None:
        """After verifying a tree appended at column ``start``: move each row's accepted path (node indices
        ``path[B, M]``, of which ``keep[B, M]`` are real) to columns ``start .. start+M`` and drop the rest."""
        width = path.shape[1]
        contiguous = bool((path == torch.arange(width, device=path.device)).all())
        for layer in self.cache.layers:
            if not contiguous:
                for name in ("keys", "values"):
                    tensor = getattr(layer, name)
                    index = path[:, None, :, None].expand(
                        tensor.shape[0], tensor.shape[1], width, tensor.shape[3]
                    )
                    tensor[:, :, start : start + width] = tensor[:, :, start:].gather(2, index)
            layer.keys = layer.keys[:, :, : start + width]
            layer.values = layer.values[:, :, : start + width]
        self.valid = torch.cat([self.valid[:, :start], keep], dim=1)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]


class DraftCache:
    """The draft's KV cache, filled through ``Eagle3DraftModel.forward``'s ``attend`` callback.

    Columns before ``committed`` hold positions the verifier has confirmed (computed from verifier features, as in
    vLLM); columns after it are the current round's speculative entries, dropped by :meth:`rollback`.
    """

    def __init__(self, num_layers: int, batch: int, device: torch.device) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.committed = 0

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def attend_fn(
        self, visible: torch.Tensor, valid_new: torch.Tensor, dtype: torch.dtype
    ) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """An ``attend`` callback for one draft forward of ``Q`` queries.

        ``visible[B, Q, L + Q]`` says which columns (cached, then new) each query sees; the new keys/values are
        appended to the cache, with ``valid_new[B, Q]`` recording which of them are real.
        """
        mask = additive_mask(visible, dtype)
        self.valid = torch.cat([self.valid, valid_new], dim=1)

        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self.keys[layer_idx] is not None:
                k = torch.cat([self.keys[layer_idx], k], dim=2)
                v = torch.cat([self.values[layer_idx], v], dim=2)
            self.keys[layer_idx], self.values[layer_idx] = k, v
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
            )

        return attend

    def commit(self) -> None:
        self.committed = self.length

    def rollback(self) -> None:
        """Forget the speculative entries written since the last :meth:`commit`."""
        keep = self.committed
        self.keys = [None if k is None else k[:, :, :keep] for k in self.keys]
        self.values = [None if v is None else v[:, :, :keep] for v in self.values]
        self.valid = self.valid[:, :keep]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys = [None if k is None else k[rows] for k in self.keys]
        self.values = [None if v is None else v[rows] for v in self.values]
        self.valid = self.valid[rows]
