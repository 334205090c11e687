"""runner: a declarative experiment runner for PyTorch.

A TOML spec describes model, data, devices, parallel mode, seed, optimizer and tracking; ``runner exec SPEC`` validates
it, trains and records one MLflow run.

Importing this package imports neither torch nor mlflow, so ``runner validate`` answers instantly."""

import time

__version__ = "0.1.0"
IMPORTED_AT = time.time()  # the start of a process that another program exec'd into (launch/driver.py)
