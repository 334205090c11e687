"""Checkpoint folders: atomic write, rotation, damaged-file fall-back, spec diff."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from runner.tracking.uri import checkpoint_root
from runner.training import checkpoint as ckpt
from runner.training import shards
from runner.training.loop import TrainState
from tests.helpers import fill, small_disk


def _payload(step: int) -> dict:
    return ckpt.build_payload(
        scheduler=None,
        scaler=None,
        state=TrainState(epoch=1, global_step=step, batch_in_epoch=0),
        rng_states=[{"torch": torch.get_rng_state()}],
        spec_flat={"optim.lr": 0.1},
        spec_sha256="abc",
        run_id="r1",
    )


def _save(folder: Path, step: int, value: float = 1.0, keep_last: int = 5, payload: dict | None = None) -> Path:
    """Save a Linear(2, 2) whose weight is ``value`` (and a 64-value buffer ``table`` of ``value``) at ``step``."""
    model = torch.nn.Linear(2, 2)
    model.register_buffer("table", torch.full((64,), value))
    with torch.no_grad():
        model.weight.fill_(value)
    model_state, optimizer_state = get_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = {"model": model_state, "optimizer": optimizer_state}
    ckpt.save_checkpoint(folder, state, payload or _payload(step), step, keep_last, barrier=lambda: None)
    return folder / f"step-{step:08d}"


def _save_unchecked(payload: dict, path: Path) -> None:
    """Save what runner would refuse to write, with a matching digest (as a hostile or older writer would): a file
    ``path``, or ``path/meta.pt`` when ``path`` is a folder."""
    target = path / ckpt.META if path.is_dir() else path
    torch.save(payload, target)
    name = target.relative_to(path.parent).as_posix()
    ckpt.write_digest(path, {name: hashlib.sha256(target.read_bytes()).hexdigest()})


def _halve(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_save_then_load_latest_round_trips(tmp_path: Path) -> None:
    _save(tmp_path, 3, 3.0)
    _save(tmp_path, 7, 7.0)
    found = ckpt.load_latest(tmp_path)
    assert found is not None
    assert found.path.name == "step-00000007"
    assert found.payload["state"]["global_step"] == 7
    assert torch.all(shards.whole_model(found.path)["weight"] == 7.0)
    assert found.skipped == ()


def test_keep_last_rotates_oldest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith((".tmp-", ".step-"))]


def test_truncated_latest_falls_back_to_previous(tmp_path: Path) -> None:
    _save(tmp_path, 1, 1.0)
    latest = _save(tmp_path, 2, 2.0)
    _halve(latest / ckpt.META)
    found = ckpt.load_latest(tmp_path)
    assert found is not None and found.path.name == "step-00000001"
    assert len(found.skipped) == 1
    assert str(latest) in found.skipped[0][1] and "SHA-256 of step-00000002/meta.pt differs" in found.skipped[0][1]


def test_all_damaged_is_an_error_naming_files(tmp_path: Path) -> None:
    path = _save(tmp_path, 1, keep_last=1)
    (path / ckpt.META).write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="step-00000001"):
        ckpt.load_latest(tmp_path)


def test_empty_folder_has_no_checkpoint(tmp_path: Path) -> None:
    assert ckpt.load_latest(tmp_path / "missing") is None


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 1, 1.0)

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(ckpt.CheckpointError, match=r"step-00000002 was not saved in .* \(OSError: disk full\)"):
        _save(tmp_path, 2, 2.0)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if "step-00000002" not in p.name) == [
        "step-00000001",
        "step-00000001.sha256",
    ]
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".tmp-")]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000001"]  # the half-made one is not used
    assert ckpt.load_latest(tmp_path).payload["state"]["global_step"] == 1


def test_default_dir_sits_next_to_sqlite_store(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    assert checkpoint_root(uri, None) == (tmp_path / "store" / "checkpoints").resolve()
    assert checkpoint_root(uri, str(tmp_path / "ck")) == tmp_path / "ck"
    assert checkpoint_root(None, None) == (Path.cwd() / "checkpoints").resolve()  # tracking off: here


class _RunsCode:
    """A pickled object whose loading would run a shell command (what a hostile checkpoint carries)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoints_are_read_with_weights_only(tmp_path: Path) -> None:
    path = _save(tmp_path, 3, keep_last=1)
    raw = torch.load(path / ckpt.META, weights_only=True)  # what runner does: tensors and plain values only
    assert raw["format"] == ckpt.FORMAT_VERSION and raw["tracking"] == {"metrics_recorded": 0}


