"""One-line notices to stderr, shared by the API and the CLI (``CPULLM_QUIET=1`` silences them).

Its own module so that low layers (the execution cache, the prompt cache) can tell the user
something without importing :mod:`cpullm.model`, which imports them.
"""
from __future__ import annotations

import os
import sys


def notice(msg: str) -> None:
    """A one-line notice to stderr (the CLI and the API share it)."""
    if os.environ.get("CPULLM_QUIET") != "1":
        print(f"cpullm: {msg}", file=sys.stderr, flush=True)
