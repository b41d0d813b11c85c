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
* ``flex``: ``flex_attention`` over ``cat(K_0..K_j)`` (zero-padded to the unroll's k steps, future steps masked)
  with a block-sparse mask (the block mask holds O(L²/128²) block indices, never a dense mask). CUDA only for
  training (flex has no CPU backward); its forward runs on CPU and is tested against the reference.
* ``dense``: the naive reference that materialises the L × (j+1)·L mask. For tests only.

``auto`` picks ``flex`` on CUDA when available, else ``chunked``: a run-time choice, one code path for the model.

Sliding-window draft layers (``layer_types`` / ``sliding_window``, long-context drafts): step j's query at t has
rope position t + j, as at inference, so it sees the step-0 keys s with t + j - window < s <= t (the keys vLLM keeps
inside the window of position t + j); the chunked kernel then reads only those keys, so a windowed layer costs
O(L · window), not O(L²). The window must exceed the unroll's steps (else a late step would see no context); the
own-slot keys of steps 1..j (positions t+1..t+j) are then always inside it.
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


def document_causal_mask(
    document_ids: torch.Tensor,
    q_start: int,
    q_stop: int,
    k_stop: int,
    window: int | None = None,
    step: int = 0,
    k_start: int = 0,
) -> torch.Tensor:
    """Bool [B, 1, 1, q, k] over keys ``k_start .. k_stop``: key s visible to query t iff s <= t, both lie in the
    same document and, with a ``window``, s > t + step - window (step j's query sits at position t + j)."""
    q_pos = torch.arange(q_start, q_stop, device=document_ids.device)
    k_pos = torch.arange(k_start, k_stop, device=document_ids.device)
    return position_mask(document_ids, q_pos, k_pos, window, step)


def position_mask(
    document_ids: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None = None,
    step: int = 0,
) -> torch.Tensor:
    """:func:`document_causal_mask` for queries and keys at any row indices ``q_pos`` [q] and ``k_pos`` [k] (the
    gathered queries of P-EAGLE's chains sit at scattered positions)."""
    causal = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        causal = causal & (k_pos[None, :] > q_pos[:, None] + step - window)
    same_doc = document_ids[:, q_pos, None] == document_ids[:, None, k_pos]
    return (causal[None] & same_doc)[:, None, None]


def window_start(q_start: int, window: int | None, step: int) -> int:
    """The first key any query of a chunk starting at ``q_start`` can see (0 without a window)."""
    return 0 if window is None else max(0, q_start + step - window + 1)


# ---- the causal part, chunked and exact ----------------------------------------------------------------------
def _causal_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor,
    q_start: int,
    scale: float,
    window: int | None = None,
    step: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query chunk against keys [k_start, q_stop) (k_start > 0 only inside a window): (output [B,Hkv,G,c,D],
    lse [B,Hkv,G,c]) in fp32 softmax."""
    q_stop = q_start + q.shape[-2]
    k_start = window_start(q_start, window, step)
    keys = k[:, :, None, k_start:q_stop]
    values = v[:, :, None, k_start:q_stop]
    mask = document_causal_mask(document_ids, q_start, q_stop, q_stop, window, step, k_start)
    return _masked_softmax_chunk(q, keys, values, mask, scale)


def _masked_softmax_chunk(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query chunk over ``keys`` where ``mask`` allows: (output, log-sum-exp) in fp32 softmax."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(values.dtype)
    return torch.matmul(probs, values), lse


def document_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor,
    chunk_size: int = 256,
    scale: float | None = None,
    window: int | None = None,
    step: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact document-causal attention with its log-sum-exp, in O(L·chunk) transient memory.

    q: [B, H, L, D]; k, v: [B, Hkv, L, D]; document_ids: [B, L] (equal ids = same document; padding gets its own
    id). Returns ``(out [B, H, L, D], lse [B, H, L] float32)``. Every query sees at least itself (with a window,
    as long as ``step < window``), so no row is empty. With gradients enabled each chunk runs under non-reentrant
    checkpointing, so backward recomputes the chunk × L score block instead of keeping all of them.
    """
    if window is not None and step >= window:
        raise ValueError(f"sliding window {window} at TTT step {step}: the query would see no context key")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    grouped = _grouped(q, k.shape[1])
    length = q.shape[-2]
    outs, lses = [], []
    use_checkpoint = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    for start in range(0, length, chunk_size):
        q_chunk = grouped[:, :, :, start : start + chunk_size]
        if use_checkpoint:
            out, lse = checkpoint(
                _causal_chunk, q_chunk, k, v, document_ids, start, scale, window, step, use_reentrant=False
            )
        else:
            out, lse = _causal_chunk(q_chunk, k, v, document_ids, start, scale, window, step)
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
    window: int | None = None,
) -> torch.Tensor:
    """Step j = len(keys) - 1: causal over ``keys[0]`` (same document, inside the window if any) plus the diagonal
    of ``keys[1:]``."""
    step = len(keys) - 1
    out0, lse0 = document_causal_attention(
        q, keys[0], values[0], document_ids, chunk_size, None, window, step
    )
    if len(keys) == 1:
        return out0
    return merge_diagonal(out0, lse0, q, keys[1:], values[1:])


