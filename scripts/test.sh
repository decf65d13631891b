#!/usr/bin/env bash
# Set up (editable installs of cpullm, its plugins and the test extras) and run the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e ".[test]" -e plugins/llama -e plugins/qwen -e plugins/gemma
python -m pytest -q -ra "$@"
