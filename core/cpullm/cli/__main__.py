"""``python -m cpullm.cli``: the ``cpullm`` command without its console script."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
