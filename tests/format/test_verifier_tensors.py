"""Reading a few verifier tensors without loading the model: every shard is read once for all wanted keys, the
first alias present wins, absent keys are left out."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from speculators.verifier import LM_HEAD_NAMES, NORM_NAMES, VERIFIER_EMBEDDING_NAMES, read_verifier_tensors


def test_keys_spread_over_shards_are_found_with_their_first_alias(tmp_path):
    embed, other_embed = torch.randn(10, 4), torch.randn(10, 4)
    norm, head = torch.randn(4), torch.randn(10, 4)
    shards = {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": embed,
            "embed_tokens.weight": other_embed,
        },
        "model-00002-of-00002.safetensors": {"model.norm.weight": norm, "lm_head.weight": head},
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    wanted = {
        "embed": VERIFIER_EMBEDDING_NAMES,
        "norm": NORM_NAMES,
        "lm_head": LM_HEAD_NAMES,
        "absent": ("model.layers.99.weight",),
    }
    found = read_verifier_tensors(str(tmp_path), wanted)
    assert set(found) == {"embed", "norm", "lm_head"}
    assert torch.equal(found["embed"], embed)  # model.embed_tokens.weight comes first among the aliases
    assert torch.equal(found["norm"], norm) and torch.equal(found["lm_head"], head)
