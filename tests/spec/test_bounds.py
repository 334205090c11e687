"""Seeds and tensor sizes are bounded by what torch and NumPy take as C integers: the range is in the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.cli import main
from runner.errors import SpecError, UserCodeError
from runner.spec.loading import load_spec
from tests.helpers import MINIMAL, write_spec_file

HUGE = 99999999999999999999  # over 2**64: torch raises "Overflow when unpacking long long"


def _line_of(text: str, key: str) -> int:
    """1-based line of dotted ``key`` (list index dropped) in a file written by ``write_spec_file``."""
    *tables, leaf = key.split("[", maxsplit=1)[0].split(".")
    table = f"[{tables[0]}]" if tables else None
    inside = table is None
    for number, line in enumerate(text.splitlines(), 1):
        inside = inside or line == table
        if inside and line.startswith(f"{leaf} = "):
            return number
    raise AssertionError(f"{key} not in {text}")


@pytest.mark.parametrize(
    ("changes", "key", "expected"),
    [
        ({"seed": HUGE}, "seed", "expected a value >= 0 and < 9223372036854775808 (2**63)"),
        ({"seed": 2**63}, "seed", "< 9223372036854775808 (2**63)"),
        ({"seed": -1}, "seed", "expected a value >= 0 and < 9223372036854775808 (2**63)"),
        ({"data": {"split_seed": HUGE}}, "data.split_seed", "expected a value >= 0 and < 9223372036854775808"),
        ({"data": {"num_samples": 2**63}}, "data.num_samples", "expected a value >= 1 and < 9223372036854775808"),
        ({"data": {"input_shape": [2, HUGE]}}, "data.input_shape[1]", "expected a value < 9223372036854775808"),
        ({"data": {"input_shape": [0, 3]}}, "data.input_shape[0]", "got 0; expected a value >= 1"),
        ({"sweep": {"seed": 2**32}}, "sweep.seed", "expected a value >= 0 and < 4294967296 (2**32)"),
        # 2**63 - 1 passes as an int64 but failed after the run existed (a FAILED run, no key named; or, for
        # num_workers, a DataLoader that forked until the machine stalled)
        ({"data": {"batch_size": 2**63 - 1}}, "data.batch_size", "expected a value >= 1 and < 2147483648 (2**31)"),
        ({"data": {"eval_batch_size": 2**63 - 1}}, "data.eval_batch_size", "< 2147483648 (2**31)"),
        ({"data": {"num_workers": 2**63 - 1}}, "data.num_workers", "expected a value >= 0 and <= 256"),
        # these passed and failed later: exit 1 with no key, or exit 0 with thread tracebacks
        ({"parallel": {"timeout_s": 1e308}}, "parallel.timeout_s", "expected a value > 0.0 and <= 604800.0"),
        ({"parallel": {"hang_grace_s": 1e308}}, "parallel.hang_grace_s", "expected a value > 0.0 and <= 3600.0"),
        ({"tracking": {"flush_every_s": 1e308}}, "tracking.flush_every_s", "expected a value > 0.0 and <= 3600.0"),
    ],
)
def test_out_of_range_integers_are_located_with_their_range(
    tmp_path: Path, changes: dict, key: str, expected: str
) -> None:
    path = write_spec_file(tmp_path / "s.toml", MINIMAL, **changes)
    line = _line_of(path.read_text(), key)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}:{line}: {key}: got "), str(info.value)
    assert expected in str(info.value)


def test_largest_seeds_are_accepted(tmp_path: Path) -> None:
    path = write_spec_file(tmp_path / "s.toml", MINIMAL, seed=2**63 - 1, sweep={"seed": 2**32 - 1})
    spec = load_spec(path, ["data.split_seed=9223372036854775807"]).spec
    assert (spec.seed, spec.data.split_seed, spec.sweep and spec.sweep.seed) == (2**63 - 1, 2**63 - 1, 2**32 - 1)


@pytest.mark.parametrize("command", ["validate", "plan", "exec"])
@pytest.mark.parametrize("key", ["seed", "data.split_seed"])
def test_a_huge_seed_exits_2_before_any_run(tmp_path: Path, capsys, command: str, key: str) -> None:
    path = write_spec_file(tmp_path / "s.toml", MINIMAL, **({"seed": HUGE} if key == "seed" else {}))
    if key == "data.split_seed":
        path.write_text(path.read_text().replace("[data]\n", f"[data]\nsplit_seed = {HUGE}\n"))
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{key}: got {HUGE}; expected a value >= 0 and < 9223372036854775808 (2**63)" in err
    assert "Traceback" not in err and "Overflow" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]  # no store, no checkpoint


def test_a_huge_seed_on_the_command_line_exits_2(tmp_path: Path, capsys) -> None:
    path = write_spec_file(tmp_path / "s.toml")
    assert main(["exec", str(path), "--set", f"seed={HUGE}"]) == 2
    assert f"seed: got {HUGE}; expected a value >= 0 and < 9223372036854775808 (2**63)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]


INT64_MESSAGE = "expected a whole number from -2**63 to 2**63 - 1 (torch takes 64-bit integers)"
KWARGS_OVERFLOW = f"""name = "x"
seed = 0

