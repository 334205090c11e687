"""What a new run records about its spec: active params, every file it read, the overrides, the notes, its name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.devices.inventory import Inventory
from runner.errors import UsageError
from runner.plan import make_plan
from runner.spec.loading import load_spec
from runner.tracking.runs import TrackedRun, start_run
from runner.tracking.stored import read_stored_run
from runner.tracking.tags import spec_artifacts
from tests.helpers import spec_text

REPO = Path(__file__).parents[2]
NO_GPU = Inventory([], False, "nvidia-smi not found", [])


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module (creating a store's tables takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('records')}/mlflow.db"


@pytest.fixture
def experiments(tmp_path: Path) -> Path:
    """A copy of the shipped experiments (digits_mlp_ddp.toml extends base/digits.toml)."""
    target = tmp_path / "experiments"
    shutil.copytree(REPO / "experiments", target)
    return target


def artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    out: set[str] = set()
    for f in client.list_artifacts(run_id, path):
        out |= artifacts(client, run_id, f.path) if f.is_dir else {f.path}
    return out


def started(loaded, store: str) -> str:
    plan = make_plan(loaded, env={}, inventory=NO_GPU, tracking_uri=store)
    return start_run(loaded, plan.describe(), run_name=plan.run_name, uri=store).run_id


def test_a_run_logs_the_files_it_extends_and_the_logged_spec_loads_on_its_own(experiments, shared, tmp_path) -> None:
    store = shared
    loaded = load_spec(experiments / "digits_mlp_ddp.toml", ['parallel.mode="none"', "optim.lr=0.05"])
    run_id = started(loaded, store)
    client = MlflowClient(store)
    assert artifacts(client, run_id) >= {"spec/digits_mlp_ddp.toml", "spec/base/digits.toml", "spec/resolved.toml"}
    copy = Path(client.download_artifacts(run_id, "spec", str(tmp_path / "dl")))
    again = load_spec(copy / "digits_mlp_ddp.toml", ['parallel.mode="none"', "optim.lr=0.05"])
    assert again.spec == loaded.spec  # self-contained: extends resolves inside the logged folder
    run = client.get_run(run_id)
    assert run.info.run_name == "digits-mlp-ddp none-1 lr=0.05"
    assert run.data.tags["runner.overrides"] == "--set 'parallel.mode=\"none\"' --set optim.lr=0.05"
    assert "runner.notes" not in run.data.tags  # nothing runs instead of what was asked


def test_the_runs_of_one_spec_under_every_mode_share_a_group_tag_and_other_keys_part_them(experiments, shared) -> None:
    """One filter, tags.runner.spec.group = "...", shows a spec's modes side by side in the MLflow UI."""
    spec = experiments / "digits_mlp_ddp.toml"
    ddp = ['parallel.mode="ddp"', "parallel.nproc_per_node=4"]
    sets = [[], ['parallel.mode="none"'], ddp, [*ddp, 'tracking.run_name="x"'], ["optim.lr=0.05"]]
    runs = [MlflowClient(shared).get_run(started(load_spec(spec, s), shared)) for s in sets]
    groups = [run.data.tags["runner.spec.group"] for run in runs]
    assert len(groups[0]) == 12 and groups[0] == groups[1] == groups[2] == groups[3] != groups[4]
    names = [run.info.run_name for run in runs]
    assert names[1:] == ["digits-mlp-ddp none-1", "digits-mlp-ddp ddp-4", "x", "digits-mlp-ddp ddp-2 lr=0.05"]


def test_params_leave_out_inactive_keys_and_stored_spec_round_trips(experiments, shared) -> None:
    store = shared
    loaded = load_spec(experiments / "digits_mlp_ddp.toml", ['parallel.mode="none"'])
    run_id = started(loaded, store)
    params = MlflowClient(store).get_run(run_id).data.params
    assert [k for k in params if k.startswith("parallel.")] == ["parallel.mode"]
    assert "data.num_samples" not in params and params["data.split_seed"] == "0"
    stored = read_stored_run(TrackedRun(store, run_id))
    assert stored.spec_path == loaded.path and stored.status == "RUNNING"
    assert stored.loaded().spec == loaded.spec and stored.loaded().sha256 == loaded.sha256


def test_the_notes_of_the_plan_are_tagged(write_spec, shared) -> None:
    store = shared
    loaded = load_spec(write_spec(), ["devices.ids=[0, 1]"])
    run = MlflowClient(store).get_run(started(loaded, store))
    assert run.data.tags["runner.notes"] == "devices.ids = [0, 1] is ignored: the run is on cpu"
    assert "runner.overrides" in run.data.tags
    plain = MlflowClient(store).get_run(started(load_spec(write_spec()), store))
    assert "runner.notes" not in plain.data.tags and "runner.overrides" not in plain.data.tags
    assert "mlflow.note.content" not in plain.data.tags  # no description, no remarks


