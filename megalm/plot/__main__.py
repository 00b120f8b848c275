"""python -m megalm.plot: the megalm-plot console script."""

import sys

from megalm.plot import main

if __name__ == "__main__":
    sys.exit(main())
