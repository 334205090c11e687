"""Sweep definitions, the Optuna search space, trial validation, the storage and the report, without training anything."""

from __future__ import annotations

import json
import math
import tomllib
from types import SimpleNamespace

import numpy as np
import pytest

from runner.cli import main
from runner.errors import SpecError, UsageError, mask_secrets, toml_value
from runner.spec.dump import spec_sha256
from runner.spec.loading import load_spec
from runner.spec.schema import SweepParam, SweepSpec
from runner.tools.sweep import run_sweep
from runner.tools.sweep_jobs import device_pool
from runner.tools.sweep_space import (
    SweepDefinition,
    SweepReport,
    Trial,
    TrialResult,
    decode_choice,
    encode_choices,
    study_name,
)
from runner.tools.sweep_study import default_storage_url, make_sampler
from runner.tools.sweep_trials import (
    CommandLine,
    parse_grid,
    parse_random,
    prepare_trials,
    trial_environ,
    trial_tags,
    trials_to_check,
    without_sweep,
)
from runner.tools.sweep_trials import build_definition as _build


def build_definition(sweep=None, *, spec_file=None, key_lines=None, **flags) -> SweepDefinition:
    """The definition from a ``[sweep]`` table and command-line flags given as keywords."""
    return _build(sweep, CommandLine(**flags), spec_file=spec_file, key_lines=key_lines)


def expand(definition: SweepDefinition) -> list[Trial]:
    """The grid's trials, numbered as the study numbers them."""
    return [Trial(i, point) for i, point in enumerate(definition.grid_points())]


SWEEP_TABLE = """
[sweep]
method = "grid"
metric = "val/loss"
goal = "min"

[sweep.params."optim.lr"]
values = [0.1, 0.01]

[sweep.params.seed]
values = [0, 1]
"""


# --------------------------------------------------------------------------- command-line entries


@pytest.mark.parametrize(
    ("entry", "key", "values"),
    [
        ("optim.lr=0.1,0.01", "optim.lr", [0.1, 0.01]),
        ("seed=0,1,2", "seed", [0, 1, 2]),
        ("optim.name=adam,sgd", "optim.name", ["adam", "sgd"]),
        ('optim.name="adam","sgd"', "optim.name", ["adam", "sgd"]),
        ("model.kwargs.hidden=[16],[32, 32]", "model.kwargs.hidden", [[16], [32, 32]]),
        ("train.amp = no , bf16", "train.amp", ["no", "bf16"]),
        ("data.shuffle=true,false", "data.shuffle", [True, False]),
    ],
)
def test_grid_entries_are_toml_values(entry: str, key: str, values: list) -> None:
    got_key, param = parse_grid(entry)
    assert got_key == key and param.values == values
    assert [type(v) for v in param.values] == [type(v) for v in values]


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("optim.lr=1e-4:1e-1:log", SweepParam(low=1e-4, high=0.1, distribution="log_uniform")),
        ("optim.momentum=0:0.9", SweepParam(low=0.0, high=0.9)),
        ("seed=0:100:int", SweepParam(low=0, high=100, distribution="int_uniform")),
    ],
)
def test_random_entries(entry: str, expected: SweepParam) -> None:
    assert parse_random(entry)[1] == expected


@pytest.mark.parametrize(
    ("flag", "entry", "fragment"),
    [
        ("grid", "optim.lr", "expected KEY=V1,V2"),
        ("grid", "=0.1", "expected KEY=V1,V2"),
        ("grid", "optim.lr=", "no values"),
        ("random", "optim.lr=0.1", "expected KEY=LOW:HIGH"),
        ("random", "optim.lr=1:2:cubic", "expected KEY=LOW:HIGH"),
        ("random", "optim.lr=a:b", "must be numbers"),
        ("random", "optim.lr=0.1:0.01", "low < high"),
        ("random", "optim.lr=0:1:log", "log_uniform needs low > 0"),
    ],
)
def test_bad_entries_are_usage_errors_naming_the_entry(flag: str, entry: str, fragment: str) -> None:
    parse = parse_grid if flag == "grid" else parse_random
    with pytest.raises(UsageError) as info:
        parse(entry)
    assert fragment in str(info.value) and f"--{flag} {entry}" in str(info.value)


@pytest.mark.parametrize(
    "value",
    [
        0.1,
        1e-5,
        3e20,
        -2.5,
        0,
        7,
        True,
        False,
        "adam",
        'qu"ote\\s é',
        [16, 32],
        [[1], [2, 3]],
        {"a": 1, "b c": [0.5, "x"]},
    ],
)
def test_toml_value_round_trips(value) -> None:
    text = toml_value(value)
    assert tomllib.loads(f"v = {text}")["v"] == value


