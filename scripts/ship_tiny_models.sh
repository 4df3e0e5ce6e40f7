#!/usr/bin/env bash
# Check the trained tiny checkpoints through spiffy's loaders and copy them into the package
# (spiffy/data/models/<name>/) as the embedded defaults.
# Usage: scripts/ship_tiny_models.sh [RUNS_DIR]   (default $SPIFFY_TRAIN_RUNS, default runs)
set -euo pipefail
RUNS=${1:-${SPIFFY_TRAIN_RUNS:-runs}}
DEST=$(cd "$(dirname "$0")/.." && pwd)/spiffy/data/models
args=()
[ -f "$RUNS/tiny-qwen3/model/config.json" ] && args+=(--qwen3 "$RUNS/tiny-qwen3/model")
[ -f "$RUNS/tiny-drafter/model/config.json" ] && args+=(--drafter "$RUNS/tiny-drafter/model")
[ -f "$RUNS/tiny-llada/model/config.json" ] && args+=(--llada "$RUNS/tiny-llada/model")
python -m spiffy.train.check "${args[@]}" --max-new-tokens 64 --json "$RUNS/check.json"
SDAR=$RUNS/tiny-sdar-mb  # the last stage of the demo dLLM (scripts/train_tiny_sdar_mbpp.sh)
if [ -f "$SDAR/model/config.json" ]; then
  python -m spiffy.train.check_sdar --model "$SDAR/model" --heldout "$SDAR/data/heldout_ids.npy" \
    --json "$RUNS/check_sdar.json"
fi
mkdir -p "$DEST"
ship() {  # ship SRC NAME: copy into a temp dir, then swap it in
  [ -f "$1/config.json" ] || return 0
  rm -rf "$DEST/.$2.tmp" && cp -r "$1" "$DEST/.$2.tmp" && chmod -R a+rX "$DEST/.$2.tmp"
  rm -rf "$DEST/$2" && mv "$DEST/.$2.tmp" "$DEST/$2"
  echo "shipped $1 -> $DEST/$2 ($(du -sh "$DEST/$2" | cut -f1))"
}
ship "$RUNS/tiny-qwen3/model" tiny-qwen3
ship "$RUNS/tiny-drafter/model" tiny-qwen3-dflash-b16
ship "$RUNS/tiny-llada/model" tiny-llada
ship "$SDAR/model" tiny-sdar
du -sh "$DEST"
echo "note: graphs calibrated for older weights stay lossless but accept less: recalibrate graphs/ and run" \
  "scripts/ship_graphs.py (examples/reproduce_results.sh does both)"
