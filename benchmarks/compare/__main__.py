"""``python -m benchmarks.compare MODEL ...`` (from the repository root): see cli.py."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
