"""``runner parity`` without several processes: bad input, tolerances, the verdict's wording, the known causes."""

from __future__ import annotations

import pytest

from runner.cli import main
from runner.spec.loading import load_spec
from runner.tools.parity import (
    PERTURBATION,
    ModeResult,
    ParityReport,
    _compare,
    likely_causes,
    tolerance,
)

pytestmark = pytest.mark.created_store


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--modes", "none,ddq"], "--modes: expected a comma-separated subset of none,dp,ddp,fsdp, got none,ddq"),
        (["--modes", ","], "--modes: expected a comma-separated subset"),
        (["--steps", "0"], "--steps: expected at least 1 optimizer step, got 0"),
        (["--modes", "dp"], "--modes: dp-2 cannot run on this machine: dp needs 2 GPUs; this machine has "),
    ],
)
def test_bad_input_exits_2_naming_what_is_missing(write_spec, store: str, capsys, args, expected) -> None:
    from mlflow.tracking import MlflowClient

    from runner.devices.inventory import probe_inventory

    if "dp" in args and len(probe_inventory().gpus) >= 2:
        pytest.skip("this machine runs dp")
    status = main(["parity", str(write_spec()), *args])
    assert status == 2
    assert expected in capsys.readouterr().err
    assert MlflowClient(store).search_experiments(filter_string="name LIKE '%parity%'") == []  # no run left


def _result(config: str, losses: dict[int, float], params: dict[str, float]) -> ModeResult:
    import torch

    mode = config.split("-", maxsplit=1)[0] if config != "control" else "none"
    out = ModeResult(config, mode, 2 if "-" in config else 1, losses=losses)
    out.params = {k: torch.tensor([v], dtype=torch.float64) for k, v in params.items()}
    return out


def _report(ddp_losses: dict[int, float], ddp_w: float, control_losses: dict[int, float]) -> ParityReport:
    none = _result("none", {1: 2.0, 2: 1.5, 3: 1.0}, {"w": 0.5})
    report = ParityReport("spec.toml", "t", "float64", 3, [none, _result("ddp-2", ddp_losses, {"w": ddp_w})], none)
    report.control = _result("control", control_losses, {"w": 0.5 + 1e-8})
    _compare(report)
    return report


def test_modes_agree_within_the_control_growth_and_say_the_sensitivity() -> None:
    report = _report({1: 2.0, 2: 1.5 + 1e-15, 3: 1.0 + 2e-15}, 0.5 + 1e-16, {1: 2.0, 2: 1.5 + 1e-7, 3: 1.0 + 1e-3})
    assert report.verdict() == "agree" and report.failed == 0
    text = report.table()
    assert "the modes agree (float64, 3 steps, deterministic)" in text
    assert "max |Δ train/loss| 2.0e-15" in text
    assert f"a {PERTURBATION:.1e} perturbation grows to 1.0e-03 in train/loss in 3 steps" in text
    assert "float32 runs of this spec will differ by about that much across modes" in text


def test_a_difference_beyond_rounding_names_the_step_and_size() -> None:
    report = _report({1: 2.0, 2: 1.6, 3: 1.1}, 0.5, {1: 2.0, 2: 1.5 + 1e-12, 3: 1.0 + 1e-11})
    assert report.verdict() == "differ" and report.failed == 1
    assert report.modes[1].first_beyond == 2
    assert "the modes differ beyond rounding" in report.table()
    assert "differs from step 2 by 1.0e-01" in report.table()


def test_final_parameters_alone_can_differ() -> None:
    report = _report({1: 2.0, 2: 1.5, 3: 1.0}, 0.6, {1: 2.0, 2: 1.5, 3: 1.0})
    assert report.modes[1].first_beyond is None
    assert report.verdict() == "differ" and "final parameters differ" in report.table()


def test_a_non_finite_loss_differs() -> None:
    report = _report({1: 2.0, 2: float("nan"), 3: 1.0}, 0.5, {1: 2.0, 2: 1.5, 3: 1.0})
    assert report.modes[1].first_beyond == 2


@pytest.mark.parametrize(
    ("precision", "growth", "scale", "expected"),
    [
        ("float64", 1e-3, 1.0, 1e-3 * 2.0**-29 * 1e3),  # the control's growth at float64's epsilon, with margin
        ("float64", 1e-12, 1.0, 1e-10),  # the floor: summation order alone
        ("float64", 0.5, 1.0, 0.5),  # a saturated control: nothing below its own growth can be told apart
        ("float32", 1e-3, 2.0, 1e-2),
    ],
)
def test_tolerance(precision: str, growth: float, scale: float, expected: float) -> None:
    assert tolerance(precision, growth, scale) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"model": {"name": "cnn", "kwargs": {"batch_norm": True, "width": 4}}}, "BatchNorm2d without parallel.sync"),
        ({"model": {"name": "mlp", "kwargs": {"hidden": [8], "dropout": 0.5}}}, "Dropout: under ddp each rank"),
    ],
)
def test_likely_causes_name_the_layer(tmp_path, changes, named) -> None:
    from tests.helpers import write_spec_file

    data = {"dataset": "synthetic", "num_samples": 32, "input_shape": [1, 8, 8], "num_classes": 3, "batch_size": 8}
    spec = write_spec_file(tmp_path / "s.toml", data=data, **changes)
    causes = likely_causes(load_spec(spec), ["ddp"])
    assert any(named in c for c in causes), causes


def test_likely_causes_without_a_known_one_say_what_to_look_for(tmp_path) -> None:
    from tests.helpers import write_spec_file

    causes = likely_causes(load_spec(write_spec_file(tmp_path / "s.toml")), ["ddp"])
    assert causes == [
        "none of the known ones (BatchNorm, dropout, a per-rank mean loss): look for layers or a loss that use "
        "the batch split, the rank or random numbers"
    ]


def test_likely_causes_name_batchnorm_of_a_model_that_cannot_be_built_on_meta(tmp_path) -> None:
    """It said "none of the known ones": the meta build failed and nothing else was tried."""
    from tests.helpers import write_spec_file

    (tmp_path / "norm_models.py").write_text(
        "import torch\n\n\ndef build(**kwargs):\n"
        "    model = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(64, 8), torch.nn.BatchNorm1d(8),"
        " torch.nn.Linear(8, 3))\n"
        "    assert float(model[1].weight.abs().sum()) > 0  # reads its weights: impossible on meta\n"
        "    return model\n"
    )
    data = {"dataset": "synthetic", "num_samples": 32, "input_shape": [1, 8, 8], "num_classes": 3, "batch_size": 8}
    spec = write_spec_file(tmp_path / "s.toml", data=data, model={"name": "norm_models:build", "kwargs": {}})
    causes = likely_causes(load_spec(spec), ["ddp"])
    assert any(c.startswith("BatchNorm1d without parallel.sync_batchnorm") for c in causes), causes
