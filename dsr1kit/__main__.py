"""`python -m dsr1kit ...`: the same command line as `dsr1kit ...`."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
