"""python -m megalm.estimate: the megalm-estimate console script."""

import sys

from megalm.estimate import main

if __name__ == "__main__":
    sys.exit(main())
