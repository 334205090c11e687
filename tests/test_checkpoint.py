"""Checkpoint files: atomic write, rotation, damaged-file fall-back, spec diff."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from runner.training import checkpoint as ckpt
from runner.training.loop import TrainState


def _payload(step: int, value: float = 1.0) -> dict:
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ckpt.build_payload(
        model_state=model.state_dict(),
        optimizer=opt,
        scheduler=None,
        scaler=None,
        state=TrainState(epoch=1, global_step=step, batch_in_epoch=0),
        rng_states=[{"torch": torch.get_rng_state()}],
        spec_flat={"optim.lr": 0.1},
        spec_sha256="abc",
        run_id="r1",
    )


def test_save_then_load_latest_round_trips(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path, _payload(3, 3.0), keep_last=5)
    ckpt.save_checkpoint(tmp_path, _payload(7, 7.0), keep_last=5)
    found = ckpt.load_latest(tmp_path)
    assert found is not None
    assert found.path.name == "step-00000007.pt"
    assert found.payload["state"]["global_step"] == 7
    assert torch.all(found.payload["model"]["weight"] == 7.0)
    assert found.skipped == ()


def test_keep_last_rotates_oldest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, _payload(step), keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000003.pt", "step-00000004.pt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_truncated_latest_falls_back_to_previous(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path, _payload(1, 1.0), keep_last=3)
    latest = ckpt.save_checkpoint(tmp_path, _payload(2, 2.0), keep_last=3)
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])
    found = ckpt.load_latest(tmp_path)
    assert found is not None and found.path.name == "step-00000001.pt"
    assert len(found.skipped) == 1
    assert str(latest) in found.skipped[0][1] and "truncated" in found.skipped[0][1]


def test_all_damaged_is_an_error_naming_files(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(tmp_path, _payload(1), keep_last=1)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="step-00000001.pt"):
        ckpt.load_latest(tmp_path)


def test_empty_folder_has_no_checkpoint(tmp_path: Path) -> None:
    assert ckpt.load_latest(tmp_path / "missing") is None


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt.save_checkpoint(tmp_path, _payload(1, 1.0), keep_last=3)

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, _payload(2, 2.0), keep_last=3)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001.pt"]
    assert ckpt.load_latest(tmp_path).payload["state"]["global_step"] == 1


def test_spec_changes_lists_changed_keys_and_ignores_tracking() -> None:
    saved = {"optim.lr": 0.1, "seed": 0, "tracking.experiment": "a", "train.epochs": 3}
    now = {"optim.lr": 0.05, "seed": 0, "tracking.experiment": "b", "train.epochs": 3, "data.shuffle": False}
    assert ckpt.spec_changes(saved, now) == ["data.shuffle", "optim.lr"]


def test_default_dir_sits_next_to_sqlite_store(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    assert ckpt.default_checkpoint_dir(uri, None, "abc") == (tmp_path / "store" / "checkpoints" / "abc").resolve()
    assert ckpt.default_checkpoint_dir(uri, str(tmp_path / "ck"), "abc") == tmp_path / "ck" / "abc"