def test_toml_value_special_floats() -> None:
    assert toml_value(math.inf) == "inf" and toml_value(-math.inf) == "-inf" and toml_value(math.nan) == "nan"
    with pytest.raises(TypeError):
        toml_value(None)
    assert toml_value(np.float64(0.1)) == "0.1" and toml_value({"b c": 1, "d": "é"}) == '{ "b c" = 1, d = "é" }'
    assert toml_value(np.int64(3)) == "3" and toml_value(np.float32(0.5)) == "0.5"  # raised TypeError: no TOML form
    assert toml_value(np.float32("nan")) == "nan" and toml_value([np.float32("-inf")]) == "[-inf]"


# --------------------------------------------------------------------------- definitions


def test_command_line_adds_to_and_replaces_the_spec_params() -> None:
    spec = SweepSpec(
        params={"optim.lr": SweepParam(values=[0.1]), "seed": SweepParam(values=[0])}, metric="val/loss", goal="min"
    )
    d = build_definition(spec, grid=["optim.lr=0.5,0.05", "optim.momentum=0.0,0.9"])
    assert list(d.params) == ["optim.lr", "seed", "optim.momentum"]  # replaced key keeps its place
    assert dict(d.params)["optim.lr"].values == [0.5, 0.05]
    assert (d.method, d.metric, d.goal, d.seed, d.trials) == ("grid", "val/loss", "min", 0, 4)  # the grid size
    d = build_definition(spec, grid=["seed=1,2"], trials=1, seed=7, metric="val/accuracy", goal="max")
    assert (d.trials, d.seed, d.metric, d.goal) == (1, 7, "val/accuracy", "max")
    d = build_definition(spec, method="tpe", pruner="median", trials=5)
    assert (d.method, d.pruner, d.trials) == ("tpe", "median", 5)


