"""A lean decode-time forward for Llama-family verifiers (Llama, Qwen3) over a preallocated KV cache.

Why: at batch 1 a 135M-parameter verifier spends a share of each decode step outside its matmuls, in the HF module
stack (per-layer module calls, mask construction, ``DynamicCache`` concatenation, kwargs plumbing), and its matmuls
run slower than they could. This forward runs the same formulas with the model's weights and its own rotary tables
(``rotary_emb``), as a flat loop of tensor ops: the keys and values are written in place into a :class:`StaticKV`,
the attention mask is skipped when every cached column is visible to the one new query, the auxiliary hidden states
EAGLE-3 reads are collected on the way instead of through forward hooks, and on CPU the projections use transposed,
fused weight copies (see :class:`_Proj`).

Anything it does not recognise (other architectures, sliding windows, biases on the MLP projections) keeps
the HF path: :func:`lean_supported` decides, and the engine falls back to the HF forward, so this is a pure speed-up.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speculators.decoding.cache import StaticKV

SUPPORTED_TYPES = ("llama", "qwen3")


def lean_supported(model: nn.Module) -> bool:
    """Whether :class:`LeanForward` reproduces ``model``'s forward (else the engine uses the HF forward)."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None or getattr(config, "model_type", None) not in SUPPORTED_TYPES:
        return False
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    if getattr(model, "lm_head", None) is None or getattr(model, "logits_scaling", None):
        return False
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "sliding_window", None) or any(
            getattr(mlp, name).bias is not None for name in ("gate_proj", "up_proj", "down_proj")
        ):
            return False
    return True


class _Proj:
    """One projection: ``F.linear`` on the HF weight, or, packed, ``x @ W^T`` on a transposed (and possibly fused)
    copy. Why the copy: on this CPU MKL runs ``x @ W^T`` with a contiguous ``W^T`` about 10 % faster than
    ``F.linear`` for one token and 25-30 % faster for the 2-8 tokens of a verify step (measured on SmolLM2's
    shapes, single thread); the price is a second copy of the weights in memory, made once per model."""

    def __init__(self, weights: Sequence[nn.Linear], packed: bool) -> None:
        self.packed = packed
        biases = [m.bias for m in weights]
        if packed:
            self.weight = torch.cat([m.weight for m in weights]).t().contiguous()
            self.bias = None if biases[0] is None else torch.cat(biases)
        else:
            (only,) = weights
            self.weight, self.bias = only.weight, only.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        out = torch.matmul(x, self.weight)
        return out if self.bias is None else out + self.bias


class _Layer:
    """One decoder layer's tensors, read once so the hot loop does no module attribute lookups. Packed, the q/k/v
    and the gate/up projections are each one fused matmul."""

    def __init__(self, layer: nn.Module, packed: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1 = (layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon))
        self.norm2 = (
            layer.post_attention_layernorm.weight,
            float(layer.post_attention_layernorm.variance_epsilon),
        )
        qkv, gate_up = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
        if packed:
            self.qkv, self.gate_up = [_Proj(qkv, True)], [_Proj(gate_up, True)]
        else:
            self.qkv, self.gate_up = [_Proj([m], False) for m in qkv], [_Proj([m], False) for m in gate_up]
        self.o, self.down = _Proj([attn.o_proj], packed), _Proj([mlp.down_proj], packed)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_norm = None
        if q_norm is not None:
            self.qk_norm = (
                (q_norm.weight, float(q_norm.variance_epsilon)),
                (k_norm.weight, float(k_norm.variance_epsilon)),
            )
        plain_silu = type(mlp.act_fn).__name__ in ("SiLUActivation", "SiLU")
        self.act = F.silu if plain_silu else mlp.act_fn  # the same op without a module call


# packed copies per model, reused by every runner while the model's parameters are unchanged
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(model: nn.Module) -> tuple:
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


