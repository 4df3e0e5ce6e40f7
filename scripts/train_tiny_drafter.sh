#!/usr/bin/env bash
# Reproduce spiffy's tiny DFlash drafter for the tiny Qwen3 target (CPU, 1 thread, 45 minutes). Resumable: re-run to continue.
# Usage: scripts/train_tiny_drafter.sh [TARGET_DIR] [RUN_DIR]   (defaults under $SPIFFY_TRAIN_RUNS, default runs)
set -euo pipefail
TARGET=${1:-${SPIFFY_TRAIN_RUNS:-runs}/tiny-qwen3/model}
RUN=${2:-${SPIFFY_TRAIN_RUNS:-runs}/tiny-drafter}
CORPUS=${CORPUS:-$(dirname "$RUN")/corpus}
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m spiffy.cli.main train-drafter --target "$TARGET" --out "$RUN" --corpus "$CORPUS" --seed 0 \
  --num-layers 2 --target-layer-ids 1 3 --block-size 16 --seq-len 160 --prompt-len 32 --num-anchors 24 \
  --batch-size 8 --greedy-frac 0.5 --gamma 7 --lr 2e-3 --warmup 20 --steps 100000 --schedule time \
  --max-minutes "${MAX_MINUTES:-45}" --ckpt-every 10 --save-dtype bfloat16 --resume
