"""EAGLE-3's validator rules: the errors and warnings of its own keys and the tensors its checkpoint holds (the
eagle3 unit's ``config_rules`` / ``expected_shapes``; P-EAGLE extends both). The rules every type shares are
speculators.format.validate."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from speculators import draft_layer_types
from speculators.format.validate import Finding, decoder_layer_shapes, vocab_map_shapes


def eagle3_key_findings(config: dict[str, Any], error, warning) -> Iterator[Finding]:
    """The rules of EAGLE-3's own keys (the eagle3 unit's; other types do not have these keys)."""
    if "norm_before_residual" not in config:
        yield error(
            "norm_before_residual is missing: vLLM and the speculators library assume different defaults; "
            "write it explicitly (true for drafts trained by this project)"
        )
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or not ids):
        yield error("eagle_aux_hidden_state_layer_ids must be a non-empty list of integers")
    elif (aux_error := aux_layer_id_error(ids)) is not None:
        yield error(aux_error)
    elif ids is None:
        yield warning("eagle_aux_hidden_state_layer_ids is missing; vLLM will use its default [2, L//2, L-3]")
    elif ids != sorted(set(ids)):
        yield error(
            f"eagle_aux_hidden_state_layer_ids {ids} are repeated or unsorted: vLLM sorts and de-duplicates them "
            "before concatenating, so fc would read its features shuffled or too narrow; sort them and permute "
            "fc.weight's column blocks to match (`speculators convert` does both)"
        )
    flags = [flag for flag in ("norm_before_fc", "fc_norm", "norm_output") if config.get(flag)]
    if flags:
        yield warning(
            f"{' and '.join(flags)} {'is' if len(flags) == 1 else 'are'} true (EAGLE-3.1 sets norm_before_fc and "
            "norm_output): vLLM 0.32 and speculators 0.9.0 read them; a consumer release that predates a key "
            "ignores it and drafts with other features than the draft was trained on"
        )


def aux_layer_id_error(ids: Any) -> str | None:
    """What is wrong with aux layer ids that no verifier could make right, or None. Checked without the verifier
    (a hub-id verifier is read only when already cached): vLLM captures layer k's input only for ``k in range(L + 1)``, so a negative id is never
    captured and fc reads fewer features than it was trained on; a bool is an int to Python and JSON's ``true`` to
    the config, never a layer. The upper bound needs the verifier's L (``_verifier_findings``)."""
    if not isinstance(ids, list):
        return None
    flags = [i for i in ids if isinstance(i, bool)]
    if flags:
        return (
            f"eagle_aux_hidden_state_layer_ids {ids} hold booleans {flags}: write layer numbers (id k = the "
            "residual stream entering verifier layer k)"
        )
    negative = [i for i in ids if isinstance(i, int) and i < 0]
    if negative:
        return (
            f"eagle_aux_hidden_state_layer_ids {ids} hold negative ids {negative}: vLLM and the speculators library "
            "capture the stream entering layer k only for k in [0, L] (no Python-style counting from the end), so "
            "fc would read fewer features than it was trained on; write the absolute layer numbers the draft was "
            "trained on"
        )
    return None


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape a checkpoint with this config must hold."""
    layer = config["transformer_layer_config"]
    hidden, vocab = layer["hidden_size"], layer["vocab_size"]
    draft_vocab = config.get("draft_vocab_size", vocab)
    n_aux = len(config.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    verifier_hidden = config.get("target_hidden_size") or hidden
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (vocab, hidden),
        "fc.weight": (hidden, n_aux * verifier_hidden),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
    }
    if config.get("norm_before_fc"):
        shapes["input_norm.weight"] = (n_aux * verifier_hidden,)
    if config.get("fc_norm"):
        shapes.update({f"fc_norm.{i}.weight": (verifier_hidden,) for i in range(n_aux)})
    qk_norm = draft_layer_types.has_qk_norm(layer.get("model_type"))
    for i in range(layer.get("num_hidden_layers", 1)):
        width = 2 * hidden if i == 0 else hidden  # layer 0 attends over concat(embeds, hidden)
        shapes.update(decoder_layer_shapes(layer, f"layers.{i}.", width, qk_norm))
        if i == 0:
            shapes["layers.0.hidden_norm.weight"] = (hidden,)
    return {**shapes, **vocab_map_shapes(draft_vocab, vocab)}