def test_long_texts_go_to_the_description_and_their_tags_stay_one_short_line(write_spec, shared) -> None:
    sets = ["devices.ids=[0, 1]", 'description="why"', *(f"train.epochs={n}" for n in range(1, 12))]
    loaded = load_spec(write_spec(), sets)
    tags = MlflowClient(shared).get_run(started(loaded, shared)).data.tags
    overrides = "--set 'devices.ids=[0, 1]' --set 'description=\"why\"' --set train.epochs=1"
    assert tags["runner.overrides"].startswith(overrides) and tags["runner.overrides"].endswith("…")
    assert len(tags["runner.overrides"]) == 80  # cut for the UI's chip and column ...
    description = tags["mlflow.note.content"]  # ... and whole on the run's page, after the spec's description
    assert description.startswith("why\n\n#### runner\n**overrides**: " + overrides)
    assert description.endswith("train.epochs=11\n\n**notes**: devices.ids = [0, 1] is ignored: the run is on cpu")


def test_a_long_description_is_cut_so_runners_own_section_stays_and_the_whole_text_is_an_artifact(
    write_spec, shared
) -> None:
    # A 9,000-character description pushed the "#### runner" section out of MLflow's 8,000-character tag.
    long = "x" * 9000
    loaded = load_spec(write_spec(text=spec_text(description=long, tracking={"uri": shared})), ["devices.ids=[0, 1]"])
    run_id = started(loaded, shared)
    client = MlflowClient(shared)
    description = client.get_run(run_id).data.tags["mlflow.note.content"]
    assert len(description) <= 8000
    assert "; full text in artifact spec/resolved.toml, key description]" in description
    assert description.endswith(
        "\n\n#### runner\n**overrides**: --set 'devices.ids=[0, 1]'\n\n**notes**: devices.ids = [0, 1] is ignored: the run is on cpu"
    )
    resolved = Path(client.download_artifacts(run_id, "spec/resolved.toml", str(write_spec().parent))).read_text()
    assert long in resolved


def test_artifact_names_of_sources_outside_the_spec_folder_and_of_clashing_names(tmp_path: Path) -> None:
    body = 'name = "t"\n[data]\ndataset = "synthetic"\nbatch_size = 4\n[optim]\nlr = 0.1\n'
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "base.toml").write_text('[model]\nname = "mlp"\n')
    (tmp_path / "exp").mkdir()
    top = tmp_path / "exp" / "resolved.toml"
    top.write_text('extends = "../shared/base.toml"\n' + body)
    texts = spec_artifacts(load_spec(top), "RESOLVED", json.dumps({}))
    assert set(texts) == {"spec/exp/resolved.toml", "spec/shared/base.toml", "spec/resolved.toml", "spec/plan.json"}
    assert texts["spec/resolved.toml"] == "RESOLVED" and texts["spec/exp/resolved.toml"] == top.read_text()
    alone = tmp_path / "plan.json"  # a spec file called like the plan artifact keeps its text under another name
    alone.write_text(body + '[model]\nname = "mlp"\n')
    texts = spec_artifacts(load_spec(alone), "RESOLVED", "{}")
    assert texts["spec/source-plan.json"] == alone.read_text() and texts["spec/plan.json"] == "{}"


def test_reading_a_run_that_is_not_there_names_the_run_and_the_store(shared, tmp_path) -> None:
    store = shared
    missing = f"sqlite:///{tmp_path}/none/mlflow.db"
    with pytest.raises(UsageError, match=rf"no run abc at {missing}: there is no tracking store there"):
        read_stored_run(TrackedRun(missing, "abc"))
    client = MlflowClient(store)
    foreign = client.create_run(client.create_experiment("by-hand")).info.run_id
    with pytest.raises(UsageError, match=rf"run {foreign} at {store} has no spec stored by runner"):
        read_stored_run(TrackedRun(store, foreign))
    with pytest.raises(UsageError, match=rf"no run {'0' * 32} at {store}: copy the run id"):
        read_stored_run(TrackedRun(store, "0" * 32))


def test_reading_a_sweep_or_bench_parent_run_says_which_command_continues_it(shared) -> None:
    client = MlflowClient(shared)
    experiment = client.create_experiment("parents")
    tags = {"runner.sweep": "parent", "runner.spec.path": "/x/sweep_lr.toml"}
    sweep = client.create_run(experiment, tags=tags).info.run_id
    with pytest.raises(
        UsageError, match=r"is a sweep's parent run: `runner sweep /x/sweep_lr.toml` continues the study"
    ):
        read_stored_run(TrackedRun(shared, sweep))
    bench = client.create_run(experiment, tags={"runner.bench": "parent"}).info.run_id
    with pytest.raises(UsageError, match=r"is a bench's parent run: `runner bench SPEC` measures again"):
        read_stored_run(TrackedRun(shared, bench))
