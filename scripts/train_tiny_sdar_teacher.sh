#!/usr/bin/env bash
# Reproduce spiffy's tiny-sdar: scripts/train_tiny_sdar.sh (the embedded tiny Qwen3 adapted to SDAR block diffusion,
# 85 min), then 60 more minutes of the same objective from its final training state, three quarters of every batch
# being low-entropy text: training-corpus prefixes continued greedily by the tiny Qwen3 (3072 windows, generated
# once, ~10 min). CPU, 1 thread. Resumable: re-run the same command to continue.
# Usage: scripts/train_tiny_sdar_teacher.sh [RUN_DIR] [FIRST_RUN_DIR]
#        (defaults $SPIFFY_TRAIN_RUNS/tiny-sdar-teacher and $SPIFFY_TRAIN_RUNS/tiny-sdar, SPIFFY_TRAIN_RUNS=runs;
#        the first run is made with scripts/train_tiny_sdar.sh when it has not finished)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${1:-${SPIFFY_TRAIN_RUNS:-runs}/tiny-sdar-teacher}
FIRST=${2:-${SPIFFY_TRAIN_RUNS:-runs}/tiny-sdar}
INIT=${INIT:-$HERE/../spiffy/data/models/tiny-qwen3}
CORPUS=${CORPUS:-$(dirname "$FIRST")/corpus}
[ -f "$FIRST/model/config.json" ] || "$HERE/train_tiny_sdar.sh" "$FIRST"
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m spiffy.train.sdar --out "$RUN" --corpus "$CORPUS" --seed 1 --init "$INIT" \
  --start-from "$FIRST/train_state.pt" --teacher "$INIT" --teacher-windows 3072 --teacher-prefix 16,160 \
  --teacher-frac 0.75 --context 256 --blocks 16,32 --batch-size 8 --steps 100000 --schedule time --lr 1e-3 \
  --warmup 20 --prompt-frac 0.2 --ckpt-every 50 --eval-every 250 --max-minutes "${MAX_MINUTES:-60}" \
  --save-dtype bfloat16 --card-script scripts/train_tiny_sdar_teacher.sh --resume
