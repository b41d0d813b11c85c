"""A tiny Qwen3-Next verifier that ships an MTP layer (the ``mtp.*`` tensors of its checkpoint, named as the real
Qwen3-Next checkpoints name them, experts one by one), for the MTP unit's tests.

``hybrid=False`` (the default) builds every decoder layer as full attention: a Qwen3-Next (gated attention, q/k
norms, partial rotary, MoE MLPs, zero-centred norms) whose cache our engine can steer. Qwen3-Next's linear-attention
layers keep a recurrent state that absorbs every token fed to it, so a verifier with them cannot drop the rejected
draft tokens our engine's cache masks out (see docs/drafters.md, MTP); ``hybrid=True`` builds the real alternation
for the checks that need no speculative verification (training, export, the package's forward).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from speculators.atomic import atomic_directory


def tiny_qwen3_next_config(hybrid: bool = False, **overrides: Any) -> Any:
    from transformers import Qwen3NextConfig

    settings: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    layers = settings["num_hidden_layers"]
    settings.setdefault(
        "layer_types",
        [
            ("full_attention" if (i + 1) % 2 == 0 else "linear_attention") if hybrid else "full_attention"
            for i in range(layers)
        ],
    )
    # the real Qwen3-Next config declares its MTP layer so (transformers ignores the keys and the mtp.* weights)
    return Qwen3NextConfig(
        **settings,
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        architectures=["Qwen3NextForCausalLM"],
    )


def verifier_mtp_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our MTP tensors (``mtp_layers.0.*``, fused experts) under the verifier checkpoint's names (``mtp.*``,
    expert by expert): the inverse of speculators.algorithms.mtp.model.verifier_mtp_tensors."""
    from speculators.algorithms.mtp.model import VERIFIER_MTP_NAMES

    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name.replace("mtp_layers.0.", "mtp.layers.0.").removesuffix(".gate_up_proj")
            half = tensor.shape[1] // 2
            for i in range(tensor.shape[0]):
                out[f"{prefix}.{i}.gate_proj.weight"] = tensor[i, :half].contiguous()
                out[f"{prefix}.{i}.up_proj.weight"] = tensor[i, half:].contiguous()
            continue
        if name.endswith("experts.down_proj"):
            prefix = name.replace("mtp_layers.0.", "mtp.layers.0.").removesuffix(".down_proj")
            for i in range(tensor.shape[0]):
                out[f"{prefix}.{i}.down_proj.weight"] = tensor[i].contiguous()
            continue
        for old, new in reversed(VERIFIER_MTP_NAMES):
            if name.startswith(new) and (
                new != "mtp_layers.0." or not any(name.startswith(n) for _, n in VERIFIER_MTP_NAMES[:-1])
            ):
                out[old + name[len(new) :]] = tensor.contiguous()
                break
    return out


def build_tiny_mtp_verifier(
    directory: str | Path,
    seed: int = 0,
    tokenizer: Any = None,
    hybrid: bool = False,
    init_std: float | None = None,
    head_rows: int | None = None,
    **overrides: Any,
) -> Path:
    """Save a random tiny Qwen3-Next verifier with an MTP layer (random, as the verifier's own) as an HF directory.
    ``head_rows``: only the first rows of ``lm_head`` are kept (the others zero), so greedy tokens come from them."""
    from transformers import AutoModelForCausalLM

    from speculators.algorithms.mtp.config import MTPConfig
    from speculators.algorithms.mtp.model import MTPDraftModel

    if init_std is not None:
        overrides["initializer_range"] = init_std
    config = tiny_qwen3_next_config(hybrid, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    mtp = MTPDraftModel(MTPConfig.from_verifier(config.to_dict(), str(directory)))
    std = config.initializer_range
    if head_rows is not None:
        with torch.no_grad():
            model.lm_head.weight[head_rows:] = 0.0
    with torch.no_grad():
        for param in mtp.mtp_layers.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, std)
            else:
                param.normal_(0.0, 0.1)  # zero-centred norms: weight 0 is the identity scale
    layer = {f"mtp_layers.{k}": v for k, v in mtp.mtp_layers.state_dict().items()}
    with atomic_directory(directory) as staging:
        model.save_pretrained(staging)
        weights = load_file(str(Path(staging) / "model.safetensors"))
        weights.update(verifier_mtp_names(layer))
        save_file(weights, str(Path(staging) / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return Path(directory)


def fit_mtp_draft(
    model: Any, prompts: Any, directory: str | Path, steps: int, k: int, max_new_tokens: int
) -> Any:
    """The verifier's own MTP layer, fine-tuned on its greedy continuations of ``prompts`` with the trainer's MTP
    unroll (train/objectives/mtp.py: speculators 0.9.0's recursive steps) and quickfit's greedy targets."""
    from speculators.algorithms.mtp.config import MTPConfig
    from speculators.algorithms.mtp.model import MTPDraftModel
    from tests.support import quickfit
    from train.objectives.mtp import MTPUnroll
    from train.targets import TargetHead

    class Unroll(MTPUnroll):  # quickfit builds its unroll with the TTT wrapper's attention settings
        def __init__(self, draft: Any, steps: int, **_: Any) -> None:
            super().__init__(draft, steps)

    config = MTPConfig.from_verifier(model.config.to_dict(), str(directory), speculative_tokens=k)
    data = quickfit.collect(model, prompts, config.aux_layer_ids, max_new_tokens)
    draft = MTPDraftModel.from_verifier(config, directory)
    head = TargetHead.from_model(model, torch.arange(config.vocab_size))
    quickfit.fit_steps(draft, head, data, steps, k, lr=1e-2, unroll=Unroll)
    return draft