def test_random_flag_makes_the_sweep_random_and_needs_a_budget() -> None:
    with pytest.raises(UsageError, match="--trials"):
        build_definition(None, random=["optim.lr=1e-4:1e-1:log"])
    d = build_definition(None, random=["optim.lr=1e-4:1e-1:log"], grid=["seed=0,1"], trials=4)
    assert d.method == "random"
    tpe = build_definition(SweepSpec(method="tpe"), random=["optim.lr=1e-4:1e-1:log"], trials=4)
    assert tpe.method == "tpe"  # a range turns a grid into random search, never tpe into random


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({}, "nothing to sweep"),
        ({"grid": ["optim.lr=0.1", "optim.lr=0.2"]}, "swept twice"),
        ({"grid": ["tracking.experiment=a,b"]}, "cannot sweep tracking.experiment"),
        ({"grid": ["sweep.seed=1,2"]}, "cannot sweep sweep.seed"),
        ({"grid": ["seed=1,2"], "trials": 0}, "at least 1"),
        ({"grid": ["seed=1,2"], "trials": 3}, "--trials 3: the grid has only 2 point"),
        ({"grid": ["seed=1,2"], "seed": -1}, ">= 0"),
        ({"grid": ["seed=1,2"], "seed": 2**32}, r"< 2\*\*32"),
    ],
)
def test_bad_definitions_are_usage_errors(kwargs: dict, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        build_definition(None, **kwargs)


def test_a_range_in_a_grid_sweep_is_a_spec_error_with_its_line(write_spec) -> None:
    path = write_spec('[sweep]\n[sweep.params."optim.lr"]\nlow = 0.001\nhigh = 0.1\n')
    loaded = load_spec(path)
    from runner.spec.messages import locate_keys

    with pytest.raises(SpecError) as info:
        build_definition(loaded.spec.sweep, spec_file=path, key_lines=locate_keys(loaded.source_text))
    (issue,) = info.value.issues
    assert issue.key == 'sweep.params."optim.lr"' and issue.file == path and issue.line is not None
    assert path.read_text().splitlines()[issue.line - 1].startswith('[sweep.params."optim.lr"]')
    assert 'method = "random"' in issue.message
    # the same range is fine for random search
    random_def = build_definition(loaded.spec.sweep, trials=2, random=["optim.momentum=0:0.5"])
    assert random_def.method == "random"


def test_definition_json_round_trip() -> None:
    d = build_definition(
        None, grid=["seed=0,1", "model.kwargs.hidden=[8],[16]"], random=["optim.lr=1e-3:1e-1:log"], trials=5, seed=3
    )
    back = SweepDefinition.model_validate(d.to_json())
    assert back == d and back.digest() == d.digest()
    other = build_definition(None, grid=["seed=0,1"], random=["optim.lr=1e-3:1e-1:log"], trials=5, seed=4)
    assert other.digest() != d.digest()
    assert d.describe("optim.lr") == "log_uniform(0.001, 0.1)" and d.describe("seed") == "[0, 1]"
    with pytest.raises(ValueError):
        SweepDefinition.model_validate({"method": "grid"})


# --------------------------------------------------------------------------- expansion


def test_grid_is_the_cartesian_product_in_key_order_capped_by_trials() -> None:
    d = build_definition(None, grid=["optim.lr=0.1,0.01", "seed=0,1,2"])
    trials = expand(d)
    assert [t.index for t in trials] == list(range(6))
    assert [tuple(t.values.values()) for t in trials] == [(0.1, 0), (0.1, 1), (0.1, 2), (0.01, 0), (0.01, 1), (0.01, 2)]
    assert trials[4].overrides() == ["optim.lr=0.01", "seed=1"]
    assert trials[4].label() == "trial 4 (optim.lr=0.01, seed=1)"
    capped = expand(build_definition(None, grid=["optim.lr=0.1,0.01", "seed=0,1,2"], trials=4))
    assert [t.values for t in capped] == [t.values for t in trials[:4]]
    assert Trial(4, trials[4].values).run_name() == "lr=0.01 seed=1"  # named by its values, keys shortened
    with pytest.raises(UsageError, match="only 2 point"):
        build_definition(None, grid=["seed=0,1"], trials=10)


def _draws(definition: SweepDefinition, numbers: range) -> list[dict]:
    """The values Optuna's sampler gives trials ``numbers`` of ``definition`` (each seeded by its number)."""
    import optuna

    study = optuna.create_study(sampler=make_sampler(definition))
    out = []
    for number in numbers:
        trial = study.ask()
        study.sampler = make_sampler(definition, number)
        out.append(definition.suggest(trial))
        study.tell(trial, 0.0)
    return out


def test_random_sampling_is_seeded_per_trial_and_respects_bounds() -> None:
    def draw(seed: int, n: int = 200) -> list[dict]:
        d = build_definition(
            None,
            grid=["optim.name=adam,sgd"],
            random=["optim.lr=1e-5:1e-1:log", "optim.momentum=0.1:0.9", "seed=3:7:int"],
            trials=n,
            seed=seed,
        )
        return _draws(d, range(n))

    first, again, other = draw(0), draw(0), draw(1)
    assert first == again and first != other
    lrs = [t["optim.lr"] for t in first]
    assert all(1e-5 <= lr <= 1e-1 for lr in lrs)
    # log-uniform: about as many draws below the geometric middle (1e-3) as above, and every decade is hit
    below = sum(lr < 1e-3 for lr in lrs)
    assert 70 < below < 130
    assert {math.floor(math.log10(lr)) for lr in lrs} == {-5, -4, -3, -2}
    assert all(0.1 <= t["optim.momentum"] <= 0.9 for t in first)
    seeds = [t["seed"] for t in first]
    assert all(isinstance(s, int) for s in seeds) and set(seeds) == {3, 4, 5, 6, 7}
    assert {t["optim.name"] for t in first} == {"adam", "sgd"}
    assert len(first) == 200 and list(first[0]) == ["optim.name", "optim.lr", "optim.momentum", "seed"]
    d = build_definition(None, random=["optim.lr=1e-5:1e-1:log"], trials=3)
    assert _draws(d, range(5, 6)) == _draws(d, range(5, 6))  # a trial draws the same values in any worker


def test_list_values_travel_through_optuna_as_toml_text() -> None:
    values = [[16], [32, 32]]
    assert encode_choices(values) == ["[16]", "[32, 32]"] and encode_choices([0.1, "a", None]) == [0.1, "a", None]
    assert [decode_choice(values, c) for c in encode_choices(values)] == values
    d = build_definition(None, grid=["model.kwargs.hidden=[16],[32,32]"], method="random", trials=8)
    assert {json.dumps(v["model.kwargs.hidden"]) for v in _draws(d, range(8))} == {"[16]", "[32, 32]"}


def test_int_range_without_an_integer_is_an_error() -> None:
    with pytest.raises(UsageError, match="no integer"):
        build_definition(None, random=["seed=0.2:0.8:int"], trials=1)


def test_a_study_name_follows_the_trial_spec_and_the_definition() -> None:
    d = build_definition(None, grid=["seed=0,1"])
    assert study_name("digits", "a" * 64, d) == study_name("digits", "a" * 64, d)
    assert study_name("digits", "a" * 64, d).startswith("digits-") and len(study_name("digits", "a" * 64, d)) == 19
    assert study_name("digits", "b" * 64, d) != study_name("digits", "a" * 64, d)
    assert study_name("digits", "a" * 64, build_definition(None, grid=["seed=0,2"])) != study_name(
        "digits", "a" * 64, d
    )


def test_trials_checked_up_front() -> None:
    grid = build_definition(None, grid=["seed=0,1", "optim.lr=0.1,0.2"])
    assert [t.index for t in trials_to_check(grid)] == [0, 1, 2, 3]
    rnd = build_definition(
        None, random=["optim.lr=1e-4:1e-1:log", "seed=1:3:int"], grid=["optim.name=sgd,adam"], trials=9
    )
    checks = [t.values for t in trials_to_check(rnd)]
    assert {"optim.lr": 1e-4, "seed": 1, "optim.name": "sgd"} in checks
    assert {"optim.lr": 0.1, "seed": 1, "optim.name": "sgd"} in checks
    assert {"optim.lr": 1e-4, "seed": 3, "optim.name": "adam"} not in checks and len(checks) == 4


# --------------------------------------------------------------------------- trial specs


def test_trial_specs_drop_the_sweep_table(write_spec) -> None:
    path = write_spec(SWEEP_TABLE)
    base = load_spec(path)
    trial = without_sweep(load_spec(path, ["optim.lr=0.01"]))
    assert base.spec.sweep is not None and trial.spec.sweep is None and "sweep" not in trial.data
    assert trial.spec.optim.lr == 0.01 and trial.path == base.path
    assert trial.sha256 == spec_sha256(trial.spec) != base.sha256
    assert without_sweep(trial) is trial


def test_trial_overrides_reproduce_the_values_through_the_loader(write_spec) -> None:
    path = write_spec()
    trial = Trial(0, {"optim.lr": 1e-5 / 3, "model.kwargs.hidden": [8, 4], "optim.name": "adam", "seed": 5})
    spec = load_spec(path, trial.overrides()).spec
    assert (spec.optim.lr, spec.model.kwargs["hidden"], spec.optim.name, spec.seed) == (1e-5 / 3, [8, 4], "adam", 5)


def test_every_bad_trial_is_reported_with_its_number_and_key(write_spec) -> None:
    path = write_spec()
    trials = expand(build_definition(None, grid=["optim.lr=0.1,-1", "train.epochs=1,0"]))
    with pytest.raises(SpecError) as info:
        prepare_trials(path, [], trials)
    found = {(i.key, i.message.rsplit("[sweep ", 1)[-1]) for i in info.value.issues}
    assert ("train.epochs", "trial 1 (optim.lr=0.1, train.epochs=0)]") in found
    assert ("optim.lr", "trial 2 (optim.lr=-1, train.epochs=1)]") in found
    assert {"optim.lr", "train.epochs"} == {k for k, m in found if m.startswith("trial 3 ")}
    assert not any(m.startswith("trial 0 ") for _, m in found)


def test_every_trial_takes_the_unset_keys(write_spec) -> None:
    """``runner sweep --unset KEY``: each trial's spec has KEY at its default, before the trial's values."""
    path = write_spec()  # data.val_fraction = 0.25
    trials = expand(build_definition(None, grid=["seed=1,2"]))
    prepared = prepare_trials(path, [], trials, unset=["data.val_fraction"])
    assert [(loaded.spec.data.val_fraction, loaded.unset) for loaded, _ in prepared] == [
        (0.2, ("data.val_fraction",))
    ] * 2


def test_unknown_keys_and_models_are_caught_before_running(write_spec) -> None:
    path = write_spec()
    with pytest.raises(SpecError) as info:
        prepare_trials(path, [], expand(build_definition(None, grid=['model.name="mlp","resnett"'])))
    (issue,) = info.value.issues
    assert issue.key == "model.name" and 'trial 1 (model.name="resnett")' in issue.message
    with pytest.raises(SpecError) as info:
        prepare_trials(path, [], expand(build_definition(None, grid=["optim.lrr=0.1"])))
    assert info.value.issues[0].key == "optim.lrr" and "trial 0 (" in str(info.value)


def test_a_bad_value_from_the_sweep_table_is_blamed_on_its_line_not_on_set(write_spec, capsys) -> None:
    path = write_spec('[sweep]\nmethod = "grid"\n\n[sweep.params."optim.lr"]\nvalues = [0.1, -1.0]\n')
    line = path.read_text().splitlines().index('[sweep.params."optim.lr"]') + 1
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line}: optim.lr: got -1.0; expected a value > 0.0" in err
    assert "--set" not in err and "trial 1 (optim.lr=-1.0)" in err
    # the same value given on the command line is still blamed on the command line
    assert main(["sweep", str(path), "--grid", "optim.lr=0.1,-2.0"]) == 2
    assert "--grid: optim.lr: got -2.0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--grid", "optim.lr=0.1,abc"],
            '--grid: optim.lr: got "abc"; expected a number (from --grid optim.lr=0.1,abc) [sweep trial 1 (',
        ),
        (
            ["--random", "optim.lr=-1:1", "--trials", "2"],
            "--random: optim.lr: got -1.0; expected a value > 0.0 (from --random optim.lr=-1:1) [sweep values (",
        ),
    ],
)
def test_a_bad_swept_value_names_the_flag_it_was_given_with(write_spec, capsys, flags: list, expected: str) -> None:
    assert main(["sweep", str(write_spec()), *flags]) == 2
    err = capsys.readouterr().err
    assert expected in err and "--set" not in err


