"""Qwen3-MoE verifiers (Qwen3-30B-A3B, 235B-A22B): the Qwen3 layout with a sparse MoE block as the MLP of every
layer (``decoder_sparse_step`` 1). The aux state is the residual stream between layers, MoE output included, as
for a dense model: capture hooks on the layer inputs are unchanged. The draft is a dense qwen3 layer whose MLP
width is the config's ``intermediate_size`` (the dense-equivalent width, not ``moe_intermediate_size``)."""

from speculators.families import ChatFormat, Family, register

FAMILY = register(
    Family(
        model_type="qwen3_moe",
        display_name="Qwen3-MoE",
        reference_config="Qwen/Qwen3-30B-A3B/config.json",
        draft_layer_type="qwen3",
        chat=ChatFormat(
            end_of_turn=("<|im_end|>",),
            thinking="stripped_from_history",
            tool_calls="<tool_call>{json}</tool_call> inside the assistant turn",
        ),
        capture_notes="MoE MLP in every layer (128 experts, 8 active); router logits are not part of the stream",
        quirks=("the draft is dense: the verifier's experts are never copied into it",),
    )
)
