"""``python -m runner``: the same as the ``runner`` console script (also under ``torchrun -m runner``)."""

import sys

from runner.cli import main

sys.exit(main())
