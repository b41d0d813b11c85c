"""The speculators ``config.json`` keys every draft type shares: ``speculators_config`` (verifier, proposal methods),
the :class:`DraftConfig` base each algorithm's config class extends (``speculators/algorithms/<name>/config.py``) and
the helpers that copy the verifier's layer shape and rope into ``transformer_layer_config``.

The field names and defaults follow what vLLM and the ``speculators`` library read (see docs/format.md). Where the two
consumers disagree on a default (``norm_before_residual``, ``transformer_layer_config.model_type``), we always write
the value explicitly so neither has to guess.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from speculators import draft_layer_types, families
from speculators.algorithms import LEGACY_TYPE
from speculators.families import default_aux_layer_ids  # noqa: F401  (re-exported: the ids a config records)
from speculators.format.checkpoint import read_config

# Keys of the verifier's HF config that the draft layer must copy so that positions are encoded identically.
LAYER_KEYS_FROM_VERIFIER = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "hidden_act",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "attention_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
# transformer_layer_config.layer_types entries, as vLLM's EAGLE-3 draft layers read them (llama.py / qwen3_eagle3.py:
# draft layer i is windowed iff layer_types[i] == "sliding_attention", with transformer_layer_config.sliding_window)
SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass
class ProposalMethod:
    """How the draft proposes tokens; ``speculative_tokens`` becomes vLLM's ``num_speculative_tokens``."""

    proposal_type: str = "greedy"
    speculative_tokens: int = 3
    verifier_accept_k: int = 1
    accept_tolerance: float = 0.0


@dataclass
class VerifierRef:
    """The verifier the draft was trained against: vLLM loads it (model and tokenizer) from ``name_or_path``."""

    name_or_path: str
    architectures: list[str]


def verifier_name_or_path(config: dict[str, Any]) -> str | None:
    """``speculators_config.verifier.name_or_path`` of a draft's ``config.json`` dict, or None when it names none
    (a converted or hand-written config may lack any level of it)."""
    spec = config.get("speculators_config") if isinstance(config, dict) else None
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return str(name) if name else None


@dataclass
class SpeculatorsConfig:
    """The ``speculators_config`` block."""

    verifier: VerifierRef
    algorithm: str = LEGACY_TYPE
    proposal_methods: list[ProposalMethod] = field(default_factory=lambda: [ProposalMethod()])
    default_proposal_method: str = "greedy"

    @property
    def speculative_tokens(self) -> int:
        return self.proposal_methods[0].speculative_tokens


def rope_settings(verifier_config: dict[str, Any]) -> dict[str, Any]:
    """The verifier's rope settings in the legacy keys (``rope_theta``, ``rope_scaling``) that every consumer reads.

    transformers 5 folds both into ``rope_parameters``; older readers (and docs/format.md) expect the legacy keys.
    """
    params = dict(verifier_config.get("rope_parameters") or {})
    theta = verifier_config.get("rope_theta", params.pop("rope_theta", None))
    scaling = verifier_config.get("rope_scaling")
    if scaling is None and params and params.get("rope_type", "default") != "default":
        scaling = params
    return {"rope_theta": theta if theta is not None else 10000.0, "rope_scaling": scaling}


class DraftConfig:
    """What every draft type's config shares: the derived views of ``transformer_layer_config`` and the
    serialisation to and from ``config.json``. A subclass is a dataclass that names its type in
    ``SPECULATORS_MODEL_TYPE`` / ``ARCHITECTURE`` and declares its own top-level keys as fields."""

    SPECULATORS_MODEL_TYPE: ClassVar[str] = ""
    ARCHITECTURE: ClassVar[str] = ""
    transformer_layer_config: dict[str, Any]
    speculators_config: SpeculatorsConfig
    target_hidden_size: int | None
    speculators_version: str
    extra: dict[str, Any]

    # ---- derived views -------------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.transformer_layer_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.transformer_layer_config["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.transformer_layer_config.get("num_hidden_layers", 1))

    @property
    def layer_type(self) -> str:
        return str(self.transformer_layer_config.get("model_type", "llama"))

    @property
    def head_dim(self) -> int:
        cfg = self.transformer_layer_config
        return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])

    @property
    def verifier_hidden_size(self) -> int:
        return int(self.target_hidden_size or self.hidden_size)

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of draft layer ``layer_idx`` (None: full attention), read as vLLM reads it: the layer
        is windowed iff ``layer_types[layer_idx]`` is ``sliding_attention``; a query at position p then sees the
        keys at positions p - window + 1 .. p (``window`` keys, itself included)."""
        layer = self.transformer_layer_config
        types = layer.get("layer_types") or []
        if layer_idx < len(types) and types[layer_idx] == SLIDING:
            return int(layer["sliding_window"])
        return None

    @property
    def layer_windows(self) -> list[int | None]:
        """:meth:`layer_window` of every draft layer (what the attention callbacks mask with)."""
        return [self.layer_window(i) for i in range(self.num_layers)]

    # ---- serialisation -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "architectures": [self.ARCHITECTURE],
            "speculators_model_type": self.SPECULATORS_MODEL_TYPE,
            "speculators_version": self.speculators_version,
            "speculators_config": asdict(self.speculators_config),
        }
        for f in fields(self):
            if f.name in ("speculators_config", "extra", "speculators_version"):
                continue
            out[f.name] = copy.deepcopy(getattr(self, f.name))
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """Parse a config dict; raises ``ValueError`` naming the missing key (run the validator for all findings)."""
        data = copy.deepcopy(data)
        try:
            spec = data.pop("speculators_config")
            verifier = VerifierRef(**spec["verifier"])
            methods = [ProposalMethod(**m) for m in spec["proposal_methods"]]
            speculators_config = SpeculatorsConfig(
                verifier=verifier,
                algorithm=spec.get("algorithm", cls.SPECULATORS_MODEL_TYPE),
                proposal_methods=methods,
                default_proposal_method=spec.get("default_proposal_method", methods[0].proposal_type),
            )
            known = {f.name for f in fields(cls)} - {"speculators_config", "extra"}
            kwargs = {k: data.pop(k) for k in list(data) if k in known}
            for key in ("architectures", "speculators_model_type"):
                data.pop(key, None)
            return cls(speculators_config=speculators_config, extra=data, **kwargs)
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"not a valid speculators {cls.SPECULATORS_MODEL_TYPE} config: {exc!r}; run `speculators validate`"
            ) from exc

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> Any:
        return cls.from_dict(read_config(directory))


def draft_layer_config(verifier_config: dict[str, Any], layer_type: str, num_layers: int) -> dict[str, Any]:
    """``transformer_layer_config`` for a draft of ``num_layers`` layers: shape, heads and rope copied from the
    verifier's HF config dict, so positions are encoded as the verifier encodes them (every draft type uses it)."""
    draft_layer_types.get(layer_type)  # a clear error for a type vLLM does not build
    source = families.of_config(verifier_config).layer_source(verifier_config)
    layer = {k: source[k] for k in LAYER_KEYS_FROM_VERIFIER if source.get(k) is not None}
    layer.update(rope_settings(source))
    layer.setdefault("head_dim", layer["hidden_size"] // layer["num_attention_heads"])
    layer.setdefault("num_key_value_heads", layer["num_attention_heads"])
    layer.setdefault("hidden_act", "silu")
    layer.setdefault("attention_bias", False)
    layer.update(model_type=layer_type, num_hidden_layers=num_layers, tie_word_embeddings=False)
    return layer
