"""Run names say what a run is: spec name, mode and size, the values the command line changed; trials by values."""

from __future__ import annotations

from pathlib import Path

from runner.devices.inventory import Inventory
from runner.plan import make_plan
from runner.spec.dump import MAX_RUN_NAME_CHARS, short_keys, trial_run_name, values_label
from runner.spec.loading import default_run_name, load_spec

REPO = Path(__file__).parents[2]
DIGITS = REPO / "experiments" / "digits_mlp.toml"
DDP = REPO / "experiments" / "digits_mlp_ddp.toml"
NO_GPU = Inventory([], False, "nvidia-smi not found", [])


def name_of(path: Path, sets: tuple[str, ...] = (), unset: tuple[str, ...] = ()) -> str:
    return make_plan(load_spec(path, sets, unset), env={}, inventory=NO_GPU).run_name


def test_the_default_name_is_spec_mode_size_and_the_changed_values() -> None:
    assert name_of(DDP) == "digits-mlp-ddp ddp-2"
    assert name_of(DDP, ("optim.lr=0.05",)) == "digits-mlp-ddp ddp-2 lr=0.05"
    assert name_of(DDP, ('parallel.mode="none"', "seed=2")) == "digits-mlp-ddp none-1 seed=2"  # the mode is in the name
    assert name_of(DIGITS, ("train.epochs=3",), ("optim.momentum",)) == "digits-mlp none-1 momentum=0.0 epochs=3"


def test_an_unset_of_a_key_no_file_wrote_changes_neither_the_name_nor_the_command_line() -> None:
    assert name_of(DIGITS, (), ("optim.weight_decay",)) == "digits-mlp none-1"
    assert load_spec(DIGITS, (), ("optim.weight_decay", "optim.momentum")).command_line() == [
        "--unset",
        "optim.momentum",
    ]


def test_tracking_run_name_wins() -> None:
    assert name_of(DDP, ('tracking.run_name="mine"', "optim.lr=0.05")) == "mine"


def test_values_are_written_as_they_read_and_keys_shortened_unless_ambiguous() -> None:
    assert short_keys(["optim.lr", "seed"]) == {"optim.lr": "lr", "seed": "seed"}
    assert short_keys(["model.kwargs.num_classes", "data.num_classes"]) == {
        "model.kwargs.num_classes": "model.kwargs.num_classes",
        "data.num_classes": "data.num_classes",
    }
    assert values_label({"data.dataset": "synthetic", "devices.ids": [0, 1], "train.amp": None}) == (
        "dataset=synthetic ids=[0, 1] amp=unset"
    )


def test_trial_names_are_their_values() -> None:
    assert trial_run_name({"optim.lr": 0.1, "seed": 0}) == "lr=0.1 seed=0"
    assert trial_run_name({}) == "trial"


def test_long_names_are_cut_to_what_mlflow_stores() -> None:
    loaded = load_spec(DIGITS, [f'description="{"x" * 400}"'])
    name = default_run_name(loaded, "none", 1)
    assert len(name) == MAX_RUN_NAME_CHARS and name.endswith("...")
