"""`python -m popbert ...`: the same as the `popbert` console script."""

import sys

from popbert.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
