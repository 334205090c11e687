"""``python -m runner``: the same as the ``runner`` console script (also under ``torchrun -m runner``)."""

from runner.cli import console

console()
