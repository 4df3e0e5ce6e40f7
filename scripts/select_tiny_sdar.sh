#!/usr/bin/env bash
# Checkpoint selection for the demo dLLM (scripts/train_tiny_sdar_mbpp.sh): for every kept snapshot whose step is a
# multiple of EVERY (default 300), export it, calibrate a D = 10 graph on HumanEval 41-90 and bench Spiffy at D* = 5
# on HumanEval 11-30 (bfloat16, greedy, gen 64 / block 32, one token per step). HumanEval 1-10, the benchmark's
# prompts, are never used. Prints one line per snapshot: projected ceiling, NFE reduction, distinct-token ratio,
# whitespace share; pick the highest reduction with distinct >= 0.15 and pass it as EXPORT_STEP.
# Usage: scripts/select_tiny_sdar.sh [RUN_DIR] [OUT_DIR]   (defaults runs/tiny-sdar-mb, runs/tiny-sdar-select)
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/tiny-sdar-mb}
OUT=${2:-runs/tiny-sdar-select}
EVERY=${EVERY:-300}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
fail() { echo "failed, see $1:" >&2; tail -5 "$1" >&2; exit 1; }
python - "$OUT" <<'EOF'
import json, sys
from spiffy.bench.datasets import load_benchmark_prompts
prompts = load_benchmark_prompts("humaneval")
for name, part in (("calibration", prompts[40:90]), ("validation", prompts[10:30])):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": p.prompt, "id": p.id}) + "\n" for p in part)
EOF
DEC=(--gen-length 64 --block-length 32 --steps 64 --dtype bfloat16)
for snap in $(ls "$RUN/snapshots" | sed 's/step-\([0-9]*\)\.pt/\1/' | sort -n); do
  (( snap % EVERY == 0 )) || continue
  S="$OUT/step-$snap"
  mkdir -p "$S"
  python - "$RUN/snapshots/step-$snap.pt" "$S/model" > "$S/export.log" 2>&1 <<'EOF' || fail "$S/export.log"
import sys
from spiffy.embedded import embedded_model_path
from spiffy.train import sdar
model, tok = sdar.init_from_qwen3(embedded_model_path("ar-target"))
sdar.load_start_weights(model, sys.argv[1])
sdar.save_weights(model, tok, sys.argv[2], "bfloat16")
EOF
  spiffy calibrate --model "$S/model" --prompts "$OUT/calibration.jsonl" --no-chat --nodes 10 --no-progress \
    --out "$S/graph.json" "${DEC[@]}" > "$S/calibrate.log" 2>&1 || fail "$S/calibrate.log"
  spiffy bench dllm --model "$S/model" --graph "$S/graph.json" --budgets 5 --dataset "$OUT/validation.jsonl" --max-prompts 20 \
    --no-chat --no-progress --warmup 0 --no-plots "${DEC[@]}" --out "$S/validation" > "$S/bench.log" 2>&1 || fail "$S/bench.log"
  echo "step $snap: ceiling $(grep -o '[0-9.]*x fewer' "$S/calibrate.log" | head -1);" \
    "D*=5 / distinct / ws: $(grep -E '^\| spiffy' "$S/validation/results.md" | cut -d'|' -f5,10,11)"
done
