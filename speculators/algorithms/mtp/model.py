"""The MTP draft: the multi-token-prediction layer of a Qwen3-Next verifier, under speculators 0.9.0's names.

Read top to bottom, this file is the whole architecture. Per position t:

    h_t    = verifier_norm(last hidden state of the verifier at t)        (step 0) or the draft's own output (later)
    x      = input_proj(concat(token_layernorm(embed(x_{t+1})), hidden_layernorm(h_t)))          [2H -> H]
    x      = x + self_attn(input_layernorm(x));   x = x + mlp(post_attention_layernorm(x))
    out    = final_layernorm(x);   logits = lm_head(out)  over the verifier's vocabulary;   out feeds the next step

The decoder layer is the verifier's own full-attention layer (gated attention with q/k norms and partial rotary,
its MoE or dense MLP, zero-centred RMSNorms): its modules are transformers' own Qwen3-Next classes built from the
verifier's config at the index of its last full-attention layer (which decides MoE vs dense), so the tensors are
named and shaped as speculators 0.9.0's ``MTPDraftModel`` names them (``mtp_layers.0.*``) and as the verifier's
``mtp.*`` tensors map onto them (``mtp.fc`` -> ``input_proj``, ``mtp.norm`` -> ``final_layernorm``,
``mtp.pre_fc_norm_{hidden,embedding}`` -> ``{hidden,token}_layernorm``, ``mtp.layers.0.*`` -> the layer's). vLLM's
Qwen3-Next MTP module computes the same (``fc``, ``pre_fc_norm_*``, one decoder layer, ``norm``).

Attention is a callback (``attend(layer_idx, q, k, v)``, as every draft here) so the same module serves training
(plain causal), the engine's KV cache and tree masks. ``embed_tokens``, ``lm_head`` and ``verifier_norm`` are the
verifier's, frozen, and never written: both consumers take them from the verifier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from speculators.algorithms.mtp.config import MTPConfig
from speculators.models.draft import DraftModel
from speculators.models.layers import AttendFn, bind_layer, causal_attend

# the verifier tensors an MTP draft takes on load, by its own name (first name present wins)
VERIFIER_TENSORS = {
    "embed_tokens.weight": ("model.embed_tokens.weight", "embed_tokens.weight"),
    "lm_head.weight": ("lm_head.weight", "model.embed_tokens.weight"),
    "verifier_norm.weight": ("model.norm.weight", "norm.weight"),
}
# what speculators 0.9.0's own MTP checkpoints hold besides the layer: its copy of the verifier's head (which the
# package itself replaces with the verifier's on load and then deletes); we take the verifier's too
PACKAGE_VERIFIER_COPIES = ("verifier_lm_head.weight",)
# the verifier's own checkpoint names of the MTP tensors -> ours (what speculators 0.9.0's converter maps too)
VERIFIER_MTP_NAMES = (
    ("mtp.fc.", "mtp_layers.0.input_proj."),
    ("mtp.norm.", "mtp_layers.0.final_layernorm."),
    ("mtp.pre_fc_norm_hidden.", "mtp_layers.0.hidden_layernorm."),
    ("mtp.pre_fc_norm_embedding.", "mtp_layers.0.token_layernorm."),
    ("mtp.layers.0.", "mtp_layers.0."),
)


def hf_config(config: MTPConfig) -> PretrainedConfig:
    """The verifier's transformers config, rebuilt from ``transformer_layer_config``."""
    layer = dict(config.transformer_layer_config)
    model_type = layer.pop("model_type")
    if model_type != "qwen3_next":
        raise ValueError(
            f"MTP drafts of {model_type!r} verifiers are declared by speculators 0.9.0 but not built here yet: "
            "this project builds the Qwen3-Next MTP layer (model_type qwen3_next)"
        )
    cfg = AutoConfig.for_model(model_type, **layer)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    return cfg


