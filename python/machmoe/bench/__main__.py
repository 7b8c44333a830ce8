"""`python -m machmoe.bench`: see machmoe/bench/run.py and `--help`."""

import sys

from .run import main

if __name__ == "__main__":
    sys.exit(main())
