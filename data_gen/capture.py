"""The verifier forward that produces EAGLE-3 features, batched and without gradients.

Used twice: offline by ``data_gen`` (features written to shards) and ONLINE by the trainer (verifier in the loop,
nothing on disk), so both paths produce the very same tensors::

    capture = FeatureCapture(model, aux_layer_ids=None)          # None -> [2, L//2, L-3]
    out = capture.capture(input_ids, attention_mask)             # [B, T] each
    out["aux_hidden"]   # [B, T, n*H]  residual streams ENTERING layers aux_layer_ids, concatenated (vLLM ids)
    out["last_hidden"]  # [B, T, H]    output of the last decoder layer BEFORE the final norm

Layer ids follow vLLM (docs/algorithms.md, the ±1 trap): id k is the residual stream entering decoder layer k, id 0 the
embeddings, id L the last state before the final norm. ``model.lm_head(model.model.norm(last_hidden))`` gives the
verifier's logits, which is why the pre-norm state is kept. Only the base model (``model.model``) is run: the
lm_head (often the most expensive matmul of a small verifier) is not needed to capture features.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch
from torch import nn

from speculators.families import default_aux_layer_ids
from speculators.verifier import (
    capture_aux_states,
    check_aux_layer_ids,
    decoder_layers,
    decoder_stack,
    final_norm,
)

LAYER_CONVENTION = "vllm: residual stream entering layer k"


def resolve_aux_layer_ids(aux_layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """The recipe's ids (checked to lie in [0, L]) or the default when ``None``."""
    ids = default_aux_layer_ids(num_layers) if aux_layer_ids is None else [int(i) for i in aux_layer_ids]
    if not ids:
        raise ValueError(
            "verifier.aux_layer_ids is empty; give at least one id in [0, L] or null for the default"
        )
    check_aux_layer_ids(ids, num_layers)
    return ids


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack without the lm_head (``model.model`` for HF causal LMs, ``model.model.language_model``
    for the wrappers its family declares)."""
    return decoder_stack(model)


class FeatureCapture:
    """Batched, no-grad capture of the aux hidden states and the pre-norm last state of a verifier.

    ``out_dtype`` (default float32, what :class:`data_gen.store.FeatureDataset` returns) may be ``None`` to keep
    the verifier's own dtype (bf16 on GPUs), which halves the memory of online training batches.
    """

    def __init__(
        self,
        model: nn.Module,
        aux_layer_ids: Sequence[int] | None = None,
        out_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        self.model = model
        self.num_layers = len(decoder_layers(model))
        self.aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, self.num_layers)
        self.out_dtype = out_dtype
        self.hidden_size = int(final_norm(model).weight.shape[0])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """``{"aux_hidden": [B,T,n*H], "last_hidden": [B,T,H]}`` for a (right- or left-) padded batch.

        Positions are counted over real tokens (``cumsum(attention_mask) - 1``), so left padding gives the same
        states as right padding; values at padded positions are meaningless and must be masked by the caller.
        """
        device = self.device
        input_ids = input_ids.to(device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(device)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        with capture_aux_states(self.model, self.aux_layer_ids) as box:
            base_model(self.model)(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            )
        states = box["states"]
        aux, last = states.aux, states.last_prenorm
        if self.out_dtype is not None:
            aux, last = aux.to(self.out_dtype), last.to(self.out_dtype)
        return {"aux_hidden": aux, "last_hidden": last}


def verifier_fingerprint(model: nn.Module) -> str:
    """A stable identity of a verifier: its config plus a hash of every norm weight and a slice of the embedding.

    Cheap (no full weight hash of a multi-GB model) yet it changes with any fine-tune. Tensors are hashed in bf16,
    so the same checkpoint loaded in fp32 or bf16 gives the same fingerprint.
    """
    config = model.config.to_dict() if hasattr(model, "config") else {}
    for key in (
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_attn_implementation",
        "attn_implementation",
        "use_cache",
        "_commit_hash",
    ):
        config.pop(key, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if "norm" in name or name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
            tensor = param.detach()
            if tensor.dim() == 2:
                tensor = tensor[:64]
            digest.update(name.encode())
            digest.update(tensor.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


__all__ = [
    "LAYER_CONVENTION",
    "FeatureCapture",
    "base_model",
    "default_aux_layer_ids",
    "resolve_aux_layer_ids",
    "verifier_fingerprint",
]
