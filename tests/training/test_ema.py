"""train.ema_decay: the weights' moving average, validated with, exported and logged; training itself unchanged."""

from __future__ import annotations

from pathlib import Path

import mlflow.pytorch
import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.cli import main
from runner.training.checkpoint import list_checkpoints
from runner.training.ema import Ema, clean_name
from runner.training.shards import whole_model
from tests.helpers import refusal, run_in_process, series

pytestmark = pytest.mark.timeout(180)


def test_the_average_follows_torchs_ema_and_is_applied_only_inside_the_block() -> None:
    model = torch.nn.Linear(2, 1)
    ema = Ema(model, decay=0.75)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(4.0)
    ema.update()
    averaged = 0.75 * start + 0.25 * (start + 4.0)
    assert torch.allclose(ema.state()["weight"], averaged)
    with ema.applied():
        assert torch.equal(model.weight.detach(), ema.state()["weight"])
    assert torch.equal(model.weight.detach(), start + 4.0)  # the live weights are back
    assert set(ema.state()) == {"weight", "bias"}


def test_names_lose_the_infixes_of_compile_and_activation_checkpointing() -> None:
    assert clean_name("blocks.0._checkpoint_wrapped_module._orig_mod.fc.weight") == "blocks.0.fc.weight"


def test_training_is_unchanged_and_validation_uses_the_average(write_spec) -> None:
    plain = run_in_process(write_spec, "train.epochs=3")
    averaged = run_in_process(write_spec, "train.epochs=3", "train.ema_decay=0.9")
    assert series(averaged, "train/loss") == series(plain, "train/loss")
    assert series(averaged, "val/loss") != series(plain, "val/loss")


def test_export_ema_and_the_logged_model_hold_the_average(
    write_spec, tmp_path: Path, store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_in_process(write_spec, "train.epochs=2", "train.ema_decay=0.9", "tracking.log_model=true", store=True)
    newest = list_checkpoints(Path(result.checkpoint_dir))[-1]
    average, live = whole_model(newest, "ema"), whole_model(newest)
    assert average.keys() <= live.keys() and any(not torch.equal(average[k], live[k]) for k in average)

    out = tmp_path / "ema.pt"
    assert main(["export", result.run_id, "--ema", "--out", str(out), "--tracking-uri", store]) == 0
    assert "(moving average) at step 10" in capsys.readouterr().out
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == live.keys() and all(torch.equal(exported[k], average[k]) for k in average)

    run = MlflowClient(store).get_run(result.run_id)
    logged = mlflow.pytorch.load_model(f"models:/{run.outputs.model_outputs[0].model_id}")
    weights = {k.removeprefix("model."): v for k, v in logged.state_dict().items()}
    assert all(torch.equal(weights[k], average[k]) for k in average)


def test_export_ema_without_an_average_is_a_usage_error(write_spec, store: str, capsys) -> None:
    result = run_in_process(write_spec, "train.epochs=1", store=True)
    assert main(["export", result.run_id, "--ema", "--tracking-uri", store]) == 2
    assert "kept no moving average of its weights (train.ema_decay unset): drop --ema" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "says"), [("1.0", "got 1.0"), ("0", "got 0"), ('"0.9"', "expected a number (remove the quotes")]
)
def test_a_bad_decay_is_refused_at_its_line(tmp_path: Path, value: str, says: str) -> None:
    path = tmp_path / "s.toml"
    text = refusal(path, "train", f"ema_decay = {value}", train=None)
    assert f"{path}:" in text and "train.ema_decay" in text and says in text, text
