"""Typed classes for the speculators ``config.json`` of an EAGLE-3 draft.

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

from speculators import __version__, draft_layer_types, families
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
DRAFT_ARCHITECTURE = "Eagle3Speculator"


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
    algorithm: str = "eagle3"
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


@dataclass
class Eagle3Config(DraftConfig):
    """config.json of an EAGLE-3 draft in the speculators format.

    ``transformer_layer_config`` is a plain HF decoder-layer config dict (``model_type`` llama or qwen3) whose
    ``vocab_size`` is the VERIFIER's vocabulary; ``draft_vocab_size`` is the size of the draft's lm_head.
    """

    SPECULATORS_MODEL_TYPE: ClassVar[str] = "eagle3"
    ARCHITECTURE: ClassVar[str] = DRAFT_ARCHITECTURE
    transformer_layer_config: dict[str, Any]
    speculators_config: SpeculatorsConfig
    draft_vocab_size: int
    eagle_aux_hidden_state_layer_ids: list[int]
    norm_before_residual: bool = True
    target_hidden_size: int | None = None
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    torch_dtype: str = "bfloat16"
    speculators_version: str = __version__
    # Keys we do not model (newer optional flags, producer metadata) survive a load/save round trip untouched.
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_verifier(
        cls,
        verifier_config: dict[str, Any],
        name_or_path: str,
        draft_vocab_size: int | None = None,
        aux_layer_ids: list[int] | None = None,
        speculative_tokens: int = 3,
        num_layers: int = 1,
        layer_type: str | None = None,
        norm_before_residual: bool = True,
        torch_dtype: str = "bfloat16",
        sliding_window: int | None = None,
    ) -> Eagle3Config:
        """A draft config whose layer shape, heads and rope are copied from the verifier's HF config dict.

        Aux ids default to ``[2, L//2, L-3]`` in vLLM's convention (the residual stream *entering* layer k).
        ``sliding_window``: every draft layer attends over that many positions (long-context drafts), written as
        ``layer_types`` / ``sliding_window`` in ``transformer_layer_config``, the keys vLLM reads.
        """
        family = families.of_config(verifier_config)
        if aux_layer_ids is None:
            aux_layer_ids = family.default_aux_layer_ids(verifier_config)
        layer_type = layer_type or family.draft_layer_type
        layer = draft_layer_config(verifier_config, layer_type, num_layers)
        if sliding_window is not None:
            layer.update(window_layout(sliding_window, num_layers))
        architectures = list(verifier_config.get("architectures") or ["LlamaForCausalLM"])
        return cls(
            transformer_layer_config=layer,
            speculators_config=SpeculatorsConfig(
                verifier=VerifierRef(name_or_path=str(name_or_path), architectures=architectures),
                proposal_methods=[ProposalMethod(speculative_tokens=speculative_tokens)],
            ),
            draft_vocab_size=int(draft_vocab_size or layer["vocab_size"]),
            eagle_aux_hidden_state_layer_ids=[int(i) for i in aux_layer_ids],
            norm_before_residual=norm_before_residual,
            torch_dtype=torch_dtype,
        )


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


def window_layout(window: int, num_layers: int) -> dict[str, Any]:
    """The ``transformer_layer_config`` keys of an all-sliding EAGLE-3 draft (vLLM reads ``layer_types`` per draft
    layer and ``sliding_window``; ``use_sliding_window`` is what transformers' Qwen configs gate windows on)."""
    if int(window) < 1:
        raise ValueError(f"sliding_window {window}: a window holds at least the query's own position")
    return {
        "layer_types": [SLIDING] * int(num_layers),
        "sliding_window": int(window),
        "use_sliding_window": True,
    }


@dataclass
class PEagleConfig(Eagle3Config):
    """config.json of a P-EAGLE draft (``speculators_model_type: peagle``): an EAGLE-3 draft that proposes its K
    tokens in ONE forward. Slot 0 is EAGLE-3's ordinary input (the bonus token with the verifier feature of the last
    accepted position); slots 1..K-1 hold ``mask_token_id`` with the learned ``mask_hidden`` in place of the
    verifier feature (docs/algorithms.md, "P-EAGLE").

    vLLM serves it on its EAGLE-3 classes with ``parallel_drafting`` on, reading the mask id from
    ``mask_token_id`` (as ``pard_token``): a missing key is a KeyError there and null breaks later, so the id is a
    required int here. ``norm_before_residual`` is always written: vLLM's P-EAGLE default (false) differs from its
    EAGLE-3 default (true) and from what our trainer uses. ``speculative_tokens`` is K, the trained depths.
    """

    SPECULATORS_MODEL_TYPE: ClassVar[str] = "peagle"
    ARCHITECTURE: ClassVar[str] = "PEagleSpeculator"
    mask_token_id: int = field(kw_only=True)
    # why this mask id (speculators/mask_token.py): read by people only, consumers ignore it
    mask_token_source: str = field(default="", kw_only=True)
    # speculators 0.9.0 trains the embedding of P-EAGLE drafts (its default, which its CLI cannot change)
    embed_requires_grad: bool = field(default=True, kw_only=True)

    @property
    def num_depths(self) -> int:
        """K: the tokens one forward proposes (slot 0 plus K-1 mask slots)."""
        return self.speculators_config.speculative_tokens

    @classmethod
    def from_verifier(  # type: ignore[override]
        cls,
        verifier_config: dict[str, Any],
        name_or_path: str,
        mask_token_id: int,
        mask_token_source: str = "",
        embed_requires_grad: bool = True,
        **eagle3_arguments: Any,
    ) -> PEagleConfig:
        """An EAGLE-3 config from the verifier (see :meth:`Eagle3Config.from_verifier`) plus the mask token;
        ``speculative_tokens`` is the number of depths K."""
        base = Eagle3Config.from_verifier(verifier_config, name_or_path, **eagle3_arguments)
        vocab = int(base.transformer_layer_config["vocab_size"])
        if not 0 <= int(mask_token_id) < vocab:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the verifier vocabulary ({vocab})")
        values = {f.name: getattr(base, f.name) for f in fields(Eagle3Config)}
        values["speculators_config"].algorithm = cls.SPECULATORS_MODEL_TYPE
        return cls(
            **values,
            mask_token_id=int(mask_token_id),
            mask_token_source=mask_token_source,
            embed_requires_grad=embed_requires_grad,
        )