def last_full_attention_index(cfg: PretrainedConfig) -> int:
    """The index of the verifier's last full-attention layer: the MTP layer is built as that layer (its MLP is MoE
    or dense as that index's is), as 0.9.0 and vLLM build it."""
    types = list(getattr(cfg, "layer_types", None) or [])
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if types and not full:
        raise ValueError(f"layer_types {types} has no full_attention layer for the MTP layer to be")
    return full[-1] if full else 0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary: the first ``cos.shape[-1]`` features of each head rotate, the rest pass through."""
    width = cos.shape[-1]
    rot, rest = x[..., :width], x[..., width:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


class MTPLayer(nn.Module):
    """The MTP input projection and norms around one Qwen3-Next full-attention decoder layer."""

    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        layer = Qwen3NextDecoderLayer(cfg, last_full_attention_index(cfg))
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.hidden_layernorm = Qwen3NextRMSNorm(hidden, eps=eps)
        self.token_layernorm = Qwen3NextRMSNorm(hidden, eps=eps)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.final_layernorm = Qwen3NextRMSNorm(hidden, eps=eps)
        self.head_dim = self.self_attn.head_dim

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Any) -> torch.Tensor:
        """Qwen3-Next's gated attention: q_proj yields each head's query and its output gate."""
        attn = self.self_attn
        batch, length, _ = x.shape
        query, gate = attn.q_proj(x).view(batch, length, -1, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(batch, length, -1)
        q = attn.q_norm(query).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(batch, length, -1, self.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        out = attend(_rope(q, cos, sin), _rope(k, cos, sin), v)
        out = out.transpose(1, 2).reshape(batch, length, -1) * torch.sigmoid(gate)
        return attn.o_proj(out)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Any,
    ) -> torch.Tensor:
        x = self.input_proj(torch.cat([self.token_layernorm(embeds), self.hidden_layernorm(hidden)], dim=-1))
        x = x + self.attention(self.input_layernorm(x), cos, sin, attend)
        mlp = self.mlp(self.post_attention_layernorm(x))
        x = x + (mlp[0] if isinstance(mlp, tuple) else mlp)
        return self.final_layernorm(x)


class MTPDraftModel(DraftModel):
    """An MTP draft whose trainable parameter names are exactly the checkpoint's (``mtp_layers.0.*``)."""

    config_class = MTPConfig

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            Qwen3NextRMSNorm,
            Qwen3NextRotaryEmbedding,
        )

        if config.num_nextn_predict_layers != 1:
            raise ValueError(
                f"num_nextn_predict_layers={config.num_nextn_predict_layers}: speculators 0.9.0 and this "
                "project build one MTP layer"
            )
        self.config = config
        cfg = hf_config(config)
        hidden, vocab = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.verifier_norm = Qwen3NextRMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.mtp_layers = nn.ModuleList([MTPLayer(cfg)])
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.rotary_emb = Qwen3NextRotaryEmbedding(cfg)
        for frozen in (self.embed_tokens, self.verifier_norm, self.lm_head):
            frozen.requires_grad_(False)
        self.register_vocab(vocab, vocab)

    # ---- the forward pieces --------------------------------------------------------------------------------
    def project_features(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The verifier's last hidden state (before its final norm) -> what the MTP layer reads (after it)."""
        return self.verifier_norm(last_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attend: AttendFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step. Returns ``(logits over the verifier's vocabulary, hidden for the next step)``.

        ``input_ids[t]`` is the token after the one whose state is ``hidden[t]``, at position ``position_ids[t]``.
        """
        attend = attend or causal_attend
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(embeds, position_ids)
        out = self.mtp_layers[0](hidden, embeds, cos, sin, bind_layer(attend, 0))
        return self.lm_head(out), out

    # ---- checkpoint I/O: the MTP layer only (the consumers take the rest from the verifier) -----------------
    def export_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        return {
            name: tensor.detach().to(dtype).contiguous()
            for name, tensor in self.state_dict().items()
            if name.startswith("mtp_layers.")
        }

    def load_verifier_tensors(self, verifier_dir: str | Path, mtp: bool = False) -> None:
        """Take the embedding, ``lm_head`` and final norm (and with ``mtp`` its MTP layer: the fine-tuning start)
        from a local verifier checkpoint."""
        from speculators.verifier import read_verifier_tensor

        own = self.state_dict()
        with torch.no_grad():
            for name, sources in VERIFIER_TENSORS.items():
                own[name].copy_(read_verifier_tensor(verifier_dir, sources))
            if mtp:
                tensors = verifier_mtp_tensors(verifier_dir)
                missing = sorted(n for n in own if n.startswith("mtp_layers.") and n not in tensors)
                unexpected = sorted(set(tensors) - set(own))
                if missing or unexpected:
                    raise ValueError(
                        f"{verifier_dir}: its mtp.* tensors do not make this MTP layer (missing {missing}, "
                        f"unexpected {unexpected})"
                    )
                for name, tensor in tensors.items():
                    own[name].copy_(tensor)

    @classmethod
    def from_verifier(cls, config: MTPConfig, verifier_dir: str | Path) -> MTPDraftModel:
        """The verifier's own MTP layer, embedding, head and final norm: where fine-tuning starts."""
        model = cls(config)
        model.load_verifier_tensors(verifier_dir, mtp=True)
        return model

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, dtype: torch.dtype = torch.float32, embed_from_verifier: bool = True
    ) -> MTPDraftModel:
        """Load an MTP checkpoint (ours or speculators 0.9.0's) and take the rest from the verifier it names."""
        from speculators.format.checkpoint import load_checkpoint
        from speculators.format.config import verifier_name_or_path
        from speculators.verifier import resolve_verifier_path

        config_dict, tensors = load_checkpoint(directory)
        tensors = {k: v for k, v in tensors.items() if k not in PACKAGE_VERIFIER_COPIES}
        model = cls(cls.config_class.from_dict(config_dict))
        layer = {k: v for k, v in tensors.items() if k.startswith("mtp_layers.")}
        own = {k for k in model.state_dict() if k.startswith("mtp_layers.")}
        if set(layer) != own or len(layer) != len(tensors):
            raise ValueError(
                f"{directory}: tensors do not match the MTP config (missing {sorted(own - set(layer))}, "
                f"unexpected {sorted(set(tensors) - own)}); run `speculators validate` for details"
            )
        name = verifier_name_or_path(config_dict)
        if not name:
            raise ValueError(
                f"{directory}: an MTP checkpoint needs its verifier (speculators_config.verifier)"
            )
        model.load_verifier_tensors(resolve_verifier_path(name))
        with torch.no_grad():
            state = model.state_dict()
            for key, tensor in layer.items():
                state[key].copy_(tensor.to(state[key].dtype))
        return model.to(dtype)


def verifier_mtp_tensors(verifier_dir: str | Path) -> dict[str, torch.Tensor]:
    """The verifier checkpoint's ``mtp.*`` tensors under our names (per-expert weights fused as transformers'
    MoE block holds them: ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
    from safetensors import safe_open

    directory = Path(verifier_dir)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        import json

        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    raw: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(directory / shard), framework="pt") as f:
            for key in f.keys():
                if key.startswith("mtp."):
                    raw[key] = f.get_tensor(key)
    if not raw:
        raise ValueError(
            f"{verifier_dir}: the verifier holds no mtp.* tensors: it ships no MTP layer to fine-tune"
        )
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in raw.items():
        for old, new in VERIFIER_MTP_NAMES:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        parts = key.split(".")
        if "experts" in parts and parts[-1] == "weight" and parts[parts.index("experts") + 1].isdigit():
            at = parts.index("experts")
            prefix = ".".join(parts[: at + 1])
            experts.setdefault(prefix, {}).setdefault(int(parts[at + 1]), {})[parts[at + 2]] = tensor
        else:
            out[key] = tensor
    for prefix, by_index in experts.items():
        order = [by_index[i] for i in range(len(by_index))]
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([e["gate_proj"], e["up_proj"]]) for e in order]
        )
        out[f"{prefix}.down_proj"] = torch.stack([e["down_proj"] for e in order])
    return out
