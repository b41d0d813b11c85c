"""Training-time-test (TTT) attention in linear memory.

During a k-step TTT unroll, drafting step j (0-based) at position t attends to

* the step-0 keys of positions s <= t of the SAME document (ordinary causal attention over the verifier-fed
  context), and
* for every earlier-or-current step i in 1..j, only the key of its own slot t (what the draft produced there).

Drawn as one (k·L)² matrix the later-step blocks are diagonals, so materialising it (or even an L × (j+1)·L mask
per head) wastes memory quadratically. Here each step needs only:

* ``chunked``: the causal part computed exactly, a chunk of queries at a time, each chunk under
  ``torch.utils.checkpoint`` (only q/k/v and the chunk's output + log-sum-exp are kept; the chunk × L score block
  is recomputed in backward), then merged with the j diagonal scores through a log-sum-exp combination. Extra
  memory O(k·L) plus one transient chunk × L block. Runs anywhere (CPU included), exact in fp32.
* ``flex``: ``flex_attention`` over ``cat(K_0..K_j)`` with a block-sparse mask (the block mask holds O(L²/128²)
  block indices, never a dense mask). CUDA only for training (flex has no CPU backward); its forward runs on CPU
  and is tested against the reference.
* ``dense``: the naive reference that materialises the L × (j+1)·L mask. For tests only.

``auto`` picks ``flex`` on CUDA when available, else ``chunked``: a run-time choice, one code path for the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

BACKENDS = ("auto", "chunked", "flex", "dense")


# ---- helpers ------------------------------------------------------------------------------------------------
def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, H, L, D] → [B, Hkv, G, L, D] so that GQA needs no repeat of k/v."""
    batch, heads, length, dim = q.shape
    return q.view(batch, num_kv_heads, heads // num_kv_heads, length, dim)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    batch, kv_heads, group, length, dim = x.shape
    return x.reshape(batch, kv_heads * group, length, dim)


def document_causal_mask(document_ids: torch.Tensor, q_start: int, q_stop: int, k_stop: int) -> torch.Tensor:
    """Bool [B, 1, 1, q, k]: key s visible to query t iff s <= t and both lie in the same document."""
    q_pos = torch.arange(q_start, q_stop, device=document_ids.device)
    k_pos = torch.arange(0, k_stop, device=document_ids.device)
    causal = k_pos[None, :] <= q_pos[:, None]
    same_doc = document_ids[:, q_start:q_stop, None] == document_ids[:, None, :k_stop]
    return (causal[None] & same_doc)[:, None, None]


# ---- the causal part, chunked and exact ----------------------------------------------------------------------
def _causal_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, q_start: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query chunk against keys [0, q_stop): (output [B,Hkv,G,c,D], lse [B,Hkv,G,c]) in fp32 softmax."""
    q_stop = q_start + q.shape[-2]
    keys = k[:, :, None, :q_stop]
    values = v[:, :, None, :q_stop]
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
    mask = document_causal_mask(document_ids, q_start, q_stop, q_stop)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return torch.matmul(probs, values), lse


def document_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor,
    chunk_size: int = 256,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact document-causal attention with its log-sum-exp, in O(L·chunk) transient memory.

    q: [B, H, L, D]; k, v: [B, Hkv, L, D]; document_ids: [B, L] (equal ids = same document; padding gets its own
    id). Returns ``(out [B, H, L, D], lse [B, H, L] float32)``. Every query sees at least itself, so no row is
    empty. With gradients enabled each chunk runs under non-reentrant checkpointing, so backward recomputes the
    chunk × L score block instead of keeping all of them.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    grouped = _grouped(q, k.shape[1])
    length = q.shape[-2]
    outs, lses = [], []
    use_checkpoint = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    for start in range(0, length, chunk_size):
        q_chunk = grouped[:, :, :, start : start + chunk_size]
        if use_checkpoint:
            out, lse = checkpoint(
                _causal_chunk, q_chunk, k, v, document_ids, start, scale, use_reentrant=False
            )
        else:
            out, lse = _causal_chunk(q_chunk, k, v, document_ids, start, scale)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=3)
    lse = torch.cat(lses, dim=3)
    batch, kv_heads, group, _ = lse.shape
    return _ungrouped(out), lse.reshape(batch, kv_heads * group, length)


def merge_diagonal(
    out0: torch.Tensor,
    lse0: torch.Tensor,
    q: torch.Tensor,
    diagonal_keys: list[torch.Tensor],
    diagonal_values: list[torch.Tensor],
    scale: float | None = None,
) -> torch.Tensor:
    """Add the later-step "own slot" keys to a causal result: softmax over [causal keys, k_1[t], ..., k_j[t]].

    With ``m = max(lse0, s_1..s_j)``: ``out = (e^{lse0-m}·out0 + Σ e^{s_i-m}·v_i[t]) / (e^{lse0-m} + Σ e^{s_i-m})``,
    exactly the softmax over the union of keys, in O(j·L) memory.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kv_heads = diagonal_keys[0].shape[1] if diagonal_keys else q.shape[1]
    grouped = _grouped(q, kv_heads)
    diag_scores = [(grouped * k_i[:, :, None]).sum(-1).float() * scale for k_i in diagonal_keys]
    batch, heads, length = lse0.shape
    lse0_g = lse0.view(batch, kv_heads, heads // kv_heads, length)
    peak = torch.stack([lse0_g, *diag_scores]).amax(dim=0).detach()
    weight0 = torch.exp(lse0_g - peak)
    weights = [torch.exp(s - peak) for s in diag_scores]
    total = weight0 + sum(weights)
    acc = _grouped(out0, kv_heads).float() * weight0[..., None]
    for w_i, v_i in zip(weights, diagonal_values, strict=True):
        acc = acc + w_i[..., None] * v_i[:, :, None].float()
    return _ungrouped((acc / total[..., None]).to(out0.dtype))


def chunked_ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    document_ids: torch.Tensor,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Step j = len(keys) - 1: causal over ``keys[0]`` (same document) plus the diagonal of ``keys[1:]``."""
    out0, lse0 = document_causal_attention(q, keys[0], values[0], document_ids, chunk_size)
    if len(keys) == 1:
        return out0
    return merge_diagonal(out0, lse0, q, keys[1:], values[1:])


# ---- the reference: a dense (j+1)·L mask, for tests ----------------------------------------------------------
def ttt_mask_dense(document_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Bool [B, L, steps·L]: the full TTT visibility of step ``steps - 1`` queries (quadratic: tests only)."""
    length = document_ids.shape[1]
    blocks = [document_causal_mask(document_ids, 0, length, length)[:, 0, 0]]
    eye = torch.eye(length, dtype=torch.bool, device=document_ids.device)
    blocks += [eye.expand(document_ids.shape[0], length, length)] * (steps - 1)
    return torch.cat(blocks, dim=-1)


def dense_ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], document_ids: torch.Tensor
) -> torch.Tensor:
    """Naive reference: concatenate every step's keys and apply the dense mask."""
    mask = ttt_mask_dense(document_ids, len(keys))
    key = torch.cat(keys, dim=2)
    value = torch.cat(values, dim=2)
    groups = q.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