[model]
name = "mlp"
kwargs = {{ num_classes = {2**63} }}

[data]
dataset = "synthetic"
batch_size = 8
kwargs = {{ n = [1, {-(2**63) - 1}] }}

[optim]
name = "sgd"
lr = 0.1
kwargs = {{ dampening = {HUGE} }}

[scheduler]
name = "step"
kwargs = {{ step_size = {2**63} }}

[loss]
name = "cross_entropy"
kwargs = {{ ignore_index = {2**64} }}

[parallel]
dim = {2**63}

[metrics]
val = [{{ name = "top_k_accuracy", k = {2**63} }}]
"""


def test_integers_inside_kwargs_and_parallel_dim_are_bounded_by_int64(tmp_path: Path, capsys) -> None:
    """They had no bound: a FAILED run, or a message with a C++ stack trace in it."""
    path = tmp_path / "s.toml"
    path.write_text(KWARGS_OVERFLOW)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    for line, key, value in [
        (6, "model.kwargs.num_classes", 2**63),
        (11, "data.kwargs.n[1]", -(2**63) - 1),
        (16, "optim.kwargs.dampening", HUGE),
        (20, "scheduler.kwargs.step_size", 2**63),
        (24, "loss.kwargs.ignore_index", 2**64),
        (27, "parallel.dim", 2**63),
        (30, "metrics.val[0].k", 2**63),
    ]:
        assert f"{path}:{line}: {key}: got {value}; {INT64_MESSAGE}" in err


def test_the_edges_of_int64_are_accepted_in_kwargs(tmp_path: Path) -> None:
    path = write_spec_file(tmp_path / "s.toml", MINIMAL, loss={"kwargs": {"ignore_index": -(2**63)}})
    assert load_spec(path).spec.loss.kwargs == {"ignore_index": -(2**63)}
    assert load_spec(path, [f"parallel.dim={2**63 - 1}"]).spec.parallel.dim == 2**63 - 1


def test_an_overflowing_num_classes_exits_2_with_its_line_and_no_stack_trace(tmp_path: Path, capsys) -> None:
    path = write_spec_file(tmp_path / "s.toml", MINIMAL, model={"kwargs": {"num_classes": 2**63}})
    assert main(["exec", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"model.kwargs.num_classes: got {2**63}; {INT64_MESSAGE}" in err
    assert "frame #" not in err and "Exception raised from" not in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]  # no store, no run


def test_a_torch_error_is_quoted_by_its_first_line_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value torch refuses past the spec's bounds: torch's text, without the C++ frames below it."""
    import torch

    from runner.training.models import build_model
    from tests.helpers import spec_object

    (tmp_path / "deep.py").write_text(
        "import torch\n\ndef build(size: int = 1):\n    return torch.nn.Linear(size, 2)\n"
    )
    trace = "Overflow when unpacking\nException raised from THPUtils_unpackLong\nframe #0: c10::Error::Error"

    def overflow(*args: object, **kwargs: object) -> None:
        raise TypeError(trace)

    monkeypatch.setattr(torch.nn, "Linear", overflow)
    with pytest.raises(UserCodeError) as info:  # the factory's own failure, located in the user's file
        build_model(spec_object(model={"name": "deep:build"}).model, tmp_path)
    message = str(info.value)
    assert "model.name: your code raised TypeError: Overflow when unpacking (at " in message
    assert "frame #" not in message and "Exception raised from" not in message


def test_a_layer_too_wide_for_any_memory_exits_2_at_model_kwargs_before_any_run(tmp_path: Path, capsys) -> None:
    path = write_spec_file(tmp_path / "s.toml", MINIMAL, model={"name": "mlp", "kwargs": {"hidden": [2**63 - 1]}})
    assert main(["exec", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.kwargs" in err and "hidden must be below 2**31" in err and "Traceback" not in err, err
    assert not (tmp_path / "mlflow.db").exists()  # no run, not even a deleted one: the store was never created


@pytest.mark.parametrize(
    "data",
    [{"num_samples": 2**63 - 1, "input_shape": [8]}, {"num_samples": 8, "input_shape": [2**62]}],
)
def test_synthetic_data_too_large_for_any_memory_is_refused_at_its_table(tmp_path: Path, data: dict) -> None:
    path = write_spec_file(tmp_path / "s.toml", MINIMAL, data={"dataset": "synthetic", **data})
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert f"{path}:" in message and "GiB of float32 samples in memory, over 64 GiB" in message, message
    assert "lower num_samples or input_shape" in message
