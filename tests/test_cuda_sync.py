"""CUDA: the training loop's hot path never synchronises the host with the device between log steps.

``torch.cuda.set_sync_debug_mode("error")`` makes every synchronising CUDA call (``.item()``,
``cudaStreamSynchronize``, a blocking copy to the host, ``nonzero``) raise. It is on from the start
of each epoch's steps and off only while the loop logs (``train/loss`` every ``log_every_n_steps``),
ends an epoch (its evaluation and epoch metrics) or checkpoints: the places where the loop reads
numbers back on purpose (docs/design.md §2). Skipped without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from runner.launch.driver import exec_experiment
from runner.launch.session import ExecOptions
from runner.spec.loading import load_spec
from runner.training import WorkerResult, loop, setup
from tests.helpers import spec_text

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU visible"),
]


def _spec(log_every: int, store: Path) -> str:
    """A two-epoch CUDA run of the 784-512-512-10 MLP, logging every ``log_every`` steps, no checkpoints."""
    return spec_text(
        name="sync-free",
        model={"kwargs": {"hidden": [512, 512]}},
        data={"num_samples": 4096, "input_shape": [784], "num_classes": 10, "batch_size": 256, "val_fraction": 0.1},
        devices={"accelerator": "cuda", "ids": [0]},
        optim={"lr": 0.01, "momentum": 0.9},
        train={"log_every_n_steps": log_every},
        checkpoint={"enabled": False},
        tracking={"uri": f"sqlite:///{store}", "experiment": "sync-free"},
    )


def _allowed(fn: Callable[..., Any], seen: list[str]) -> Callable[..., Any]:
    """``fn`` run with the sync check off (a sanctioned read-back), then on again."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        seen.append(fn.__name__)
        torch.cuda.set_sync_debug_mode(0)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    return wrapped


def _checked_from(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (the start of an epoch's steps), after which every CUDA sync raises."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        return result

    return wrapped


@pytest.mark.parametrize("log_every", [4])
def test_no_device_sync_between_log_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_every: int) -> None:
    # The check itself works: a read-back under "error" raises.
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.ones(1, device="cuda").item()
    finally:
        torch.cuda.set_sync_debug_mode(0)

    seen: list[str] = []
    for name in ("_log_window", "end_epoch", "_checkpoint"):
        monkeypatch.setattr(loop, name, _allowed(getattr(loop, name), seen))
    monkeypatch.setattr(loop, "_start_epoch", _checked_from(loop._start_epoch))
    fit = loop.fit

    def fit_then_off(*args: Any, **kwargs: Any) -> WorkerResult:
        try:
            return fit(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(setup, "fit", fit_then_off)
    path = tmp_path / "sync.toml"
    path.write_text(_spec(log_every, tmp_path / "mlflow.db"), encoding="utf-8")
    try:
        result = exec_experiment(load_spec(path), ExecOptions(in_process=True))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    steps = result.history[-1][0]
    assert result.status == "FINISHED"
    assert steps > 4 * log_every  # two epochs of about 15 steps each ran under the check
    assert seen.count("_log_window") == steps // log_every
    assert seen.count("end_epoch") == 2
