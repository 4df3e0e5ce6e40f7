#!/usr/bin/env bash
# spiffy bench ar with every method and both acceptance rules, at T = 0 and T = 1, on HumanEval, GSM8K and
# MATH-500 prompts (embedded tiny Qwen3 target + embedded DFlash drafter + a dLLM drafter).
# Usage: examples/reproduce_arspec.sh [DLLM_DRAFTER_DIR] [OUT_DIR]
#   DLLM_DRAFTER_DIR: default the embedded one (tiny-sdar-d2a); the prompt sets are the copies shipped in the package.
#   PROMPTS (default 10) prompts per dataset, NEW_TOKENS (default 48) new tokens per prompt.
set -euo pipefail
DLLM=${1:-$(python -c 'from spiffy.embedded import embedded_model_path; print(embedded_model_path("ar-dllm-drafter"))')}
OUT=${2:-runs/arspec}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
for T in 0 1; do
  for DS in humaneval gsm8k math500; do
    spiffy bench ar --dllm-drafter "$DLLM" --dataset "$DS" --max-prompts "${PROMPTS:-10}" \
      --max-new-tokens "${NEW_TOKENS:-48}" --no-chat --budgets 32 --drafts 1,4,8 --accept coupled,rejection \
      --temperature "$T" --no-plots --no-progress --out "$OUT/$DS-T$T" > /dev/null   # exits 1 if a coupled output differs from AR
  done
done
