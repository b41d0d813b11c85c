"""Which token id fills a block drafter's draft slots (``mask_token_id``), and why.

The mask token's embedding row (a frozen copy of the verifier's) is what every draft slot starts from, so the id
must be one the draft never sees as a real token: otherwise a real token and "not yet known" look alike. In order:

1. the recipe's explicit id (``key``: the recipe key it was set under, e.g. ``block.mask_token_id``);
2. the tokenizer's own mask token;
3. a spare embedding row: the verifier has more embedding rows than the tokenizer has tokens (Qwen3: 151669), so
   the row past the last token is never produced by the tokenizer;
4. a special (added) token that never occurs in the training data's counts, skipping bos/eos/pad (SmolLM2 has no
   mask token and no spare row, but 14 code-repository special tokens that chat data never contains);
5. pad, then eos: the last resort, shared with a real role (said so in the reason).
"""

from __future__ import annotations

from typing import Any

import torch


def resolve_mask_token(
    tokenizer: Any,
    embedding_rows: int,
    counts: torch.Tensor | None = None,
    explicit: int | None = None,
    key: str = "mask_token_id",
) -> tuple[int, str]:
    """``(mask_token_id, reason)`` by the rules of the module docstring; ``key`` names the recipe key in the reason
    and the errors."""
    if explicit is not None:
        if not 0 <= int(explicit) < embedding_rows:
            raise ValueError(f"{key}={explicit} is outside the verifier's embedding ({embedding_rows} rows)")
        return int(explicit), f"set by the recipe ({key})"
    if tokenizer is None:  # a bare verifier directory (tests, custom models): the data is all we know
        unused = (counts == 0).nonzero() if counts is not None else torch.zeros(0)
        if unused.numel():
            token_id = int(unused[0])
            return token_id, f"no tokenizer: id {token_id}, the lowest that never occurs in the training data"
        raise ValueError(f"no tokenizer and no unused token id: set {key} in the recipe")
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is not None:
        return int(mask), f"the tokenizer's mask token {tokenizer.mask_token!r}"
    if embedding_rows > len(tokenizer):
        spare = len(tokenizer)
        return (
            spare,
            f"a spare embedding row (id {spare}): the tokenizer has {spare} tokens, the embedding {embedding_rows} rows",
        )
    roles = {getattr(tokenizer, f"{r}_token_id", None) for r in ("bos", "eos", "pad", "unk")}
    special = sorted(
        set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    )
    for token_id in special:
        if token_id in roles or token_id >= embedding_rows:
            continue
        if counts is None or int(counts[token_id]) == 0:
            name = tokenizer.convert_ids_to_tokens(token_id)
            return (
                token_id,
                f"special token {name!r} (id {token_id}), which never occurs in the training data",
            )
    for role in ("pad", "eos"):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        if token_id is not None:
            return int(
                token_id
            ), f"the {role} token (no mask token, spare row or unused special token): it doubles as {role}"
    raise ValueError(f"no mask token could be chosen: set {key} in the recipe")


__all__ = ["resolve_mask_token"]
