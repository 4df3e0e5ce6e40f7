#!/usr/bin/env bash
# Reproduce spiffy's demo dLLM (issue 15): tiny-sdar (scripts/train_tiny_sdar.sh, 85 min) continued on the tiny Qwen3's
# greedy continuations (scripts/train_tiny_sdar_teacher.sh, 60 min), then 75 more minutes in which 60% of every
# batch's rows are function completions from the training split of the stdlib corpus (the def line and docstring as a
# clean prompt, a body of at most 64 tokens, then end-of-text to the window's end: the supervised format of
# instruction-tuned dLLMs; spiffy.train.functions), the rest corpus windows; blocks 32 and 64. CPU, 1 thread.
# Resumable: re-run the same command.
# Usage: scripts/train_tiny_sdar_functions.sh [RUN_DIR] [TEACHER_RUN_DIR] [FIRST_RUN_DIR]
#        (defaults $SPIFFY_TRAIN_RUNS/tiny-sdar-fn, .../tiny-sdar-teacher, .../tiny-sdar; SPIFFY_TRAIN_RUNS=runs)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUNS=${SPIFFY_TRAIN_RUNS:-runs}
RUN=${1:-$RUNS/tiny-sdar-fn}
TEACHER_RUN=${2:-$RUNS/tiny-sdar-teacher}
FIRST=${3:-$RUNS/tiny-sdar}
INIT=${INIT:-$HERE/../spiffy/data/models/tiny-qwen3}
CORPUS=${CORPUS:-$(dirname "$FIRST")/corpus}
[ -f "$TEACHER_RUN/model/config.json" ] || "$HERE/train_tiny_sdar_teacher.sh" "$TEACHER_RUN" "$FIRST"
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m spiffy.train.sdar --out "$RUN" --corpus "$CORPUS" --seed 2 --init "$INIT" \
  --start-from "$TEACHER_RUN/train_state.pt" --functions-frac 0.6 --functions-max-answer 64 \
  --context 256 --blocks 32,64 --batch-size 8 --steps 100000 --schedule time --lr 1e-3 --warmup 20 \
  --prompt-frac 0.2 --ckpt-every 50 --eval-every 250 --max-minutes "${MAX_MINUTES:-75}" --save-dtype bfloat16 \
  --sample-tokens 64 --card-script scripts/train_tiny_sdar_functions.sh --resume
