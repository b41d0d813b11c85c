"""Qwen3 dense verifiers: ``model.model.layers``; per-head q/k RMSNorm in attention, hence the qwen3 draft layer
(vLLM's ``Eagle3Qwen3ForCausalLM``). ChatML (``<|im_end|>``); the template drops the ``<think>`` block of every
assistant turn before the last user message, so a whole conversation is not prefix-stable and the masker goes per
turn."""

from speculators.families import ChatFormat, Family, register

FAMILY = register(
    Family(
        model_type="qwen3",
        display_name="Qwen3",
        reference_config="Qwen/Qwen3-8B/config.json",
        draft_layer_type="qwen3",
        chat=ChatFormat(
            end_of_turn=("<|im_end|>",),
            thinking="stripped_from_history",
            tool_calls="<tool_call>{json}</tool_call> inside the assistant turn; tool results in a user turn "
            "wrapped in <tool_response>",
        ),
        capture_notes="dense",
    )
)
