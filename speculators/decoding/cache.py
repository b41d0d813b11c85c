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


def is_identity_path(path: torch.Tensor) -> bool:
    """Whether every row kept nodes ``0 .. M-1`` in order (a chain step: nothing to move)."""
    return bool((path == torch.arange(path.shape[1], device=path.device)).all())


def gather_path(tensor: torch.Tensor, start: int, stop: int, path: torch.Tensor) -> None:
    """In place on ``[B, H, C, D]``: columns ``start + path[B, M]`` (among ``start .. stop``) move to
    ``start .. start+M``, the accepted path of each row after a verify step."""
    width = path.shape[1]
    index = path[:, None, :, None].expand(tensor.shape[0], tensor.shape[1], width, tensor.shape[3])
    tensor[:, :, start : start + width] = tensor[:, :, start:stop].gather(2, index)


class StaticKV:
    """Per-layer key/value tensors ``[B, H_kv, capacity, D]``, written in place; ``length`` columns are in use.

    The capacity doubles when a write would overflow it (a copy every doubling, not every step)."""

    def __init__(self, layers: int, batch: int, heads: int, head_dim: int, like: torch.Tensor) -> None:
        self.shape = (batch, heads, 0, head_dim)
        self.like = like
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.layers = layers
        self.length = 0
        self.capacity = 0

    def reserve(self, columns: int) -> None:
        """Make room for ``columns`` columns in total."""
        if columns <= self.capacity:
            return
        capacity = max(columns, 2 * self.capacity, 256)
        batch, heads, _, dim = self.shape
        fresh = [self.like.new_empty(batch, heads, capacity, dim) for _ in range(2 * self.layers)]
        for old, new in zip(self.keys + self.values, fresh, strict=False):
            new[:, :, : self.length] = old[:, :, : self.length]
        self.keys, self.values = fresh[: self.layers], fresh[self.layers :]
        self.capacity = capacity

    def keep_path(self, start: int, path: torch.Tensor) -> None:
        """Move each row's node columns ``start + path[B, M]`` to ``start .. start+M`` and drop the rest."""
        if not is_identity_path(path):
            for tensor in self.keys + self.values:
                gather_path(tensor, start, self.length, path)
        self.length = start + path.shape[1]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.shape = (int(rows.shape[0]), *self.shape[1:])


