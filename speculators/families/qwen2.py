"""Qwen2 / Qwen2.5 verifiers: Llama layout with q/k/v biases and no q/k norm, so vLLM builds a llama draft layer.
ChatML (``<|im_end|>``) with a default system prompt the template inserts when the conversation has none; no
thinking blocks."""

from speculators.families import ChatFormat, Family, register

FAMILY = register(
    Family(
        model_type="qwen2",
        display_name="Qwen2.5",
        reference_config="Qwen/Qwen2.5-7B-Instruct/config.json",
        draft_layer_type="llama",
        chat=ChatFormat(
            end_of_turn=("<|im_end|>",),
            tool_calls="<tool_call>{json}</tool_call> inside the assistant turn",
            notes="the template adds 'You are Qwen, created by Alibaba Cloud...' when there is no system turn",
        ),
        capture_notes="dense; attention has q/k/v biases (the draft layer does not need them)",
        quirks=("sliding-window settings in config.json are off (use_sliding_window false) for 7B",),
    )
)
