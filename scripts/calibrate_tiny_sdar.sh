#!/usr/bin/env bash
# Calibrate Spiffy draft graphs for the tiny SDAR dLLM (one token per step, and threshold 0.9; code prompts from the
# held-out stdlib split) and benchmark them on 10 HumanEval prompts (D = 10 nodes, D* in {1, 3, 5}). CPU, 1 thread.
# Usage: scripts/calibrate_tiny_sdar.sh [MODEL_DIR] [RUN_DIR]
#        (defaults: spiffy/data/models/tiny-sdar, runs/tiny-sdar-bench; BLOCK=16 sets the block length)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-spiffy/data/models/tiny-sdar}
RUNS=${2:-runs/tiny-sdar-bench}
BLOCK=${BLOCK:-16}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DEC_S1=(--gen-length 64 --block-length "$BLOCK" --steps 64)
DEC_T09=(--gen-length 64 --block-length "$BLOCK" --threshold 0.9)

spiffy calibrate --model "$MODEL" --prompts code --no-chat --nodes 10 --no-progress --out graphs/tiny-sdar-s1.json "${DEC_S1[@]}"
spiffy calibrate --model "$MODEL" --prompts code --no-chat --nodes 10 --no-progress --out graphs/tiny-sdar-t09.json "${DEC_T09[@]}"

spiffy bench dllm --model "$MODEL" --graph graphs/tiny-sdar-s1.json --budgets 1,3,5 --dataset humaneval --max-prompts 10 \
  --no-chat --no-progress "${DEC_S1[@]}" --out "$RUNS/s1"
spiffy bench dllm --model "$MODEL" --graph graphs/tiny-sdar-t09.json --budgets 1,3,5 --dataset humaneval --max-prompts 10 \
  --no-chat --no-progress "${DEC_T09[@]}" --out "$RUNS/t09"
