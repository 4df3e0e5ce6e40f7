#!/usr/bin/env bash
# Calibrate Spiffy draft graphs for the tiny SDAR demo dLLM (one token per step, and threshold 0.9; code prompts from
# the held-out stdlib split) and benchmark them on 10 HumanEval prompts. One token per step: the graph tuned for
# D* = 5 (--budget 5: the default 10-node graph or one capped at lookahead 5 with 20 nodes, each pruning score replayed
# on the calibration prompts; in bfloat16 the capped one with the reach score wins), benched at D* = 1..5 against
# FreeDave with 2..6 draft steps and SSD with 2..6 states per forward in the same run (equal widths). Threshold 0.9: also tuned for D* = 5 (the default
# 10-node graph with the geometric-mean score wins), benched at D* in {1, 3, 5}. Then both again on the chat template
# (the `_chat` graphs, which `--chat` picks; one prompt format per graph, the underscore keeps the raw-prompt graphs first).
# CPU, 1 thread per process; the two configurations run side by side.
# Usage: scripts/calibrate_tiny_sdar.sh [MODEL_DIR] [RUN_DIR]
#        (defaults: spiffy/data/models/tiny-sdar, runs/tiny-sdar-bench; BLOCK=32 sets the block length; DTYPE the
#        model dtype, default bfloat16 = the shipped weights, as users run them; graphs are written to
#        $GRAPHS/tiny-sdar-{s1,t09}.json, GRAPHS=graphs by default: run `python scripts/ship_graphs.py` after it)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-spiffy/data/models/tiny-sdar}
RUNS=${2:-runs/tiny-sdar-bench}
BLOCK=${BLOCK:-32}
DTYPE=${DTYPE:-bfloat16}
GRAPHS=${GRAPHS:-graphs}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DEC_S1=(--gen-length 64 --block-length "$BLOCK" --steps 64 --dtype "$DTYPE")
DEC_T09=(--gen-length 64 --block-length "$BLOCK" --threshold 0.9 --dtype "$DTYPE")
mkdir -p "$RUNS" "$GRAPHS"

one_token_per_step() {
  spiffy calibrate --model "$MODEL" --prompts code --no-chat --budget 5 --no-progress --out "$GRAPHS/tiny-sdar-s1.json" \
    "${DEC_S1[@]}"
  spiffy bench dllm --model "$MODEL" --graph "$GRAPHS/tiny-sdar-s1.json" --budgets 1,2,3,4,5 --freedave 2,3,4,5,6 \
    --ssd 2,3,4,5,6 --dataset humaneval --skip 0 --max-prompts 10 --no-chat --no-progress "${DEC_S1[@]}" --out "$RUNS/s1"
}
threshold() {
  spiffy calibrate --model "$MODEL" --prompts code --no-chat --budget 5 --no-progress --out "$GRAPHS/tiny-sdar-t09.json" \
    "${DEC_T09[@]}"
  spiffy bench dllm --model "$MODEL" --graph "$GRAPHS/tiny-sdar-t09.json" --budgets 1,3,5 --dataset humaneval --skip 0 \
    --max-prompts 10 --no-chat --no-progress "${DEC_T09[@]}" --out "$RUNS/t09"
}
# the same two configurations on the chat template (what `--chat` users run; chosen by the prompt format):
# tiny-sdar-{s1,t09}_chat.json, benched on the default held-out prompts (HumanEval/90 on)
chat() {
  spiffy calibrate --model "$MODEL" --prompts code --budget 5 --no-progress --out "$GRAPHS/tiny-sdar-s1_chat.json" \
    "${DEC_S1[@]}"
  spiffy calibrate --model "$MODEL" --prompts code --budget 5 --no-progress --out "$GRAPHS/tiny-sdar-t09_chat.json" \
    "${DEC_T09[@]}"
  spiffy bench dllm --model "$MODEL" --graph "$GRAPHS/tiny-sdar-s1_chat.json" --chat --dataset humaneval --no-progress \
    "${DEC_S1[@]}" --out "$RUNS/s1_chat"
}
one_token_per_step > "$RUNS/s1.log" 2>&1 &
S1=$!
threshold > "$RUNS/t09.log" 2>&1 || { echo "threshold run failed: $RUNS/t09.log" >&2; exit 1; }
wait "$S1" || { echo "one-token-per-step run failed: $RUNS/s1.log" >&2; exit 1; }
chat > "$RUNS/chat.log" 2>&1 || { echo "chat-template run failed: $RUNS/chat.log" >&2; exit 1; }
echo "wrote $GRAPHS/tiny-sdar-{s1,t09}{,_chat}.json $RUNS/{s1,t09,s1_chat}/results.md"
