#!/usr/bin/env bash
# The GPU checks of translation, in one go: the CUDA tests, then the cost benchmark in bfloat16 (eager, batch 1 and
# 32, 512-8,192 tokens, beside the target's prefill), then the translator compiled with CUDA graphs.
#
#   bash scripts/gpu_check.sh OUT_DIR [SOURCE TARGET]
#
# SOURCE and TARGET default to the embedded models; on a machine that cannot hold their converted weights, pass
# folders with only their config and tokenizer files: the models are then built with random weights, which times
# the same work. Each step has its own time limit, so one that fails or hangs leaves the others' results.
set -uo pipefail
out="${1:?usage: bash scripts/gpu_check.sh OUT_DIR [SOURCE TARGET]}"
source="${2:-smollm2-135m}"
target="${3:-gemma3-270m}"
python="${PYTHON:-python3}"
mkdir -p "$out"
models=(--source "$source" --target "$target" --device cuda --dtype bfloat16)
[ -d "$source" ] && models+=(--random-weights)
export PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 150 "$python" -m pytest -q -p no:cacheprovider tests/test_device.py 2>&1 | tail -15
timeout 300 "$python" benchmarks/translation_cost.py "${models[@]}" --lengths 512 1024 2048 4096 8192 \
    --batch-sizes 1 32 --trials 10 --output "$out/translation_cost_h200_bfloat16.json"
timeout 240 "$python" benchmarks/translation_cost.py "${models[@]}" --compile --lengths 4096 --trials 20 \
    --output "$out/translation_cost_h200_bfloat16_compiled.json"