def test_an_unknown_swept_key_is_reported_once_for_all_trials(write_spec, capsys) -> None:
    assert main(["sweep", str(write_spec()), "--grid", "optim.lrr=0.1,0.2,0.3"]) == 2
    err = capsys.readouterr().err
    assert err.count('unknown key "lrr"') == 1, err
    assert (
        "--grid: optim.lrr: got unknown key" in err
        and "(from --grid optim.lrr=0.1,0.2,0.3) [all 3 sweep trials]" in err
    )


def test_an_unknown_model_of_a_sweep_table_names_its_line(write_spec, capsys) -> None:
    path = write_spec('[sweep.params."model.name"]\nvalues = ["mlp", "mlpp"]\n')
    line = path.read_text().splitlines().index('[sweep.params."model.name"]') + 1
    assert main(["sweep", str(path)]) == 2
    assert f"{path}:{line}: model.name: unknown model 'mlpp'" in capsys.readouterr().err


def test_run_sweep_with_a_bad_value_fails_before_any_run(write_spec, store: str, tmp_path, capsys) -> None:
    path = write_spec()
    with pytest.raises(SpecError) as info:
        run_sweep(path, [], cli=CommandLine(grid=["optim.lr=0.1,-1"]))
    assert info.value.issues[0].key == "optim.lr" and "trial 1 (optim.lr=-1)" in str(info.value)
    assert not (tmp_path / "mlflow.db").exists()  # the store was not even opened: no parent, no child
    assert not (tmp_path / "optuna.db").exists()  # nor the study's
    assert main(["sweep", str(path), "--grid", "optim.lr=0.1,-1"]) == 2
    assert "trial 1 (optim.lr=-1)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--random", "optim.lr=0.1:0.01"], "low < high"),
        (["--random", "optim.lr=1e-3:1e-1"], "--trials"),
        (["--grid", "seed=0,1", "--trials", "3"], "--trials 3: the grid has only 2 point(s)"),
        (["--grid", "seed=0,1", "--method", "tpx"], "invalid choice: 'tpx'"),
        (["--grid", "seed=0,1", "--pruner", "mediun"], "invalid choice: 'mediun'"),
        (["--grid", "optim.lr=0.1", "--jobs", "0"], "--jobs 0"),
    ],
)
def test_cli_usage_errors_exit_2(write_spec, args: list[str], fragment: str, capsys) -> None:
    assert main(["sweep", str(write_spec()), *args]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    ("table", "key", "fragments"),
    [
        ('method = "tpx"\ntrials = 2', "sweep.method", ('got "tpx"', 'did you mean "tpe"?')),
        ('pruner = "mediun"', "sweep.pruner", ('got "mediun"', 'did you mean "median"?')),
        ('method = "tpe"', "sweep.trials", ('method = "tpe" needs a trial budget',)),
    ],
)
def test_an_unknown_sampler_or_pruner_is_located_with_a_suggestion(write_spec, table, key, fragments, capsys) -> None:
    path = write_spec(f"[sweep]\n{table}\n[sweep.params.seed]\nvalues = [0, 1]\n")
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    (line,) = [n for n, text in enumerate(path.read_text().splitlines(), 1) if text.startswith(table.split()[0])]
    assert f"{path}:{line}: {key}: " in err or f"{path}:{line - 1}: {key}: " in err, err
    assert all(f in err for f in fragments), err


