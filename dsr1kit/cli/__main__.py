"""`python -m dsr1kit.cli ...`: the same command line as `dsr1kit ...`."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
