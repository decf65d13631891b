#!/usr/bin/env bash
# Set up (editable installs of cpullm, its plugins and the test extras, at the versions pinned in
# constraints.txt; headless Chromium for the chat-page test) and run the whole test suite,
# real-model tests included. Installs into the active virtual environment, else into .venv at the
# repository root (created on first use), as scripts/run.sh does.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$CPULLM_ROOT"
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null) \
        || echo "warning: could not install chromium; the chat-page browser test will be skipped" >&2
fi
cpullm_env
cpullm_install test -c constraints.txt -e ".[test]" -e plugins/llama -e plugins/qwen -e plugins/gemma
exec "$CPULLM_PY" -m pytest -q -ra "$@"
