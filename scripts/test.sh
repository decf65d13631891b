#!/usr/bin/env bash
# Set up (editable installs of cpullm, its plugins and the test extras; headless Chromium for the
# chat-page test) and run the whole test suite, real-model tests included.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null) \
        || echo "warning: could not install chromium; the chat-page browser test will be skipped" >&2
fi
python -m pip install -q --disable-pip-version-check -e ".[test]" -e plugins/llama -e plugins/qwen -e plugins/gemma
python -m pytest -q -ra "$@"