def test_a_checkpoint_carrying_a_pickled_payload_is_refused_not_executed(tmp_path: Path) -> None:
    _save(tmp_path, 1, 1.0)
    marker = tmp_path / "executed"
    hostile = _payload(2)
    hostile["spec"] = {"optim.lr": _RunsCode(marker)}
    (tmp_path / "step-00000002").mkdir()
    _save_unchecked(hostile, tmp_path / "step-00000002")
    with pytest.raises(ckpt.CheckpointError, match=r"refused: it carries pickled objects \(posix.system\)"):
        ckpt.read_checkpoint(tmp_path / "step-00000002")
    found = ckpt.load_latest(tmp_path)
    assert found is not None and found.path.name == "step-00000001"
    assert "refused" in found.skipped[0][1]
    assert ckpt.peek(tmp_path / "step-00000002")["spec"] == {"optim.lr": None}  # read, not run
    assert not marker.exists()


def test_a_peek_reads_the_plain_fields_without_torch_and_skips_a_damaged_checkpoint(tmp_path: Path) -> None:
    """The driver checks a resume with ``peek``: it never holds the weights, nor imports torch."""
    _save(tmp_path, 1, 1.0)
    latest = _save(tmp_path, 2, 2.0)
    full, seen = ckpt.read_checkpoint(latest), ckpt.peek(latest)
    for key in ("format", "spec", "spec_sha256", "state", "run_id", "tracking"):
        assert seen[key] == full[key], key
    code = (
        "import sys; from pathlib import Path; from runner.training.checkpoint import peek; "
        f"assert peek(Path({str(latest)!r}))['state']['global_step'] == 2; assert 'torch' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2]).returncode == 0
    _halve(latest / ckpt.META)
    found = ckpt.load_latest(tmp_path, ckpt.peek)
    assert found is not None and found.path.name == "step-00000001" and str(latest) in found.skipped[0][1]


def test_an_old_format_checkpoint_is_refused_with_the_reason(tmp_path: Path) -> None:
    """A file of format 2 (an earlier runner's none, dp and ddp checkpoints) is named, not loaded."""
    old = _payload(4)
    old["format"] = 2
    _save_unchecked(old, tmp_path / "step-00000004.pt")
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint") as info:
        ckpt.load_latest(tmp_path)
    assert "written in checkpoint format 2" in str(info.value) and f"reads format {ckpt.FORMAT_VERSION}" in str(
        info.value
    )


def test_a_file_of_the_format_without_the_loop_state_is_not_a_runner_checkpoint(tmp_path: Path) -> None:
    _save_unchecked({"format": ckpt.FORMAT_VERSION, "weights": {}}, tmp_path / "step-00000003.pt")
    with pytest.raises(ckpt.CheckpointError, match="not a runner checkpoint"):
        ckpt.read_checkpoint(tmp_path / "step-00000003.pt")


def test_a_payload_that_weights_only_would_refuse_is_not_saved(tmp_path: Path) -> None:
    payload = _payload(5)
    payload["scheduler"] = {"lr_lambdas": [lambda epoch: 1.0]}
    with pytest.raises(
        ckpt.CheckpointError, match=r"checkpoint\['scheduler'\]\['lr_lambdas'\]\[0\] is a builtins.function"
    ):
        _save(tmp_path, 5, payload=payload)
    assert ckpt.list_checkpoints(tmp_path) == []


def _zero(data: bytearray, at: int) -> None:
    data[at : at + 64] = bytes(64)


def _flip(data: bytearray, at: int) -> None:
    data[at : at + 64] = b"\x7f" * 64


@pytest.mark.parametrize("damage", [_zero, _flip], ids=["zeroed", "0x7f"])
def test_bytes_changed_inside_a_tensor_are_found_and_the_previous_checkpoint_used(tmp_path: Path, damage) -> None:
    _save(tmp_path, 1, 1.0)
    latest = _save(tmp_path, 2, 2.0)
    shard = latest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    at = data.find(torch.full((32,), 2.0).numpy().tobytes())  # inside the table's storage
    assert at >= 0
    damage(data, at)
    shard.write_bytes(bytes(data))
    found = ckpt.load_latest(tmp_path)
    assert found is not None and found.path.name == "step-00000001"
    assert torch.all(shards.whole_model(found.path)["weight"] == 1.0)
    ((path, reason),) = found.skipped
    assert path == latest and "SHA-256 of step-00000002/__0_0.distcp" in reason


def test_a_checkpoint_without_its_digest_is_not_used(tmp_path: Path) -> None:
    _save(tmp_path, 1, 1.0)
    latest = _save(tmp_path, 2, 2.0)
    ckpt.digest_path(latest).unlink()
    found = ckpt.load_latest(tmp_path)
    assert found is not None and found.path.name == "step-00000001"
    assert "no readable digest file step-00000002.sha256" in found.skipped[0][1]


def test_every_checkpoint_damaged_is_an_error_saying_none_is_used(tmp_path: Path) -> None:
    for step in (1, 2):
        meta = _save(tmp_path, step) / ckpt.META
        data = bytearray(meta.read_bytes())
        _zero(data, len(data) // 2)
        meta.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="every one is damaged, so none is used") as info:
        ckpt.load_latest(tmp_path)
    assert info.value.exit_code == 1
    assert "step-00000001" in str(info.value) and "step-00000002" in str(info.value)


def test_rotation_removes_digest_files_with_their_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000003.sha256"]


def test_a_folder_checkpoint_is_verified_file_by_file(tmp_path: Path) -> None:
    """The digest covers a checkpoint that is a folder of shards (one line per shard file)."""
    folder = tmp_path / "step-00000004"
    folder.mkdir()
    digests = {}
    for rank in (0, 1):
        shard = folder / f"__{rank}_0.distcp"
        shard.write_bytes(bytes([rank]) * 100)
        digests[shard.relative_to(tmp_path).as_posix()] = hashlib.sha256(shard.read_bytes()).hexdigest()
    ckpt.write_digest(folder, digests)
    ckpt.verify_digest(folder)
    (folder / "__1_0.distcp").write_bytes(bytes(50))
    with pytest.raises(ckpt.CheckpointError, match=r"SHA-256 of step-00000004/__1_0.distcp differs"):
        ckpt.verify_digest(folder)
    (folder / "__1_0.distcp").unlink()
    with pytest.raises(ckpt.CheckpointError, match="files differ from the ones recorded"):
        ckpt.verify_digest(folder)


def _shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _redigest(folder: Path) -> None:
    """Rewrite ``folder``'s digest file to match its files, as whoever can write the folder can."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    ckpt.write_digest(folder, {p.relative_to(folder.parent).as_posix(): ckpt._sha256(p) for p in files})


def _dotted_global_pickle(command: str) -> bytes:
    """A protocol-4 pickle that calls ``torch.distributed.checkpoint.filesystem`` + ``os.system`` (a dotted name
    under a module DCP owns) with ``command``."""

    def text(value: str) -> bytes:
        data = value.encode()
        return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE

    global_ = text("torch.distributed.checkpoint.filesystem") + text("os.system") + b"\x93"  # STACK_GLOBAL
    return b"\x80\x04" + global_ + text(command) + b"\x85R."  # TUPLE1, REDUCE, STOP


def test_a_crafted_dcp_metadata_is_refused_by_name_and_the_previous_checkpoint_used(tmp_path: Path) -> None:
    _save(tmp_path, 1, 1.0)
    newest = _save(tmp_path, 2, 2.0)
    marker = tmp_path / "executed"
    (newest / ".metadata").write_bytes(_dotted_global_pickle(f"touch {marker}"))
    _redigest(newest)
    with pytest.raises(ckpt.CheckpointError, match=r"refused: its \.metadata names "):
        shards.whole_model(newest)
    state = {"model": torch.nn.Linear(2, 2).state_dict()}
    with pytest.raises(
        ckpt.CheckpointError, match=r"names torch\.distributed\.checkpoint\.filesystem\.os\.system, which"
    ):
        shards.load_checkpoint(newest, state)
    found = ckpt.load_latest(tmp_path, shards.read_with_model)  # what `runner export` reads
    assert found is not None and found.path.name == "step-00000001"
    assert torch.all(found.payload["model"]["weight"] == 1.0) and "refused" in found.skipped[0][1]
    assert not marker.exists()


def test_a_crafted_non_tensor_item_in_a_shard_is_refused_not_executed(tmp_path: Path) -> None:
    _save(tmp_path, 1, 1.0)
    marker = tmp_path / "executed"
    model = torch.nn.Linear(2, 2)
    model.register_buffer("table", torch.full((64,), 2.0))
    model_state, optimizer_state = get_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer_state["param_groups"][0]["lr"] = _RunsCode(marker)  # stored as a DCP byte item
    state_dicts = {"model": model_state, "optimizer": optimizer_state}
    ckpt.save_checkpoint(tmp_path, state_dicts, _payload(2), 2, 5, barrier=lambda: None)
    assert not marker.exists()
    model = torch.nn.Linear(2, 2)
    model.register_buffer("table", torch.zeros(64))
    state = _shards(model, torch.optim.SGD(model.parameters(), lr=0.5))
    with pytest.raises(ckpt.CheckpointError, match=r"refused: its item optimizer\.param_groups\.0\.lr carries"):
        shards.load_checkpoint(tmp_path / "step-00000002", state)
    assert not marker.exists()

    def read(path: Path) -> dict:  # what a resume does on every rank
        payload = ckpt.read_checkpoint(path)
        shards.load_checkpoint(path, state)
        return payload

    found = ckpt.load_latest(tmp_path, read)
    assert found is not None and found.path.name == "step-00000001" and "refused" in found.skipped[0][1]
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.1 and not marker.exists()


def test_plain_non_tensor_items_still_load(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    ckpt.save_checkpoint(
        tmp_path,
        _shards(model, optimizer),
        _payload(1),
        1,
        5,
        barrier=lambda: None,
    )
    fresh = torch.nn.Linear(2, 2)
    state = _shards(fresh, torch.optim.Adam(fresh.parameters()))
    shards.load_checkpoint(tmp_path / "step-00000001", state)
    group = state["optimizer"]["param_groups"][0]
    assert group["lr"] == 0.01 and tuple(group["betas"]) == (0.8, 0.9) and group["amsgrad"] is False


def test_a_checkpoint_rotated_away_while_it_is_read_is_passed_over(tmp_path: Path) -> None:
    _save(tmp_path, 1, 1.0)
    _save(tmp_path, 2, 2.0)

    def read_while_rotating(path: Path) -> dict:  # a running job saves step 3 and rotates step 2 away meanwhile
        if path.name == "step-00000002":
            _save(tmp_path, 3, 3.0, keep_last=1)
        return shards.read_with_model(path)

    found = ckpt.load_latest(tmp_path, read_while_rotating)
    assert found is not None and found.path.name == "step-00000003" and found.skipped == ()
    assert torch.all(found.payload["model"]["weight"] == 3.0)


def test_nothing_in_runner_loads_a_file_with_weights_only_false() -> None:
    # The logged model crossed from rank 0 to the driver as a pickled module read with weights_only=False, from the
    # checkpoint folder; it crosses as a state dict now, and the driver builds the module from the spec.
    package = Path(ckpt.__file__).parents[1]
    found = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "weights_only=False" in line.replace(" ", "")
    ]
    assert found == []


@pytest.mark.parametrize("background", [False, True])
def test_a_full_disk_during_a_save_names_enospc_and_leaves_no_partial_folder(tmp_path: Path, background: bool) -> None:
    with small_disk(tmp_path / "disk", 512) as disk:
        first = _save(disk, 1, 1.0)
        fill(disk, leave_kib=4)  # a shard, its metadata and meta.pt need more
        model = torch.nn.Linear(2, 2)
        model.register_buffer("table", torch.zeros(64 * 1024))  # 256 KiB of shard
        state_dicts = _shards(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(ckpt.CheckpointError) as caught:
            pending = ckpt.save_checkpoint(disk, state_dicts, _payload(2), 2, 5, lambda: None, background=background)
            if pending is not None:
                pending.finish()
        message = str(caught.value)
        assert message.startswith(f"checkpoint step-00000002 was not saved in {disk} (")
        assert "the disk is full (ENOSPC)" in message and "checkpoint.dir" in message and "\n" not in message
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "step-00000001", "step-00000001.sha256"]
        (disk / "filler").unlink()  # room again: the next save goes through, the first checkpoint untouched
        _save(disk, 3, 3.0)
        found = ckpt.load_latest(disk, shards.read_with_model)
        assert found is not None and found.path.name == "step-00000003" and first.exists()


def test_a_save_removes_what_an_earlier_failed_save_left(tmp_path: Path) -> None:
    (tmp_path / ".step-00000007.partial").mkdir(parents=True)
    (tmp_path / ".step-00000007.partial" / "__0_0.distcp").write_bytes(b"x" * 100)
    _save(tmp_path, 9, 9.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000009", "step-00000009.sha256"]