class LeanForward:
    """The forward pass of a supported verifier as a flat loop of tensor ops (the HF model's weights and formulas).

    ``packed`` (default: on CPU) uses transposed, fused weight copies (:class:`_Proj`): faster, and equal to the HF
    forward to rounding; unpacked, it reads the HF weights in place and matches the HF forward bit for bit."""

    def __init__(self, model: nn.Module, packed: bool | None = None) -> None:
        if not lean_supported(model):
            raise ValueError(f"{type(model).__name__} is not a Llama-family model this forward reproduces")
        self.model = model
        self.inner = model.model
        config = model.config
        first = self.inner.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.scaling = float(first.scaling)
        if packed is None:
            packed = self.inner.embed_tokens.weight.device.type == "cpu"
        self.packed = packed
        self.layers, self.head = self._weights(model, packed)
        self.num_layers = len(self.layers)
        self.final_norm = (self.inner.norm.weight, float(self.inner.norm.variance_epsilon))

    @staticmethod
    def _weights(model: nn.Module, packed: bool) -> tuple[list[_Layer], _Proj]:
        if not packed:
            return [_Layer(layer, False) for layer in model.model.layers], _Proj([model.lm_head], False)
        signature = _signature(model)
        cached = _PACKED.get(model)
        if cached is None or cached[0] != signature:
            with torch.no_grad():
                layers = [_Layer(layer, True) for layer in model.model.layers]
                cached = (signature, layers, _Proj([model.lm_head], True))
            _PACKED[model] = cached
        return cached[1], cached[2]

    def new_cache(self, batch: int) -> StaticKV:
        like = self.inner.embed_tokens.weight
        return StaticKV(self.num_layers, batch, self.kv_heads, self.head_dim, like)

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticKV,
        mask: torch.Tensor | None,
        aux_layer_ids: Sequence[int] = (),
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``ids[B, Q]`` at ``positions`` to ``cache``; ``mask`` is bool ``[B, 1, Q, length+Q]`` (None: the
        single new query sees every column). Returns logits ``[B, Q or 1, V]`` and the aux states (or None)."""
        hidden = F.embedding(ids, self.inner.embed_tokens.weight)
        cos, sin = self.inner.rotary_emb(hidden, position_ids=positions)
        half = self.head_dim // 2
        cos, sin = cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]
        start = cache.length
        end = start + ids.shape[1]
        cache.reserve(end)
        wanted = {
            int(i) for i in aux_layer_ids
        }  # only these states are kept alive (all L would be GBs on 8B)
        seen: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            if index in wanted:
                seen[index] = hidden
            hidden = hidden + self._attention(layer, hidden, cos, sin, cache, index, start, mask)
            x = _rms_norm(hidden, *layer.norm2)
            hidden = hidden + layer.down(self._gated(layer, x))
        cache.length = end
        if self.num_layers in wanted:
            seen[self.num_layers] = hidden
        aux = torch.cat([seen[int(i)] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        hidden = _rms_norm(hidden, *self.final_norm)  # over every position, as HF does, so the bits match
        return self.head(hidden[:, -1:] if last_only else hidden), aux

    @staticmethod
    def _gated(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """``act(gate(x)) * up(x)``."""
        if len(layer.gate_up) == 1:
            gate, up = layer.gate_up[0](x).chunk(2, dim=-1)
        else:
            gate, up = (proj(x) for proj in layer.gate_up)
        return layer.act(gate) * up

    def _attention(
        self,
        layer: _Layer,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: StaticKV,
        index: int,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = _rms_norm(hidden, *layer.norm1)
        batch, queries, _ = x.shape
        end = start + queries
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        if len(layer.qkv) == 1:  # packed: one [B, H + 2 H_kv, Q, D] tensor, split into views
            qkv = layer.qkv[0](x).view(batch, queries, heads + 2 * kv_heads, dim).transpose(1, 2)
            q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
        else:
            q, k, v = (proj(x).view(batch, queries, -1, dim).transpose(1, 2) for proj in layer.qkv)
        if layer.qk_norm is not None:  # Qwen3: per-head RMSNorm before rotary
            q, k = _rms_norm(q, *layer.qk_norm[0]), _rms_norm(k, *layer.qk_norm[1])
        if (
            len(layer.qkv) == 1 and layer.qk_norm is None
        ):  # rotate q and k in one pass (elementwise: same bits)
            q, k = _rotary(qkv[:, : heads + kv_heads], cos, sin).split((heads, kv_heads), dim=1)
        else:
            q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        keys, values = cache.keys[index], cache.values[index]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        keys, values = keys[:, :, :end], values[:, :, :end]
        groups = self.heads // self.kv_heads
        if queries == 1 and groups > 1:  # one query: the heads of a group become queries of their kv head
            q = q.reshape(batch, self.kv_heads, groups, self.head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=groups > 1
            ).transpose(1, 2)
        return layer.o(out.reshape(batch, queries, self.heads * self.head_dim))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen3 RMSNorm (statistics in fp32, scaled in the input dtype): in fp32, torch's fused kernel (one
    op instead of six; the unpacked test checks it gives the same bits), otherwise HF's formula op for op."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin == roll(x, D/2) * signed_sin`` (the first
    half of ``signed_sin`` negated): the same products, exactly, in two ops fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
