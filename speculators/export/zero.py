"""Gathering a DeepSpeed ZeRO checkpoint (stage 1/2/3 shards) into one fp32 state dict.

DeepSpeed is a training dependency: it is imported here lazily, inside the one function that needs it, so the
library and every other export path work without it.
"""

from __future__ import annotations

from pathlib import Path

import torch

MODEL_STATES_GLOB = "*model_states.pt"


def find_zero_checkpoint(state_dir: str | Path) -> tuple[Path, str]:
    """``(checkpoint_dir, tag)`` of the DeepSpeed checkpoint under ``state_dir``.

    accelerate's ``save_state`` writes ``state/pytorch_model/*.pt`` plus ``state/latest``; a bare
    ``engine.save_checkpoint(dir, tag)`` writes ``dir/<tag>/`` and ``dir/latest``. Both, and a tag directory given
    directly, are accepted.
    """
    state_dir = Path(state_dir)
    latest = state_dir / "latest"
    if latest.is_file() and (state_dir / latest.read_text().strip()).is_dir():
        return state_dir, latest.read_text().strip()
    if any(state_dir.glob(MODEL_STATES_GLOB)):
        return state_dir.parent, state_dir.name
    tagged = sorted(p for p in state_dir.iterdir() if p.is_dir() and any(p.glob(MODEL_STATES_GLOB)))
    if len(tagged) == 1:
        return state_dir, tagged[0].name
    if len(tagged) > 1:
        raise ValueError(
            f"{state_dir} holds several DeepSpeed tags ({[p.name for p in tagged]}) and no 'latest' file; "
            "pass the tag directory itself"
        )
    raise FileNotFoundError(
        f"{state_dir}: no DeepSpeed checkpoint (no '{MODEL_STATES_GLOB}' files); was the run saved with ZeRO?"
    )


def gather_zero_state(state_dir: str | Path) -> dict[str, torch.Tensor]:
    """The full fp32 state dict (trainable and frozen parameters, persistent buffers) of a ZeRO checkpoint."""
    checkpoint_dir, tag = find_zero_checkpoint(state_dir)
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise ImportError(
            f"{state_dir} is a DeepSpeed ZeRO checkpoint; gathering its shards needs deepspeed "
            "(pip install 'speculators-train[pipeline]')"
        ) from exc
    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    return {name: tensor.detach().cpu() for name, tensor in state.items()}
