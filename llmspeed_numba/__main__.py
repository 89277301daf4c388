"""``python -m llmspeed_numba``: the command line (``llmspeed_numba/cli.py``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
