"""python -m megalm.estimate: the megalm-estimate console script."""

import sys

from megalm.estimate import main

sys.exit(main())