def test_a_grid_with_more_trials_than_points_is_located(write_spec, capsys) -> None:
    path = write_spec("[sweep]\ntrials = 5\n[sweep.params.seed]\nvalues = [0, 1]\n")
    assert main(["sweep", str(path)]) == 2
    line = path.read_text().splitlines().index("trials = 5") + 1
    assert f"{path}:{line}: sweep.trials: trials = 5 but the grid has 2 point(s)" in capsys.readouterr().err


def test_a_storage_that_cannot_be_opened_is_located_and_leaves_nothing(write_spec, tmp_path, capsys) -> None:
    bad = f"sqlite:///{tmp_path}/no/such/folder/optuna.db"
    path = write_spec(f'[sweep]\nstorage = "{bad}"\n[sweep.params.seed]\nvalues = [0, 1]\n')
    assert main(["sweep", str(path)]) == 2
    line = path.read_text().splitlines().index(f'storage = "{bad}"') + 1
    err = capsys.readouterr().err
    assert f"{path}:{line}: sweep.storage: cannot open Optuna storage" in err and "Traceback" not in err
    assert main(["sweep", str(write_spec(name="b.toml")), "--grid", "seed=0,1", "--storage", "nosuchdb://x"]) == 2
    assert "--storage nosuchdb://x: cannot open Optuna storage" in capsys.readouterr().err
    assert not list(tmp_path.glob("mlflow.db*")) or _no_runs(tmp_path)


