"""The [loss] and [metrics] tables and the new keys, as validation sees them: names, did-you-mean, FILE:LINE."""

from __future__ import annotations

import pytest

from runner.errors import SpecError
from runner.spec.loading import load_spec
from runner.spec.names import logged_name, mlflow_name_problem


def _issues(write_spec, extra: str) -> list[str]:
    with pytest.raises(SpecError) as err:
        load_spec(write_spec(extra))
    return [issue.format() for issue in err.value.issues]


def test_defaults_keep_todays_loss_and_no_metrics_table(write_spec) -> None:
    spec = load_spec(write_spec()).spec
    assert (spec.loss.name, spec.loss.kwargs, spec.metrics) == ("cross_entropy", {}, None)
    assert (spec.model.output, spec.data.target, spec.train.on_nonfinite) == (None, None, "stop")


def test_a_full_objectives_spec_validates(write_spec) -> None:
    spec = load_spec(
        write_spec(
            """
            [loss]
            name = "bce_with_logits"
            kwargs = { pos_weight = [2.0] }

            [metrics]
            train = ["accuracy"]
            val = ["accuracy", { name = "top_k_accuracy", k = 5 }, { name = "my_metrics:MacroF1", log_as = "f1/macro" }]
            """
        )
    ).spec
    assert spec.metrics is not None
    assert [logged_name(e) for e in spec.metrics.val] == ["accuracy", "top_k_accuracy", "f1/macro"]


def test_misspelled_metric_is_reported_at_its_line_with_a_suggestion(write_spec) -> None:
    path = write_spec('[metrics]\nval = [\n  "mae",\n  "acuracy",\n]\n')
    with pytest.raises(SpecError) as err:
        load_spec(path)
    (issue,) = err.value.issues
    assert issue.file == path and issue.key == "metrics.val[1]"
    assert issue.line is not None and '"acuracy"' in path.read_text().splitlines()[issue.line - 1]
    assert 'got "acuracy"' in issue.message and '(did you mean "accuracy"?)' in issue.message


def test_metric_names_mlflow_would_reject_are_validation_errors(write_spec) -> None:
    (issue,) = _issues(write_spec, '[metrics]\nval = [{ name = "mae", log_as = "mae:abs" }]\n')
    assert "metrics.val[0]" in issue and "MLflow" in issue and "log_as" in issue
    assert mlflow_name_problem("val/a//b") is not None
    assert mlflow_name_problem("val/top 5.acc-x") is None
    assert mlflow_name_problem("val/" + "x" * 250) is not None


def test_a_metric_logged_twice_or_as_runners_own_loss_is_refused(write_spec) -> None:
    (twice,) = _issues(write_spec, '[metrics]\nval = ["mae", { name = "mse", log_as = "mae" }]\n')
    assert 'metrics.val: "mae" is logged twice' in twice
    (step,) = _issues(write_spec, '[metrics]\ntrain = ["mae", { name = "mse", log_as = "step_mae" }]\n')
    assert '"step_mae" is logged twice' in step  # train/step_mae is the window value of mae
    (own,) = _issues(write_spec, '[metrics]\nval = [{ name = "mae", log_as = "loss" }]\n')
    assert "runner's own loss metric" in own


def test_unknown_loss_name_and_forbidden_kwargs(write_spec) -> None:
    (name,) = _issues(write_spec, '[loss]\nname = "crossentropy"\n')
    assert 'loss.name: got "crossentropy"' in name and '(did you mean "cross_entropy"?)' in name
    (reduction,) = _issues(write_spec, '[loss]\nname = "mse"\nkwargs = { reduction = "sum" }\n')
    assert "loss.kwargs" in reduction and "reduction" in reduction
    (model,) = _issues(write_spec, '[loss]\nname = "model"\nkwargs = { a = 1 }\n')
    assert "loss.kwargs" in model


def _set_issues(write_spec, *overrides: str) -> list[str]:
    with pytest.raises(SpecError) as err:
        load_spec(write_spec(), list(overrides))
    return [issue.format() for issue in err.value.issues]


@pytest.mark.parametrize(
    ("override", "hint"),
    [('train.loss="mse"', "[loss] name"), ("train.label_smoothing=0.1", "label_smoothing")],
)
def test_the_keys_that_moved_to_loss_say_where(write_spec, override: str, hint: str) -> None:
    issues = _set_issues(write_spec, override)
    assert any("unknown key" in i and hint in i and "moved" in i for i in issues)


def test_new_keys_are_typed(write_spec) -> None:
    (nonfinite,) = _set_issues(write_spec, 'train.on_nonfinite="halt"')
    assert "train.on_nonfinite" in nonfinite and '"stop"' in nonfinite
    (target,) = _set_issues(write_spec, 'data.target=""')
    assert "data.target" in target
    spec = load_spec(write_spec(), ["model.output=0"]).spec
    assert spec.model.output == 0


# --------------------------------------------------------------------------- through runner exec: exit 2, FILE:LINE, no run


def _no_run(store: str) -> bool:
    """No MLflow run in the sqlite store (read with sqlite3: opening it with MLflow would create it)."""
    import sqlite3
    from pathlib import Path

    path = Path(store[len("sqlite:///") :])
    if not path.exists():
        return True
    with sqlite3.connect(path) as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return "runs" not in tables or db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


@pytest.mark.integration  # starts several processes: the driver's training child
@pytest.mark.parametrize(
    ("extra", "key", "fragment", "on_line"),
    [
        ('[metrics]\nval = ["r2", "acuracy"]\n', "metrics.val[1]", 'did you mean "accuracy"?', "acuracy"),
        ('[metrics]\nval = [{ name = "mae", log_as = "m:a:e" }]\n', "metrics.val[0]", "MLflow metric names", "m:a:e"),
        ('[loss]\nname = "no_such_module:loss"\n', "loss.name", "cannot import module 'no_such_module'", "name ="),
        (
            '[metrics]\ntrain = [\n  "mae",\n  "no_such_module:Metric",\n]\n',
            "metrics.train[1]",
            "cannot import",
            ":Metric",
        ),
    ],
    ids=["misspelled-metric", "mlflow-name", "loss-not-importable", "metric-not-importable"],
)
def test_exec_refuses_bad_names_with_file_line_and_leaves_no_run(
    write_spec, store: str, capsys, extra: str, key: str, fragment: str, on_line: str
) -> None:
    from runner.cli import main

    path = write_spec(extra)
    assert main(["exec", str(path)]) == 2
    err = capsys.readouterr().err
    located = [line for line in err.splitlines() if f": {key}: " in line]
    assert located and fragment in located[0] and "Traceback" not in err, err
    line = int(located[0].split(f"{path}:", 1)[1].split(":", 1)[0])
    assert on_line in path.read_text().splitlines()[line - 1]
    assert _no_run(store)
