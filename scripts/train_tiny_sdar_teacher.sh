#!/usr/bin/env bash
# A candidate demo dLLM (issue 15), NOT the shipped tiny-sdar: scripts/train_tiny_sdar.sh (the embedded tiny Qwen3
# adapted to SDAR block diffusion, 85 min), then 60 more minutes of the same objective from its final training state,
# three quarters of every batch being low-entropy text: training-corpus prefixes continued greedily by the tiny Qwen3
# (3072 windows, generated once, ~14 min on a loaded machine). CPU, 1 thread. Resumable: re-run the same command.
# Measured (scripts/calibrate_tiny_sdar.sh on its output, 10 HumanEval prompts, gen 64, block 16): Spiffy 1.40x /
# 1.66x / 1.76x fewer NFE at D* = 1 / 3 / 5 (shipped tiny-sdar 1.27x / 1.44x / 1.53x), threshold 0.9 now fires
# (0.822 NFE/token against 1.253) and Spiffy gives 1.19x / 1.34x / 1.41x on top of it, every output identical to
# its baseline; but its greedy text is more degenerate (distinct-token ratio 0.070 against 0.089) and its held-out
# masked-token accuracy lower (37.6% / 27.7% / 11.7% against 39.4% / 28.4% / 11.9%), so it is not shipped: the
# tiny teacher's greedy continuations loop (half of the windows have a distinct ratio < 0.15 over their last 64
# tokens). The next attempt should filter them (--teacher-min-distinct 0.2 keeps 30% of the windows, so it needs about
# 3x the generation time) and/or use a larger share of corpus rows.
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