def _no_runs(folder) -> bool:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    return all(not client.search_runs([e.experiment_id]) for e in client.search_experiments())


def test_default_storage_sits_next_to_the_mlflow_store(tmp_path) -> None:
    assert default_storage_url("sqlite:////data/runs/mlflow.db") == "sqlite:////data/runs/optuna.db"
    assert default_storage_url("file:///data/mlruns") == "sqlite:////data/optuna.db"
    assert default_storage_url("http://mlflow:5000", cwd=tmp_path) == f"sqlite:///{tmp_path}/optuna.db"
    assert mask_secrets("postgresql+psycopg://me:secret@db:5432/optuna") == "postgresql+psycopg://me:***@db:5432/optuna"


def test_trials_are_planned_without_the_slurm_job_they_run_in(monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = trial_environ()
    assert "SLURM_JOB_ID" not in env and "SLURM_NTASKS" not in env and env["OMP_NUM_THREADS"] == "3"


def test_sweeps_need_tracking(write_spec) -> None:
    path = write_spec()
    with pytest.raises(UsageError, match=r"tracking\.enabled"):
        run_sweep(path, ["tracking.enabled=false"], cli=CommandLine(grid=["seed=0,1"]))


def test_trial_tags() -> None:
    tags = dict(trial_tags(Trial(3, {"optim.lr": 0.01, "model.kwargs.hidden": [16], "optim.name": "adam"})))
    assert tags["runner.sweep.trial"] == "3"
    assert tags["runner.sweep.values"] == '{"optim.lr": 0.01, "model.kwargs.hidden": [16], "optim.name": "adam"}'
    assert (tags["sweep.optim.lr"], tags["sweep.model.kwargs.hidden"], tags["sweep.optim.name"]) == (
        "0.01",
        "[16]",
        "adam",
    )


# --------------------------------------------------------------------------- devices


def _plan(accelerator: str = "cuda", ids: tuple[int, ...] = (0,), world: int = 1, visible: int = 4) -> SimpleNamespace:
    return SimpleNamespace(
        devices=SimpleNamespace(
            accelerator=accelerator, requested_ids=list(ids), world_size=world, visible=[str(i) for i in range(visible)]
        )
    )


def test_concurrent_single_gpu_trials_spread_over_the_spec_devices() -> None:
    d = build_definition(None, grid=["seed=0,1,2,3"])
    spec = lambda ids: SimpleNamespace(devices=SimpleNamespace(ids=ids))  # noqa: E731
    assert device_pool(spec([2, 3]), [_plan()], d) == [2, 3]
    assert device_pool(spec("all"), [_plan()], d) == [0, 1, 2, 3]
    assert device_pool(spec("all"), [_plan("cpu", ())], d) is None
    assert device_pool(spec([0, 1]), [_plan(ids=(0, 1), world=2)], d) is None  # ddp / dp trials keep their devices
    assert device_pool(spec([0, 1]), [_plan()], build_definition(None, grid=["devices.ids=[0],[1]"])) is None


# --------------------------------------------------------------------------- report


def _report(goal: str = "max") -> SweepReport:
    d = build_definition(None, grid=["optim.lr=0.1,0.01,0.001,0.0001"], metric="val/accuracy", goal=goal)
    trials = [
        TrialResult(0, {"optim.lr": 0.1}, "r0", "FINISHED", 0.5),
        TrialResult(1, {"optim.lr": 0.01}, "r1", "FINISHED", 0.9, reused=True),
        TrialResult(2, {"optim.lr": 0.001}, "r2", "FAILED", None, "TrainingError: RuntimeError: boom\nmore"),
        TrialResult(3, {"optim.lr": 0.0001}, "r3", "FINISHED", 0.9),
    ]
    return SweepReport(d, trials, "parent", "sqlite:///x.db", "tests", ["a note"])


def test_report_best_failed_table_and_json() -> None:
    report = _report()
    assert report.failed == 1 and report.best is not None and report.best.index == 1  # ties: lowest index
    assert _report("min").best.index == 0  # type: ignore[union-attr]
    table = report.table()
    lines = table.splitlines()
    assert lines[1].split() == ["trial", "optim.lr", "val/accuracy", "status"]
    assert lines[3].split()[:3] == ["1*", "0.01", "0.9"] and "(earlier run)" in lines[3]
    assert lines[4].split()[-1] == "FAILED" and lines[4].split()[2] == "-"
    assert (
        "best: trial 1" in table
        and "trial 2 FAILED: TrainingError: RuntimeError: boom" in table
        and "note: a note" in table
    )
    data = report.to_json()
    assert (
        data["failed"] == 1
        and data["best"]["run_id"] == "r1"
        and data["trials"][2]["error"].startswith("TrainingError")
    )
    assert data["definition"]["params"]["optim.lr"]["values"] == [0.1, 0.01, 0.001, 0.0001]
    import json

    json.dumps(data)


def test_report_without_a_metric_has_no_best() -> None:
    report = _report()
    for t in report.trials:
        t.metric_value = None
    assert report.best is None and "no finished trial logged val/accuracy" in report.table()
    report.trials[0].metric_value = math.nan
    assert report.best is None


@pytest.mark.parametrize(
    ("name", "expected"), [("digits-mlp", "digits-mlp-sweep"), ("digits-mlp-lr-sweep", "digits-mlp-lr-sweep")]
)
def test_the_parent_run_is_named_after_the_spec_with_one_sweep_suffix(name: str, expected: str) -> None:
    from runner.tools.sweep_space import parent_run_name

    assert parent_run_name(name) == expected


@pytest.mark.parametrize("grid", [["optim.lr=0.3", "seed=0"], ["optim.lr=0.3,0.1", "seed=0"]], ids=["one", "two"])
def test_every_enqueued_grid_point_can_be_told_down_to_the_last(grid: list[str]) -> None:
    import optuna

    definition = build_definition(None, grid=grid)
    study = optuna.create_study(sampler=make_sampler(definition), direction="maximize")
    for point in definition.grid_points():
        study.enqueue_trial(point)
    told = []
    for _ in definition.grid_points():
        trial = study.ask()
        told.append(definition.suggest(trial))
        study.tell(trial, 0.5)  # the last point raised KeyError: 'grid_id' in GridSampler.after_trial
    assert told == [dict(p) for p in definition.grid_points()]
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * len(told)


def test_a_worker_that_dies_after_its_trial_finished_leaves_the_result_standing(tmp_path) -> None:
    from runner.tools.sweep_study import SweepStudy, open_storage

    definition = build_definition(None, grid=["seed=0,1"])
    url = f"sqlite:///{tmp_path}/optuna.db"
    study, _ = SweepStudy.open(open_storage(url), url, "s", definition, found=lambda s: "p", spec_sha256="x")
    done, running = study.next_trial(), study.next_trial()
    assert done is not None and running is not None
    study.tell(done, TrialResult(done.number, {"seed": 0}, "r0", "FINISHED", 0.5))
    # the process exits non-zero after the result was recorded: it raised UpdateFinishedTrialError here
    assert study.fail_dead(done.number, "the sweep worker process exited with status 1") is False
    assert study.fail_dead(running.number, "the sweep worker process exited with status 9") is True
    assert [t.state.name for t in study.study.trials] == ["COMPLETE", "FAIL"]
    assert study.study.trials[0].value == 0.5


def test_the_interrupt_message_names_the_command_that_continues_the_sweep() -> None:
    from runner.errors import Interrupted
    from runner.tools.sweep import continue_command

    command = continue_command(["sweep", "my spec.toml", "--storage", "postgresql://u:pw@db/optuna"])
    assert command == "runner sweep 'my spec.toml' --storage postgresql://u:pw@db/optuna"
    message = Interrupted(2, command=command, checkpoint="the sweep stopped").format_message()
    assert message == (
        "interrupted: the sweep stopped. Continue it with: runner sweep 'my spec.toml' --storage "
        "postgresql://u:***@db/optuna"
    )


def test_a_taken_over_trials_old_run_ends_killed(ready_store: str) -> None:
    from mlflow.tracking import MlflowClient

    from runner.tools.sweep_space import SweepStore

    client = MlflowClient(ready_store)
    experiment = client.create_experiment("taken")
    parent = client.create_run(experiment).info.run_id

    def child(number: int) -> str:
        tags = {"mlflow.parentRunId": parent, "runner.sweep.optuna_trial": str(number)}
        return client.create_run(experiment, tags=tags).info.run_id

    dead, other = child(3), child(4)
    SweepStore(ready_store, "taken").kill_taken_over(parent, [3])
    assert client.get_run(dead).info.status == "KILLED"
    assert "taken over" in client.get_run(dead).data.tags["runner.error"]
    assert client.get_run(other).info.status == "RUNNING"  # another worker's trial is left alone


def test_take_over_ends_the_old_runs_of_the_trials_it_enqueues_again() -> None:
    from types import SimpleNamespace

    from runner.tools.sweep_jobs import take_over

    ended = []
    store = SimpleNamespace(kill_taken_over=lambda parent, numbers: ended.append((parent, numbers)))
    take_over(SimpleNamespace(fail_stale=lambda: [3], parent_run_id="p"), store)  # type: ignore[arg-type]
    take_over(SimpleNamespace(fail_stale=lambda: [], parent_run_id="p"), store)  # type: ignore[arg-type]
    assert ended == [("p", [3])]


def test_two_workers_racing_for_the_waiting_trials_never_claim_one_twice(tmp_path, monkeypatch) -> None:
    """Each worker has its own connection to one sqlite storage. Optuna's WAITING -> RUNNING update reads the trial,
    then writes it: two workers that both read WAITING both ran the trial, and the second's result raised
    UpdateFinishedTrialError. The window between the read and the write is widened here to 50 ms."""
    import threading
    import time

    from optuna.storages import RDBStorage

    from runner.tools.sweep_study import SweepStudy, open_storage

    checked = RDBStorage.check_trial_is_updatable

    def slow_check(self, trial_id, state):  # Optuna calls it between its read and its write
        time.sleep(0.05)
        return checked(self, trial_id, state)

    monkeypatch.setattr(RDBStorage, "check_trial_is_updatable", slow_check)
    definition = build_definition(None, grid=["seed=0,1,2,3,4,5"])
    url = f"sqlite:///{tmp_path}/optuna.db"
    founder, _ = SweepStudy.open(open_storage(url), url, "s", definition, found=lambda s: "p", spec_sha256="x")
    workers = [founder, SweepStudy.join(open_storage(url), url, "s", definition)]
    claimed: list[list[int]] = [[], []]
    start = threading.Barrier(2)

    def claim_all(k: int) -> None:
        start.wait()
        while (trial := workers[k].next_trial()) is not None:
            claimed[k].append(trial.number)

    threads = [threading.Thread(target=claim_all, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    numbers = claimed[0] + claimed[1]
    assert sorted(numbers) == list(range(6)), claimed  # every trial claimed by exactly one worker
    trials = founder.frozen_trials()
    assert {t.state.name for t in trials} == {"RUNNING"} and all(t.datetime_start is not None for t in trials)


def test_a_result_told_after_another_worker_took_the_trial_over_is_dropped_not_raised(
    tmp_path, ready_store: str, monkeypatch, capsys
) -> None:
    """A worker paused past the grace (a suspended job) finds its trial failed and enqueued again by another worker:
    its tell raised UpdateFinishedTrialError and the worker process died. Now its run ends KILLED, saying why."""
    from mlflow.tracking import MlflowClient

    from runner.tools import sweep_jobs
    from runner.tools.sweep_space import SweepStore
    from runner.tools.sweep_study import SweepStudy, open_storage

    definition = build_definition(None, grid=["seed=0,1"])
    url = f"sqlite:///{tmp_path}/optuna.db"
    study, _ = SweepStudy.open(open_storage(url), url, "s", definition, found=lambda s: "p", spec_sha256="x")
    late, other = study.next_trial(), study.next_trial()
    assert late is not None and other is not None
    client = MlflowClient(ready_store)
    run_id = client.create_run(client.create_experiment("late")).info.run_id

    def taken_over_meanwhile(study_, store, setup, trial, point, parent_id):
        assert study.fail_dead(trial.number, "no heartbeat for 60 s") is True  # as a take-over fails it
        return TrialResult(point.index, point.values, run_id, "FINISHED", 0.5)

    monkeypatch.setattr(sweep_jobs, "_execute", taken_over_meanwhile)
    result = sweep_jobs.run_trial(study, SweepStore(ready_store, "late"), None, late)  # type: ignore[arg-type]
    assert result.status == "FINISHED" and result.run_id == run_id  # returned, not raised
    assert "trial 0 was taken over by another worker while this one ran it" in capsys.readouterr().err
    assert client.get_run(run_id).info.status == "KILLED"
    assert "taken over" in client.get_run(run_id).data.tags["runner.error"]
    assert study.tell(other, TrialResult(other.number, {"seed": 1}, "r1", "FINISHED", 0.7)) is True
    assert [(t.state.name, t.value) for t in study.study.trials] == [("FAIL", None), ("COMPLETE", 0.7)]