class VerifierCache:
    """The verifier's keys/values plus ``valid[B, C]`` (which columns are real for each row).

    Two backends: a preallocated :class:`StaticKV` written in place by the lean forward (``static``), or an HF
    ``DynamicCache`` grown by the HF forward itself (any other verifier)."""

    def __init__(self, batch: int, device: torch.device, static: StaticKV | None = None) -> None:
        self.static = static
        self.cache = None
        if static is None:
            from transformers import DynamicCache

            self.cache = DynamicCache()
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def visible(self, local: torch.Tensor) -> torch.Tensor:
        """bool ``[B, Q, C + Q]``: every valid cached column, plus ``local[B, Q, Q]`` among the new tokens."""
        batch, queries, _ = local.shape
        cached = self.valid[:, None, :].expand(batch, queries, self.length)
        return torch.cat([cached, local], dim=-1)

    def attention_mask(self, local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The 4D float mask the HF forward takes for ``Q`` new tokens (see :meth:`visible`)."""
        return additive_mask(self.visible(local), dtype)

    def bool_mask(self, local: torch.Tensor) -> torch.Tensor | None:
        """The lean forward's bool ``[B, 1, Q, C + Q]`` mask; None when one new token sees every column (decoding
        a batch without holes: the common batch-1 step, which then needs no mask at all)."""
        if local.shape[1] == 1 and bool(self.valid.all()) and bool(local.all()):
            return None
        return self.visible(local)[:, None]

    def extend(self, valid_new: torch.Tensor) -> None:
        """Record the columns the model just appended."""
        self.valid = torch.cat([self.valid, valid_new], dim=1)

    def keep_path(self, start: int, path: torch.Tensor, keep: torch.Tensor) -> None:
        """After verifying a tree appended at column ``start``: move each row's accepted path (node indices
        ``path[B, M]``, of which ``keep[B, M]`` are real) to columns ``start .. start+M`` and drop the rest."""
        if self.static is not None:
            self.static.keep_path(start, path)
        else:
            self._keep_path_dynamic(start, path)
        self.valid = torch.cat([self.valid[:, :start], keep], dim=1)

    def _keep_path_dynamic(self, start: int, path: torch.Tensor) -> None:
        width = path.shape[1]
        contiguous = is_identity_path(path)
        for layer in self.cache.layers:
            if not contiguous:
                for tensor in (layer.keys, layer.values):
                    gather_path(tensor, start, tensor.shape[2], path)
            layer.keys = layer.keys[:, :, : start + width]
            layer.values = layer.values[:, :, : start + width]

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.static is not None:
            self.static.select_rows(rows)
        else:
            self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]


class DraftCache:
    """The draft's KV cache, filled through ``Eagle3DraftModel.forward``'s ``attend`` callback.

    Columns before ``committed`` hold positions the verifier has confirmed (computed from verifier features, as in
    vLLM); columns after it are the current round's speculative entries, dropped by :meth:`rollback`.
    ``windows[i]``: layer i's sliding window (None: full attention); a windowed layer's query at position p sees
    only the columns whose position is above p - window, as vLLM masks ``sliding_attention`` draft layers.
    """

    def __init__(
        self, num_layers: int, batch: int, device: torch.device, windows: list[int | None] | None = None
    ) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.windows = list(windows or [None] * num_layers)
        self.committed = 0

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def attend_fn(
        self,
        visible: torch.Tensor,
        valid_new: torch.Tensor,
        dtype: torch.dtype,
        positions_new: torch.Tensor,
    ) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """An ``attend`` callback for one draft forward of ``Q`` queries.

        ``visible[B, Q, L + Q]`` says which columns (cached, then new) each query sees; the new keys/values are
        appended to the cache, with ``valid_new[B, Q]`` recording which of them are real and ``positions_new[B, Q]``
        their positions (read by windowed layers).
        """
        self.valid = torch.cat([self.valid, valid_new], dim=1)
        self.positions = torch.cat([self.positions, positions_new], dim=1)
        masks = {
            window: self._window_mask(visible, positions_new, window, dtype) for window in set(self.windows)
        }

        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            mask = masks[self.windows[layer_idx]]
            if self.keys[layer_idx] is not None:
                k = torch.cat([self.keys[layer_idx], k], dim=2)
                v = torch.cat([self.values[layer_idx], v], dim=2)
            self.keys[layer_idx], self.values[layer_idx] = k, v
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
            )

        return attend

    def _window_mask(
        self, visible: torch.Tensor, query_positions: torch.Tensor, window: int | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """``visible`` as an additive mask, narrowed to the columns inside ``window`` of each query's position
        (each query keeps itself: its own column is at distance 0)."""
        if window is not None:
            inside = self.positions[:, None, :] > query_positions[:, :, None] - window
            visible = visible & inside
        return additive_mask(visible, dtype)

    def commit(self, columns: int | None = None) -> None:
        """Mark the first ``columns`` columns (default: all) as confirmed; later ones are speculative."""
        self.committed = self.length if columns is None else int(columns)

    def rollback(self) -> None:
        """Forget the speculative entries written since the last :meth:`commit`."""
        keep = self.committed
        self.keys = [None if k is None else k[:, :, :keep] for k in self.keys]
        self.values = [None if v is None else v[:, :, :keep] for v in self.values]
        self.valid = self.valid[:, :keep]
        self.positions = self.positions[:, :keep]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys = [None if k is None else k[rows] for k in self.keys]
        self.values = [None if v is None else v[rows] for v in self.values]
        self.valid = self.valid[rows]
        self.positions = self.positions[rows]
