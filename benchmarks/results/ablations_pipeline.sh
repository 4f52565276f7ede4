#!/bin/bash
# The record of the run that produced ablations.json (training phase 2 of the shipped translator, the
# equal-budget ablations, then one LM-fidelity pass over all of them). Phase 1 was:
#   hf-mot train --source smollm2-135m --target gemma3-270m --output-dir runs/mot-kv --max-steps 650 --batch-size 4 \
#     --context-words 24 160 --continuation-words 16 --learning-rate 1e-3 --warmup-steps 20 --save-steps 50 \
#     --logging-steps 10 --nll-weight 0 --kl-weight 0 --time-budget-minutes 32
# Sequential CPU pipeline: phase 2 of the main translator, equal-budget ablations, then held-out LM fidelity.
cd /work/main
while pgrep -f "output-dir runs/mot-kv " > /dev/null; do sleep 10; done
H=.venv/bin/hf-mot
common="--source smollm2-135m --target gemma3-270m --batch-size 4 --context-words 24 160 --continuation-words 16 --save-steps 25 --logging-steps 10"
echo "phase2 start $(date)"
$H train $common --init-from runs/mot-kv --output-dir runs/mot-main --max-steps 230 --learning-rate 5e-4 --warmup-steps 10 --kv-weight 2 --time-budget-minutes 25 > runs/mot-main.log 2>&1
echo "ablations start $(date)"
$H train $common --output-dir runs/abl-mot-kv --max-steps 90 --nll-weight 0 --kl-weight 0 --warmup-steps 10 --time-budget-minutes 4 > runs/abl-mot-kv.log 2>&1
$H train $common --init-from runs/abl-mot-kv --output-dir runs/abl-mot --max-steps 37 --learning-rate 5e-4 --warmup-steps 5 --kv-weight 2 --time-budget-minutes 4 > runs/abl-mot.log 2>&1
$H train $common --output-dir runs/abl-single-kv --num-experts 1 --num-experts-per-token 1 --expert-hidden-size 2048 --max-steps 90 --nll-weight 0 --kl-weight 0 --warmup-steps 10 --time-budget-minutes 4 > runs/abl-single-kv.log 2>&1
$H train $common --init-from runs/abl-single-kv --output-dir runs/abl-single --max-steps 37 --learning-rate 5e-4 --warmup-steps 5 --kv-weight 2 --time-budget-minutes 4 > runs/abl-single.log 2>&1
$H train $common --output-dir runs/abl-noccl --max-steps 105 --kv-weight 0 --kl-weight 0 --warmup-steps 10 --time-budget-minutes 8 > runs/abl-noccl.log 2>&1
$H train $common --output-dir runs/abl-c2c --architecture per_layer --expert-hidden-size 460 --max-steps 105 --kv-weight 0 --kl-weight 0 --warmup-steps 10 --time-budget-minutes 8 > runs/abl-c2c.log 2>&1
echo "fidelity start $(date)"
.venv/bin/python benchmarks/lm_fidelity.py --translator mot=runs/mot-main --translator mot-kv-phase=runs/mot-kv --translator mot-8min=runs/abl-mot --translator single-8min=runs/abl-single --translator no-ccl-8min=runs/abl-noccl --translator per-layer-8min=runs/abl-c2c --full-only mot-kv-phase mot-8min single-8min no-ccl-8min per-layer-8min --lengths 64 128 256 512 --per-length 50 > runs/fidelity.log 2>&1
echo "done $(date)"
