"""What a default run, sweep or bench writes in the repository is ignored by git (runs record untracked files)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]

# the MLflow store and its creation lock, its artifacts, checkpoints, the sweep's Optuna storage, bench output
WRITTEN_BY_DEFAULT = [
    "mlflow.db",
    "mlflow.db.lock",
    "mlruns/0/meta.yaml",
    "mlartifacts/1/a.txt",
    "checkpoints/abc/last.pt",
    "optuna.db",
    "optuna.db.lock",
    "bench-results/bench.json",
]


@pytest.mark.parametrize("path", WRITTEN_BY_DEFAULT)
def test_default_outputs_are_ignored(path: str) -> None:
    proc = subprocess.run(
        ["git", "check-ignore", "--no-index", "--quiet", path], cwd=REPO, capture_output=True, check=False
    )
    assert proc.returncode == 0, f"{path} is not in .gitignore: every later run would record it as untracked"
