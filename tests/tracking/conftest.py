"""Fixtures of the tracking tests: a created sqlite store of the test's own, and an MLflow client on it."""

from __future__ import annotations

import pytest


@pytest.fixture
def uri(ready_store: str) -> str:
    """A sqlite store of this test alone, created already (a copy of the session's)."""
    return ready_store


@pytest.fixture
def client(uri: str):
    """An ``MlflowClient`` on ``uri``."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)
