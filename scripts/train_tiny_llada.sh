#!/usr/bin/env bash
# Reproduce spiffy's tiny LLaDA-architecture dLLM (CPU, 1 thread, 45 minutes). Resumable: re-run the same command to continue.
# Usage: scripts/train_tiny_llada.sh [RUN_DIR]   (default $SPIFFY_TRAIN_RUNS/tiny-llada, SPIFFY_TRAIN_RUNS=runs;
#        the corpus is built (reproducibly, from this Python's stdlib) and cached next to RUN_DIR)
set -euo pipefail
RUN=${1:-${SPIFFY_TRAIN_RUNS:-runs}/tiny-llada}
CORPUS=${CORPUS:-$(dirname "$RUN")/corpus}
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m spiffy.train.dllm --out "$RUN" --corpus "$CORPUS" --seed 0 \
  --vocab-size 4096 --hidden 256 --layers 4 --heads 4 --mlp 768 \
  --context 256 --max-positions 512 --batch-size 8 --steps 100000 --schedule time --lr 1e-3 --warmup 50 --weighting mean \
  --prompt-frac 0.3 --ckpt-every 50 --max-minutes "${MAX_MINUTES:-45}" --save-dtype bfloat16 --resume