# ---- the reference: a dense (j+1)·L mask, for tests ----------------------------------------------------------
def ttt_mask_dense(document_ids: torch.Tensor, steps: int, window: int | None = None) -> torch.Tensor:
    """Bool [B, L, steps·L]: the full TTT visibility of step ``steps - 1`` queries (quadratic: tests only)."""
    length = document_ids.shape[1]
    blocks = [document_causal_mask(document_ids, 0, length, length, window, steps - 1)[:, 0, 0]]
    eye = torch.eye(length, dtype=torch.bool, device=document_ids.device)
    blocks += [eye.expand(document_ids.shape[0], length, length)] * (steps - 1)
    return torch.cat(blocks, dim=-1)


def dense_ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    document_ids: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Naive reference: concatenate every step's keys and apply the dense mask."""
    mask = ttt_mask_dense(document_ids, len(keys), window)
    key = torch.cat(keys, dim=2)
    value = torch.cat(values, dim=2)
    groups = q.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


# ---- flex attention (CUDA) ----------------------------------------------------------------------------------
# Compiled flex attention is specialised to its shapes (``dynamic=False``); past torch's recompile limit dynamo
# used to fall back SILENTLY to the uncompiled kernel, which materialises the whole score matrix (~15 GB per fp32
# tensor at the 8B recipe) and runs out of memory. So the shapes it sees are a small fixed set: rows padded to a
# bucket (train.data.row_buckets), width ``max_length``, and every TTT step of one unroll over the same key length
# ``total_steps * L`` with the future steps' keys masked out (their blocks are empty: no compute). The only variants
# are then (row bucket) x (training unroll with grad | evaluation unroll without), and the recompile limit is set
# to exactly that count with hitting it made an error (:func:`limit_flex_recompiles`).
def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_COMPILED: dict[tuple[str, str], Callable] = {}


def _compiled(name: str, backend: str | None) -> Callable:
    """``flex_attention`` / ``create_block_mask``, compiled once per backend (``None``: eager, uncompiled).

    ``torch.compile(create_block_mask)`` replaces its deprecated private ``_compile=True`` (which wrapped a new
    ``torch.compile`` on every call); both torch 2.11 and 2.13 support it."""
    from torch.nn.attention import flex_attention as flex

    fn = getattr(flex, name)
    if backend is None:
        return fn
    key = (name, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=backend, dynamic=False)
    return _COMPILED[key]


