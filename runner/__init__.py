"""runner: a declarative experiment runner for PyTorch.

A TOML spec describes model, data, devices, parallel mode, seed, optimizer and tracking; ``runner exec SPEC`` validates
it, trains and records one MLflow run.

Importing this package imports neither torch nor mlflow, so ``runner validate`` answers instantly.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
