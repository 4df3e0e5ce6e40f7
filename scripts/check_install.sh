#!/usr/bin/env bash
# Prove that a plain, non-editable `pip install .` works for a new user: a fresh virtual environment, the package
# installed from this checkout (no extras), every command run from an empty temporary directory, so nothing can come
# from the repository (models, graphs, datasets must be package data). Run by .ci/run; takes a few minutes.
# Usage: scripts/check_install.sh [WORK_DIR]   (default: a new temporary directory, removed afterwards)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d)}
[ $# -ge 1 ] || trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

python3 -m venv "$WORK/venv"
# shellcheck disable=SC1091
. "$WORK/venv/bin/activate"
pip install --quiet torch==2.13.0
pip install --quiet "$REPO"
mkdir -p "$WORK/empty" && cd "$WORK/empty"

where=$(python -c 'import spiffy, pathlib; print(pathlib.Path(spiffy.__file__).resolve().parent)')
case "$where" in
  "$REPO"/*) echo "check_install: spiffy was imported from the checkout ($where), not from the install" >&2; exit 1 ;;
esac
echo "check_install: spiffy installed at $where"

set -x
spiffy demo --random-tiny --no-progress
spiffy bench dllm --dataset mbpp --max-prompts 1 --budgets 1 --gen-length 64 --block-length 32 --steps 64 --out D \
  --no-progress
spiffy bench ar --dataset gsm8k --max-prompts 1 --budgets 16 --max-new-tokens 16 --out D2 --no-progress
spiffy generate --prompt "def add(a, b):" --gen-length 64 --block-length 32 --steps 64 --graph tiny-sdar-s1 \
  --no-progress
set +x
test -s D/results.json && test -s D2/results.json
grep -q '"all_identical": true' D/results.json && grep -q '"all_identical": true' D2/results.json

set +e
spiffy generate --prompt "" 2> err.txt
rc=$?
set -e
if [ "$rc" -ne 2 ] || [ "$(wc -l < err.txt)" -ne 1 ] || ! grep -q "the prompt is empty" err.txt; then
  echo "check_install: \`spiffy generate --prompt \"\"\` should exit 2 with a one-line error; got $rc:" >&2
  cat err.txt >&2
  exit 1
fi
echo "check_install: OK (non-editable install, commands run from an empty directory)"
