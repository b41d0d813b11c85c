"""gpt-oss verifiers (20b, 120b): Llama-like stack (``model.model.layers``, RMSNorm w) whose layers alternate
sliding-window (128) and full attention, with attention sinks and an MoE MLP (32/128 experts, 4 active) in every
layer. The residual stream between layers is what vLLM captures, as for a dense model. The draft is a dense llama
layer; it copies the verifier's YaRN rope settings.

Chat format: OpenAI's harmony. A turn is ``<|start|>{role}<|channel|>{channel}<|message|>{content}<|end|>``; the
generation prompt is ``<|start|>assistant`` and the MODEL writes the channel header, so the loss covers
``<|channel|>final<|message|>`` + the answer + the token that ends it. The answer of a finished conversation ends
with ``<|return|>`` while the same answer in history ends with ``<|end|>``: the template is not prefix-stable and
the masker goes per turn, each sample ending in ``<|return|>`` (what the model emits to stop). Reasoning is in the
``analysis`` channel, dropped from history once a final answer follows; tool calls go to the ``commentary``
channel with ``to=functions.NAME`` in the header and end with ``<|call|>``.
"""

from speculators.families import ChatFormat, Family, register

FAMILY = register(
    Family(
        model_type="gpt_oss",
        display_name="gpt-oss",
        reference_config="openai/gpt-oss-20b/config.json",
        draft_layer_type="llama",
        attn_implementation="eager",
        chat=ChatFormat(
            end_of_turn=("<|return|>", "<|end|>", "<|call|>"),
            generated_prefix="<|channel|>final<|message|>",
            thinking="stripped_from_history",
            tool_calls="commentary channel, header 'to=functions.NAME', closed by <|call|>",
            notes="assistant content is the final channel; the analysis channel is dropped from history",
        ),
        capture_notes="MoE in every layer; sliding-window (128) and full attention alternate; attention sinks",
        quirks=(
            "published weights are MXFP4-quantised experts; the draft never copies them",
            "rope is YaRN (factor 32 over 4096): the draft layer copies rope_scaling",
        ),
    )
)
