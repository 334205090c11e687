"""runner: a declarative experiment runner for PyTorch. A TOML spec in, one MLflow run out: ``runner exec SPEC``
validates it, trains and records the run. Importing this package imports neither torch nor mlflow."""

import time

__version__ = "0.1.0"
IMPORTED_AT = time.time()  # the start of a process that another program exec'd into (launch/driver.py)
