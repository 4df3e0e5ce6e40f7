#!/usr/bin/env bash
# Reproduce the DFlash drafter of the small Qwen3 target (1.18M parameters of its own, a tenth of the target's:
# 2 layers, MLP 384, features of target layers 2, 7, 12; CPU, 1 thread, 150 minutes). Resumable: re-run to continue
# (the time budget counts across resumes; a larger MAX_MINUTES on a finished run trains it further, the cosine
# following the share of the new budget). The shipped drafter was trained in four invocations (MAX_MINUTES 40, then
# 130, 160 and 150, each stopped and resumed: 150 minutes in all).
# Usage: scripts/train_small_drafter.sh [TARGET_DIR] [RUN_DIR]   (defaults under $SPIFFY_TRAIN_RUNS, default runs)
set -euo pipefail
TARGET=${1:-${SPIFFY_TRAIN_RUNS:-runs}/small-qwen3/model}
RUN=${2:-${SPIFFY_TRAIN_RUNS:-runs}/small-qwen3-dflash}
CORPUS=${CORPUS:-$(dirname "$RUN")/corpus}
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m spiffy.cli.main train-drafter --target "$TARGET" --out "$RUN" --corpus "$CORPUS" --seed 0 \
  --num-layers 2 --intermediate 384 --target-layer-ids 2 7 12 --block-size 16 --seq-len 160 --prompt-len 32 \
  --num-anchors 24 --batch-size 8 --greedy-frac 0.8 --gamma 7 --lr 2e-3 --warmup 20 --steps 100000 --schedule time \
  --max-minutes "${MAX_MINUTES:-150}" --ckpt-every 10 --save-dtype bfloat16 --threads 1 --resume