def limit_flex_recompiles(variants: int) -> None:
    """Allow exactly ``variants`` compiled shapes per function and make one more an error, never a silent fallback
    to the dense kernel. The names differ by torch version (``recompile_limit``/``fail_on_recompile_limit_hit``,
    formerly ``cache_size_limit``/``fail_on_cache_limit_hit``); ``suppress_errors`` would swallow the error. Compiled
    code of earlier runs in this process (a Hydra sweep's previous job, with other shapes) is dropped first: it
    would count too."""
    import torch._dynamo
    import torch._dynamo.config as dynamo_config

    for limit, fail in (
        ("recompile_limit", "fail_on_recompile_limit_hit"),
        ("cache_size_limit", "fail_on_cache_limit_hit"),
    ):
        if hasattr(dynamo_config, limit) and hasattr(dynamo_config, fail):
            break
    else:
        raise RuntimeError(
            f"torch {torch.__version__} cannot make dynamo's recompile limit fatal; compiled flex attention would "
            "fall back silently to a dense kernel past it. Use torch >= 2.6, or train.attention_backend=chunked"
        )
    torch._dynamo.reset()
    setattr(dynamo_config, limit, int(variants))
    setattr(dynamo_config, fail, True)
    dynamo_config.suppress_errors = False


def flex_shape_variants(row_shapes: int) -> int:
    """Compiled shapes of a run: a training unroll (grad) and an evaluation unroll (no grad) per row count."""
    return 2 * row_shapes


def default_compile_backend(device: torch.device) -> str | None:
    """Inductor on CUDA; eager elsewhere (flex has no CPU backward; its CPU forward runs uncompiled)."""
    return "inductor" if device.type == "cuda" else None


def flex_block_mask(
    document_ids: torch.Tensor,
    step: int,
    total_steps: int,
    compile_backend: str | None = "inductor",
    window: int | None = None,
):
    """Block-sparse mask of step ``step`` (0-based) over the key slots ``cat(K_0..K_{total_steps-1})``.

    Slots of steps after ``step`` are masked (zero keys fill them), so every step of an unroll has the same key
    length. ``step`` and ``window`` enter as tensors: a Python int in the closure would be a guard, one compile per
    step (no window: one longer than any distance, so windowed and full layers share the compiled mask)."""
    batch, length = document_ids.shape
    current = torch.tensor(step, device=document_ids.device)
    span = torch.tensor(window if window is not None else length + total_steps, device=document_ids.device)

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // length
        pos = kv_idx % length
        causal = (
            (pos <= q_idx) & (pos > q_idx + current - span) & (document_ids[b, pos] == document_ids[b, q_idx])
        )
        return torch.where(block == 0, causal, (pos == q_idx) & (block <= current))

    create = _compiled("create_block_mask", compile_backend)
    return create(mask_mod, batch, None, length, total_steps * length, device=document_ids.device)


def padded_step_keys(keys: list[torch.Tensor], total_steps: int) -> torch.Tensor:
    """``cat(keys)`` followed by zero slots up to ``total_steps`` (masked by :func:`flex_block_mask`)."""
    missing = total_steps - len(keys)
    if missing < 0:
        raise ValueError(f"{len(keys)} TTT steps of keys, but the unroll was set up for {total_steps}")
    filler = [keys[0].new_zeros(keys[0].shape)] * missing
    return torch.cat([*keys, *filler], dim=2)


