#!/usr/bin/env bash
# spiffy bench ar with every method and both acceptance rules, at T = 0 and T = 1, on HumanEval, GSM8K and
# MATH-500 prompts (embedded tiny Qwen3 target + embedded DFlash drafter + a dLLM drafter).
# Usage: examples/reproduce_arspec.sh DLLM_DRAFTER_DIR [DATASETS_DIR] [OUT_DIR]
set -euo pipefail
DLLM=${1:?give the dLLM drafter directory}
DATASETS=${2:-../shared/datasets}
OUT=${3:-runs/arspec}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
for T in 0 1; do
  for DS in humaneval gsm8k math500; do
    spiffy bench ar --dllm-drafter "$DLLM" --dataset "$DS" --datasets "$DATASETS" --max-prompts "${PROMPTS:-6}" \
      --max-new-tokens 64 --no-chat --budgets 32 --drafts 1,4,8 --accept coupled,rejection --temperature "$T" \
      --no-plots --no-progress --out "$OUT/$DS-T$T" > /dev/null   # exits 1 if a coupled output differs from AR
  done
done
