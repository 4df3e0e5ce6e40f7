#!/usr/bin/env bash
# Train a dLLM (SDAR-layout) drafter for the tiny Qwen3 target with DEER's D2A recipe (CPU, 1 thread), then
# optionally SpecDiff-2's streak distillation. Resumable: re-run to continue an interrupted stage.
# Usage: scripts/train_tiny_d2a_drafter.sh [TARGET_DIR] [INIT] [RUN_DIR]
#   INIT: a dLLM checkpoint sharing the target's vocabulary (e.g. tiny-sdar), or "target" (a copy of the target).
# Minutes per stage: STAGE1_MINUTES (default 25), STAGE2_MINUTES (15), STREAK_MINUTES (0 = skip).
set -euo pipefail
TARGET=${1:-spiffy/data/models/tiny-qwen3}
INIT=${2:-target}
RUN=${3:-${SPIFFY_TRAIN_RUNS:-runs}/tiny-d2a}
CORPUS=${CORPUS:-$(dirname "$RUN")/corpus}
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
COMMON=(--target "$TARGET" --corpus "$CORPUS" --seed 0 --block-size 16 --seq-len 128 --prompt-len 32
        --num-anchors 8 --batch-size 8 --greedy-frac 0.5 --lr 5e-4 --warmup 20 --steps 100000 --schedule time
        --ckpt-every 10 --save-dtype bfloat16 --eval-prompts 16 --eval-new-tokens 48 --resume)
python -m spiffy.cli.main train-drafter --recipe d2a-stage1 --init "$INIT" --out "$RUN/stage1" \
  --max-minutes "${STAGE1_MINUTES:-25}" "${COMMON[@]}"
python -m spiffy.cli.main train-drafter --recipe d2a-stage2 --init "$RUN/stage1/model" --out "$RUN/stage2" \
  --max-masked 15 --alpha 1.01 --max-minutes "${STAGE2_MINUTES:-15}" "${COMMON[@]}"
if [ "${STREAK_MINUTES:-0}" != "0" ]; then
  python -m spiffy.cli.main train-drafter --recipe streak --init "$RUN/stage1/model" --out "$RUN/streak" \
    --max-minutes "$STREAK_MINUTES" "${COMMON[@]}"
fi
