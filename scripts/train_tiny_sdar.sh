#!/usr/bin/env bash
# Reproduce spiffy's tiny SDAR block-diffusion dLLM: the embedded tiny Qwen3 adapted to block diffusion (CPU, 1 thread,
# 85 minutes). Resumable: re-run the same command to continue.
# Usage: scripts/train_tiny_sdar.sh [RUN_DIR]   (default $SPIFFY_TRAIN_RUNS/tiny-sdar, SPIFFY_TRAIN_RUNS=runs;
#        the corpus is built (reproducibly, from this Python's stdlib) and cached next to RUN_DIR)
set -euo pipefail
RUN=${1:-${SPIFFY_TRAIN_RUNS:-runs}/tiny-sdar}
INIT=${INIT:-$(cd "$(dirname "$0")/.." && pwd)/spiffy/data/models/tiny-qwen3}
CORPUS=${CORPUS:-$(dirname "$RUN")/corpus}
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m spiffy.train.sdar --out "$RUN" --corpus "$CORPUS" --seed 0 --init "$INIT" \
  --context 256 --blocks 16,32 --batch-size 8 --steps 100000 --schedule time --lr 2e-3 --warmup 50 \
  --prompt-frac 0.2 --ckpt-every 50 --eval-every 250 --max-minutes "${MAX_MINUTES:-85}" --save-dtype bfloat16 --resume
