"""Llama (3.x) verifiers: the reference layout every undeclared decoder-only model_type is read with.

``model.model.layers`` / ``model.model.norm`` (plain RMSNorm, weight w); embeddings unscaled; no wrapper. Llama 3's
chat format ends an assistant turn with ``<|eot_id|>`` after a ``<|start_header_id|>assistant<|end_header_id|>``
header; SmolLM2 (model_type llama too, the embedded verifier) uses ChatML's ``<|im_end|>``, which the masker finds
by itself when the tokenizer lacks ``<|eot_id|>``.
"""

from speculators.families import ChatFormat, Family, register

FAMILY = register(
    Family(
        model_type="llama",
        display_name="Llama",
        reference_config="meta-llama/Llama-3.1-8B-Instruct/config.json",
        draft_layer_type="llama",
        chat=ChatFormat(
            end_of_turn=("<|eot_id|>",),
            tool_calls="ipython role / <|python_tag|> (Llama 3.1); the mask covers the call like any answer",
        ),
        capture_notes="dense; every layer is one residual block",
        quirks=("Llama 3.1 uses rope_type llama3 scaling: the draft layer copies it",),
    )
)