# ---- flex attention (CUDA) ----------------------------------------------------------------------------------
def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_COMPILED_FLEX: Callable | None = None


def _flex_fn(compiled: bool) -> Callable:
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def flex_block_mask(document_ids: torch.Tensor, steps: int, compiled: bool = True):
    """Block-sparse mask for step ``steps - 1`` over ``cat(K_0..K_{steps-1})`` (no dense mask is built)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, length = document_ids.shape

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // length
        pos = kv_idx % length
        causal = (pos <= q_idx) & (document_ids[b, pos] == document_ids[b, q_idx])
        return torch.where(block == 0, causal, pos == q_idx)

    return create_block_mask(
        mask_mod, batch, None, length, steps * length, device=document_ids.device, _compile=compiled
    )


def flex_ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    document_ids: torch.Tensor,
    block_mask=None,
    compiled: bool | None = None,
) -> torch.Tensor:
    """flex_attention over the concatenated step keys with the TTT block mask (compiled on CUDA)."""
    compiled = q.is_cuda if compiled is None else compiled
    if block_mask is None:
        block_mask = flex_block_mask(document_ids, len(keys), compiled)
    key = torch.cat(keys, dim=2)
    value = torch.cat(values, dim=2)
    return _flex_fn(compiled)(q, key, value, block_mask=block_mask, enable_gqa=q.shape[1] != key.shape[1])


# ---- the callback the draft model calls ---------------------------------------------------------------------
def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"train.attention_backend {backend!r}: use one of {BACKENDS}")
    if backend == "auto":
        return "flex" if device.type == "cuda" and flex_available() else "chunked"
    if backend == "flex" and device.type != "cuda" and torch.is_grad_enabled():
        raise ValueError(
            "flex attention cannot train on CPU (no backward there); use attention_backend=chunked"
        )
    return backend


class TTTAttention:
    """The ``attend(layer_idx, q, k, v)`` callback for one TTT unroll over a batch.

    Each call appends that layer's k/v for the current step; the step index of a call is how many k/v the layer
    already holds. Create a fresh instance per batch (it keeps the unroll's keys alive for backward anyway).
    """

    def __init__(self, document_ids: torch.Tensor, backend: str = "auto", chunk_size: int = 256) -> None:
        self.document_ids = document_ids
        self.backend = resolve_backend(backend, document_ids.device)
        self.chunk_size = chunk_size
        self._keys: dict[int, list[torch.Tensor]] = {}
        self._values: dict[int, list[torch.Tensor]] = {}
        self._block_masks: dict[int, object] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = self._keys.setdefault(layer_idx, [])
        values = self._values.setdefault(layer_idx, [])
        keys.append(k)
        values.append(v)
        if self.backend == "chunked":
            return chunked_ttt_attention(q, keys, values, self.document_ids, self.chunk_size)
        if self.backend == "dense":
            return dense_ttt_attention(q, keys, values, self.document_ids)
        steps = len(keys)
        if steps not in self._block_masks:  # shared by every layer of this step
            self._block_masks[steps] = flex_block_mask(self.document_ids, steps, compiled=q.is_cuda)
        return flex_ttt_attention(q, keys, values, self.document_ids, self._block_masks[steps])


__all__ = [
    "BACKENDS",
    "TTTAttention",
    "chunked_ttt_attention",
    "dense_ttt_attention",
    "document_causal_attention",
    "flex_ttt_attention",
    "merge_diagonal",
    "ttt_mask_dense",
]
