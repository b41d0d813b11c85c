"""Gemma 3 verifiers: the text-only ``Gemma3ForCausalLM`` (model_type gemma3_text: 270M, 1B) keeps its stack at
``model.model``; the multimodal ``Gemma3ForConditionalGeneration`` (gemma3: 4B and up) wraps it at
``model.model.language_model`` with the text settings in ``text_config`` (tensors ``model.language_model.*``).

Head: the final RMSNorm multiplies by ``(1 + w)``, not ``w`` (Gemma 1-3; Gemma 4 went back to ``w``). Nothing here
declares it: the trainer's head is the verifier's own ``Gemma3RMSNorm`` (:func:`train.targets.verifier_norm_module`)
and is checked against the verifier's recorded logits before training (:mod:`speculators.head_check`).
``final_logit_softcapping`` is null in the published configs; a config that sets it gets the soft cap.

Capture: the embedding is multiplied by sqrt(hidden_size) inside ``embed_tokens`` (scaled word embedding), so aux
id 0 is the scaled embedding. Layers alternate five sliding-window layers (window 512 on 270M/1B) with one full
layer, with q/k norms and four norms per layer; none of it changes the aux state (the residual stream entering a
layer). The draft is a llama layer with a silu MLP, shaped by the sliding layers' rope (theta 10k).

Serving: vLLM's Gemma 3 model classes do not implement its EAGLE-3 aux-hidden-state interface, so NO vLLM (GPU or
CPU) serves an EAGLE-3, P-EAGLE or DFlash draft for a Gemma 3 verifier; our engine does. The pipeline says so in one
line before any compute (:func:`speculators.families.vllm_serving_note`).

Chat format: ``<start_of_turn>{user|model}\\n{content}<end_of_turn>\\n``; a system message is folded into the first
user turn; the generation prompt is ``<start_of_turn>model\\n``.
"""

from speculators.families import ChatFormat, Family, register, sqrt_hidden

AUX_STATES_REFUSAL = "Model does not support EAGLE3 interface"  # both runners say it (the V1 one goes on)

FAMILY = register(
    Family(
        model_type="gemma3_text",
        aliases=("gemma3",),
        display_name="Gemma 3",
        reference_config="google/gemma-3-270m/config.json",
        draft_layer_type="llama",
        chat=ChatFormat(
            end_of_turn=("<end_of_turn>",),
            notes="the system message is folded into the first user turn",
        ),
        text_config_key="text_config",
        stack_path=("model", "language_model"),
        tensor_prefix="model.language_model.",
        embedding_scale=sqrt_hidden,
        draft_rope_type="sliding_attention",
        vllm_refusal=AUX_STATES_REFUSAL,
        vllm_cpu=AUX_STATES_REFUSAL,
        capture_notes="sliding/full attention 5:1, q/k norms, four norms per layer",
        quirks=(
            "final RMSNorm multiplies by (1 + w): the head uses the verifier's own Gemma3RMSNorm",
            "hidden_activation (gelu_pytorch_tanh) is not copied: vLLM's llama draft MLP is silu",
        ),
    )
)
