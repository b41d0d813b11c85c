"""Granite (3.x) verifiers: Llama layout (``model.model.layers``) with four scalar multipliers in the config:
``embedding_multiplier`` (the embedding is scaled before layer 0, so aux id 0 is the SCALED embedding, as vLLM's
``GraniteModel`` captures it), ``residual_multiplier`` and ``attention_multiplier`` inside the layers, and
``logits_scaling`` (the logits are the head's output DIVIDED by it: the training targets must be too, or the soft
targets are sharper than the verifier's). The draft is a llama layer.

Chat format: ``<|start_of_role|>{role}<|end_of_role|>{content}<|end_of_text|>\n``; the template adds a default
system turn; the generation prompt is ``<|start_of_role|>assistant<|end_of_role|>``.
"""

from speculators.families import ChatFormat, Family, register

FAMILY = register(
    Family(
        model_type="granite",
        display_name="Granite",
        reference_config="ibm-granite/granite-3.3-8b-instruct/config.json",
        draft_layer_type="llama",
        chat=ChatFormat(
            end_of_turn=("<|end_of_text|>",),
            tool_calls="<|tool_call|> + JSON list in the answer; tool results in a 'tool' role turn",
            notes="a default system turn (knowledge cutoff, today's date) when the conversation has none",
        ),
        embedding_scale=lambda text: float(text.get("embedding_multiplier", 1.0)),
        capture_notes="dense; embedding, residual and attention multipliers; logits divided by logits_scaling",
    )
)