def flex_ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    document_ids: torch.Tensor,
    total_steps: int | None = None,
    block_mask=None,
    compile_backend: str | None = "auto",
    window: int | None = None,
) -> torch.Tensor:
    """flex_attention of step ``len(keys) - 1`` over the step keys padded to ``total_steps`` (default: no
    padding) with the TTT block mask; compiled with ``compile_backend`` (``auto``: inductor on CUDA, else eager)."""
    if compile_backend == "auto":
        compile_backend = default_compile_backend(q.device)
    total_steps = total_steps or len(keys)
    if block_mask is None:
        block_mask = flex_block_mask(document_ids, len(keys) - 1, total_steps, compile_backend, window)
    key = padded_step_keys(keys, total_steps)
    value = padded_step_keys(values, total_steps)
    flex = _compiled("flex_attention", compile_backend)
    return flex(q, key, value, block_mask=block_mask, enable_gqa=q.shape[1] != key.shape[1])


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
    ``total_steps`` (the unroll's length) fixes flex's key length; ``compile_backend`` picks flex's compiler.
    ``windows[i]``: draft layer i's sliding window (None or missing: full attention; see the module docstring).
    """

    def __init__(
        self,
        document_ids: torch.Tensor,
        backend: str = "auto",
        chunk_size: int = 256,
        total_steps: int | None = None,
        compile_backend: str | None = "auto",
        windows: list[int | None] | None = None,
    ) -> None:
        self.document_ids = document_ids
        self.windows = list(windows or [])
        self.backend = resolve_backend(backend, document_ids.device)
        self.chunk_size = chunk_size
        self.total_steps = total_steps
        if compile_backend == "auto":
            compile_backend = default_compile_backend(document_ids.device)
        self.compile_backend = compile_backend
        self._keys: dict[int, list[torch.Tensor]] = {}
        self._values: dict[int, list[torch.Tensor]] = {}
        self._block_masks: dict[tuple[int, int | None], object] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = self._keys.setdefault(layer_idx, [])
        values = self._values.setdefault(layer_idx, [])
        keys.append(k)
        values.append(v)
        window = self.windows[layer_idx] if layer_idx < len(self.windows) else None
        if self.backend == "chunked":
            return chunked_ttt_attention(q, keys, values, self.document_ids, self.chunk_size, window)
        if self.backend == "dense":
            return dense_ttt_attention(q, keys, values, self.document_ids, window)
        step, total = len(keys) - 1, self.total_steps or len(keys)
        if (step, window) not in self._block_masks:  # shared by every layer of this step and window
            self._block_masks[step, window] = flex_block_mask(
                self.document_ids, step, total, self.compile_backend, window
            )
        return flex_ttt_attention(
            q, keys, values, self.document_ids, total, self._block_masks[step, window], self.compile_backend
        )


# ---- gathered elements: P-EAGLE's sampled chains ------------------------------------------------------------
# Training P-EAGLE scores depth d >= 1 only at the elements COD sampled (train/objectives/peagle.py), so
# its unroll computes depth 0 at every position and depth d only at those elements. Element (t, d) sees what it
# sees in the full unroll: the depth-0 keys of positions <= t of its document (chunked, exact) merged with the keys
# of (t, 1..d) (:func:`merge_diagonal`). The element sets are prefix-closed ((t, d) computed => (t, d-1) computed),
# so every diagonal key exists. Memory: O(N) for N elements plus one transient chunk × L score block.
class GatheredElements:
    """The elements of one depth: flat indices ``row · L + t`` (sorted), their rows and positions on the device,
    and the query chunks (``start, stop, row, keys``: ints, one row per chunk, its queries see keys ``< keys``)."""

    def __init__(self, flat: torch.Tensor, length: int, device: torch.device, chunk_size: int) -> None:
        flat_cpu = flat.cpu()
        self.flat = flat_cpu.to(device)
        self.count = flat_cpu.numel()
        self.positions = self.flat % length
        rows_cpu = (flat_cpu // length).tolist()
        positions_cpu = (flat_cpu % length).tolist()
        self.chunks: list[tuple[int, int, int, int]] = []
        start = 0
        while start < self.count:
            stop = min(start + chunk_size, self.count)
            while rows_cpu[stop - 1] != rows_cpu[start]:  # a chunk never spans two rows
                stop -= 1
            self.chunks.append((start, stop, rows_cpu[start], positions_cpu[stop - 1] + 1))
            start = stop

    def index_in(self, earlier: GatheredElements) -> torch.Tensor:
        """Where each of these elements sits among ``earlier``'s (same anchors one depth or more lower)."""
        return torch.searchsorted(earlier.flat, self.flat)


def _gathered_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor,
    q_pos: torch.Tensor,
    k_stop: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries of one row at positions ``q_pos`` (q [1,Hkv,G,c,D]) against that row's depth-0 keys ``< k_stop``
    (k, v [1,Hkv,L,D]; document_ids [1, L])."""
    k_pos = torch.arange(k_stop, device=q_pos.device)
    mask = position_mask(document_ids, q_pos, k_pos)
    return _masked_softmax_chunk(q, k[:, :, None, :k_stop], v[:, :, None, :k_stop], mask, scale)


def gathered_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor,
    elements: GatheredElements,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Document-causal attention of gathered queries q [1, H, N, D] (query i at ``elements``' row and position i)
    over their rows' depth-0 keys k, v [B, Hkv, L, D]: ``(out [1, H, N, D], lse [1, H, N] float32)``, a chunk of
    one row's queries at a time, checkpointed like :func:`document_causal_attention`."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    grouped = _grouped(q, k.shape[1])
    use_checkpoint = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs, lses = [], []
    for start, stop, row, keys in elements.chunks:
        args = (
            grouped[:, :, :, start:stop],
            k[row : row + 1],
            v[row : row + 1],
            document_ids[row : row + 1],
            elements.positions[start:stop],
            keys,
            scale,
        )
        out, lse = (
            checkpoint(_gathered_chunk, *args, use_reentrant=False)
            if use_checkpoint
            else _gathered_chunk(*args)
        )
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, dim=3), torch.cat(lses, dim=3)
    batch, kv_heads, group, length = lse.shape
    return _ungrouped(out), lse.reshape(batch, kv_heads * group, length)


class ChainAttention:
    """The ``attend(layer_idx, q, k, v)`` callback of an unroll whose depth 0 runs at every position of the batch
    (:class:`TTTAttention`'s step 0, any backend) and whose depth d >= 1 runs only at ``elements[d - 1]``: flat
    ``row · L + t`` indices, sorted and prefix-closed (the draft's depth-d forward is over ``[1, N_d]``)."""

    def __init__(
        self,
        document_ids: torch.Tensor,
        elements: list[torch.Tensor],
        backend: str = "auto",
        chunk_size: int = 256,
    ) -> None:
        self.document_ids = document_ids
        self.depth0 = TTTAttention(document_ids, backend, chunk_size, total_steps=1)
        length, device = document_ids.shape[1], document_ids.device
        self.elements = [GatheredElements(flat, length, device, chunk_size) for flat in elements]
        # diagonal[d][i]: where depth d's elements sit among depth i+1's (i + 1 < d)
        self.diagonal = [
            [e.index_in(self.elements[i]) for i in range(d)] for d, e in enumerate(self.elements)
        ]
        self._keys: dict[int, list[torch.Tensor]] = {}
        self._values: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = self._keys.setdefault(layer_idx, [])
        values = self._values.setdefault(layer_idx, [])
        depth = len(keys)
        keys.append(k)
        values.append(v)
        if depth == 0:
            return self.depth0(layer_idx, q, k, v)
        elements = self.elements[depth - 1]
        if elements.count == 0:  # no chain reached this depth: an empty output, still in the graph
            return q * 0
        out0, lse0 = gathered_causal_attention(q, keys[0], values[0], self.document_ids, elements)
        where = self.diagonal[depth - 1]
        diagonal_keys = [keys[i + 1][:, :, index] for i, index in enumerate(where)] + [k]
        diagonal_values = [values[i + 1][:, :, index] for i, index in enumerate(where)] + [v]
        return merge_diagonal(out0, lse0, q, diagonal_keys, diagonal_values)


__all__ = [
    "BACKENDS",
    "ChainAttention",
    "GatheredElements",
    "TTTAttention",
    "chunked_ttt_attention",
    "dense_ttt_attention",
    "document_causal_attention",
    "flex_block_mask",
    "flex_shape_variants",
    "flex_ttt_attention",
    "gathered_causal_attention",
    "limit_flex_recompiles",
    "merge_diagonal",
    "ttt_mask_dense",
]
