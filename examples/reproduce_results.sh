#!/usr/bin/env bash
# Regenerate the results tables of docs/RESULTS.md on the embedded tiny models (CPU, ~15 minutes on 2 cores).
# Outputs: runs/<name>/{results.json,results.md,*.png}; the Markdown tables are copied to examples/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DEC_S1=(--gen-length 64 --block-length 32 --steps 64)
DEC_T09=(--gen-length 64 --block-length 32 --threshold 0.9)

LLADA=(--model spiffy/data/models/tiny-llada)

# 1. the demo dLLM (tiny-sdar): calibrate its shipped graphs (code prompts from the held-out stdlib split, raw prompts)
#    and bench them on 10 HumanEval prompts (gen 64, block 32): one token per step, Spiffy (D = 20 up to lookahead 5,
#    reach pruning, D* = 1..5) against FreeDave (2..6 draft steps); threshold 0.9, Spiffy (D = 10, D* in {1, 3, 5})
scripts/calibrate_tiny_sdar.sh spiffy/data/models/tiny-sdar runs/tiny-sdar-bench

# 2. the earlier LLaDA-architecture demo dLLM (tiny-llada), same protocol
spiffy calibrate "${LLADA[@]}" --prompts code --no-chat --nodes 10 --out graphs/tiny-llada-s1.json "${DEC_S1[@]}"
spiffy calibrate "${LLADA[@]}" --prompts code --no-chat --nodes 10 --out graphs/tiny-llada-t09.json "${DEC_T09[@]}"
python scripts/ship_graphs.py   # the package carries the graphs next to their models (spiffy/data/models/*/graphs/)
spiffy bench dllm "${LLADA[@]}" --graph graphs/tiny-llada-s1.json --budgets 1,3,5 --freedave 2,4,6 --dataset humaneval --skip 0 \
  --max-prompts 10 --no-chat "${DEC_S1[@]}" --out runs/dllm-humaneval-s1
spiffy bench dllm "${LLADA[@]}" --graph graphs/tiny-llada-t09.json --budgets 1,3,5 --dataset humaneval --skip 0 --max-prompts 10 \
  --no-chat "${DEC_T09[@]}" --out runs/dllm-humaneval-t09

# 3. AR vs DFlash vs DDTree (budgets 16..256), HumanEval prompts
spiffy bench ar --budgets 16,32,64,128,256 --dataset humaneval --max-prompts 10 --max-new-tokens 64 --no-chat \
  --out runs/ar-humaneval

# 4. throughput at batch sizes 1, 4 and 16: every method on the same 16 prompts, one run per mode
spiffy bench dllm "${LLADA[@]}" --graph graphs/tiny-llada-s1.json --batch-sizes 1,4,16 --budgets 3 --max-prompts 16 \
  "${DEC_S1[@]}" --out runs/throughput-dllm
spiffy bench ar --batch-sizes 1,4,16 --budgets 16 --drafts 4 --max-prompts 16 --max-new-tokens 32 --out runs/throughput-ar

mkdir -p examples/results
cp runs/throughput-dllm/throughput.md examples/results/throughput-dllm.md
cp runs/throughput-ar/throughput.md examples/results/throughput-ar.md
cp runs/tiny-sdar-bench/s1/results.md examples/results/sdar-humaneval-s1.md
cp runs/tiny-sdar-bench/t09/results.md examples/results/sdar-humaneval-t09.md
cp runs/dllm-humaneval-s1/results.md examples/results/dllm-humaneval-s1.md
cp runs/dllm-humaneval-t09/results.md examples/results/dllm-humaneval-t09.md
cp runs/ar-humaneval/results.md examples/results/ar-humaneval.md
cp runs/ar-humaneval/tradeoff.png examples/results/ar-humaneval-tradeoff.png
