#!/usr/bin/env bash
# `make adapt-demo`: the draft learns from the traffic it serves (docs/adapt.md), after `make demo`:
#   the demo draft serves a shifted stream (maths word problems, scripts/serve_stream.py) in vLLM, which is recorded
#   as a gateway log ─train/adapt.py─▶ data_gen on the log (latest 15 % held out) ─▶ the draft warm-started, its
#   vocabulary kept, a quarter of each batch replayed from ShareGPT ─▶ export with its lineage ─▶ before/after on the
#   held-out window (our engine and vLLM) and on ShareGPT's held-out chats (forgetting)
# Resumable: run it again after an interruption. ADAPT_REQUESTS, ADAPT_CPU_S and extra adapt.* overrides as arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE="${RECIPE:-eagle3_smollm2}"
PARENT_RUN="${PARENT_RUN:-outputs/${RECIPE}}"
RUN_DIR="${RUN_DIR:-outputs/${RECIPE}-adapted}"
REQUESTS="${ADAPT_REQUESTS:-240}"
PY=.venv/bin/python
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE="${WANDB_MODE:-offline}" DS_BUILD_OPS=0
if [[ ! -f "${PARENT_RUN}/export/config.json" ]]; then
    echo "no demo draft at ${PARENT_RUN}/export: running make demo's stages first"
    RECIPE="${RECIPE}" scripts/demo.sh
fi
printf '\n\033[1m==> serving %s GSM8K requests with the demo draft in vLLM -> outputs/adapt_stream.jsonl\033[0m\n' "${REQUESTS}"
$PY scripts/serve_stream.py --draft "${PARENT_RUN}/export" --requests "${REQUESTS}" --max-tokens 192 \
    --out outputs/adapt_stream.jsonl
$PY train/adapt.py recipe="${RECIPE}" run_dir="${RUN_DIR}" adapt.traffic=outputs/adapt_stream.jsonl \
    adapt.parent="${PARENT_RUN}/export" adapt.window=0.15 adapt.cpu_seconds="${ADAPT_CPU_S:-200}" \
    adapt.eval.max_prompts=24 adapt.eval.max_new_tokens=96 adapt.eval.vllm=true "$@"
