#!/usr/bin/env bash
# Reproduce spiffy's small Qwen3 target (12.1M parameters, 14 layers: the wall-clock pair's target; CPU, 1 thread,
# 70 minutes of training time). Resumable: re-run the same command to continue (the budget counts across resumes).
# Usage: scripts/train_small_qwen3.sh [RUN_DIR]   (default $SPIFFY_TRAIN_RUNS/small-qwen3, SPIFFY_TRAIN_RUNS=runs;
#        the corpus is built (reproducibly, from this Python's stdlib) and cached next to RUN_DIR; the tokenizer is
#        the demo target's, so the two pairs share token ids)
# To train the shipped model further in a fresh RUN_DIR: EXTRA="--init-from spiffy/data/models/small-qwen3" scripts/train_small_qwen3.sh DIR
set -euo pipefail
RUN=${1:-${SPIFFY_TRAIN_RUNS:-runs}/small-qwen3}
CORPUS=${CORPUS:-$(dirname "$RUN")/corpus}
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m spiffy.train.ar --out "$RUN" --name small-qwen3 --role "wall-clock target" --corpus "$CORPUS" --seed 0 --tokenizer spiffy/data/models/tiny-qwen3 \
  --vocab-size 4096 --hidden 256 --layers 14 --heads 4 --kv-heads 2 --intermediate 768 \
  --context 256 --max-positions 1024 --batch-size 8 --steps 100000 --schedule time --lr 2e-3 --warmup 100 \
  --ckpt-every 50 --eval-every 500 --max-minutes "${MAX_MINUTES:-70}" --save-dtype bfloat16 --threads 1 --resume ${EXTRA:-}
