"""The one-line mode switch: another mode's keys are inactive (tolerated, shown, not logged), never silently changed."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from runner.cli import main
from runner.devices.inventory import GpuInfo, Inventory
from runner.devices.resolve import resolve_devices
from runner.errors import DeviceError, SpecError
from runner.plan import make_plan, plan_or_problem
from runner.spec.dump import active_params, dump_spec, inactive_keys, set_inactive_keys
from runner.spec.loading import load_spec, spec_from_dict
from runner.tracking.tags import spec_params
from tests.helpers import readme_example

REPO = Path(__file__).parents[2]
SHIPPED = sorted((REPO / "experiments").glob("*.toml"))
DDP_SPEC = REPO / "experiments" / "digits_mlp_ddp.toml"
NO_GPU = Inventory([], False, "nvidia-smi not found", [])
MODES = ("none", "dp", "ddp")


def gpus(n: int) -> Inventory:
    return Inventory([GpuInfo(i, f"Fake GPU {i}") for i in range(n)], True, "fake", [])


def mode(m: str) -> list[str]:
    return [f'parallel.mode="{m}"']


# ----------------------------------------------------------------------------- every shipped spec, every mode


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
@pytest.mark.parametrize("m", MODES)
def test_one_set_switches_every_shipped_spec_where_gpus_exist(path: Path, m: str) -> None:
    loaded = load_spec(path, mode(m))
    plan = make_plan(loaded, env={}, inventory=gpus(2))
    assert plan.devices.mode == m


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
@pytest.mark.parametrize("m", ["none", "ddp"])
def test_on_cpu_each_shipped_spec_runs_or_the_plan_gives_a_fix_that_runs(path: Path, m: str) -> None:
    loaded = load_spec(path, mode(m))
    info, problem = plan_or_problem(loaded, env={}, inventory=NO_GPU)
    if problem is None:
        assert info["devices"]["accelerator"] == "cpu" and info["mode"] == m
        return
    assert info["devices"] is None and info["missing"] and info["try"]  # the plan, what is missing, a fix
    words = shlex.split(info["try"])  # runner plan FILE --set ... --set ...
    assert words[:3] == ["runner", "plan", str(path)]
    fixed = load_spec(path, [w for w in words[3:] if w != "--set"])
    assert resolve_devices(fixed.spec, {}, NO_GPU).accelerator == "cpu"


def test_the_readme_dp_example_on_cpu_explains_and_its_suggestion_works(capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spec = str(REPO / "experiments" / "resnet_dp.toml")
    assert main(["plan", spec]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith(f"plan for {REPO / 'experiments' / 'resnet_dp.toml'}")  # the plan first
    both = captured.out + captured.err
    assert both.count("no GPU is visible") == 1 and both.count("runner plan") == 1  # said once, on stderr
    out = captured.out.splitlines()  # README's memory table is the real estimate
    example = readme_example("runner plan experiments/resnet_dp.toml          # on a machine without GPUs")
    assert (
        out[next(i for i, x in enumerate(out) if x.startswith("  memory")) :]
        == example[1 : example.index("runner: error:")]
    )
    line = next(x for x in captured.err.splitlines() if "this runs here:" in x)
    command = line.split("this runs here: ", 1)[1].split()
    assert command[:3] == ["runner", "plan", spec]
    assert command[3:] == ["--set", "parallel.mode=none", "--set", "devices.accelerator=cpu"]  # dp is one process
    # the same model's estimate was checked above: the second plan skips it (about 5 s of fake ResNet steps)
    monkeypatch.setattr("runner.plan_report.estimate_memory", lambda loaded, devices: {"error": "not estimated"})
    assert main(command[1:]) == 0  # works as printed
    assert "world size     1" in capsys.readouterr().out


def test_a_suggestion_drops_the_override_it_replaces_and_keeps_the_others() -> None:
    path = REPO / "experiments" / "digits_mlp_ddp.toml"
    loaded = load_spec(path, ["parallel.mode=dp", "optim.lr=0.2"], ["devices.ids"])
    info, problem = plan_or_problem(loaded, env={}, inventory=NO_GPU, shown="s.toml")
    assert problem is not None and info["try"] is not None
    words = shlex.split(info["try"])
    assert words == [
        "runner",
        "plan",
        "s.toml",
        "--set",
        "optim.lr=0.2",
        "--set",
        "parallel.mode=none",
        "--set",
        "devices.accelerator=cpu",
    ]  # fmt: skip  (the spec never wrote devices.ids, so its --unset changed nothing and is dropped)
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    fixed = load_spec(path, sets, ["devices.ids"])
    assert resolve_devices(fixed.spec, {}, NO_GPU).accelerator == "cpu" and fixed.spec.optim.lr == 0.2


# ----------------------------------------------------------------------------- inactive keys


def test_ddp_options_are_inactive_under_none_shown_by_plan_and_not_logged(capsys) -> None:
    loaded = load_spec(DDP_SPEC, mode("none"))
    assert loaded.spec.parallel.nproc_per_node == 2  # kept as written, inert
    shown = set_inactive_keys(loaded.spec)
    assert shown == {k: 'ddp and fsdp only (mode = "none")' for k in ("parallel.nproc_per_node", "parallel.timeout_s")}
    params = spec_params(loaded.spec)
    assert [k for k in params if k.startswith("parallel.")] == ["parallel.mode"]
    assert main(["plan", str(DDP_SPEC), "--set", 'parallel.mode="none"']) == 0
    out = capsys.readouterr().out
    assert 'inactive       parallel.nproc_per_node, parallel.timeout_s: ddp and fsdp only (mode = "none")' in out
    assert "world size     1 (1 node(s) x 1 process(es))" in out


def test_params_are_the_keys_that_apply_the_same_way_in_every_mode() -> None:
    keys = {}
    for m in ("none", "ddp"):
        keys[m] = set(spec_params(load_spec(DDP_SPEC, mode(m)).spec))
    assert keys["ddp"] - keys["none"] == {"parallel.backend", "parallel.nproc_per_node", "parallel.timeout_s"} | {
        "parallel.hang_grace_s"
    } | {f"parallel.{k}" for k in ("nnodes", "node_rank", "rdzv_id", "max_restarts", "find_unused_parameters")} | {
        f"parallel.{k}" for k in ("static_graph", "gradient_as_bucket_view", "sync_batchnorm")
    }
    assert keys["none"] <= keys["ddp"]
    digits = set(spec_params(load_spec(REPO / "experiments" / "digits_mlp.toml").spec))
    assert not {"data.num_samples", "data.input_shape", "data.num_classes", "data.download"} & digits  # synthetic's
    assert not [k for k in digits if k.startswith("parallel.") and k != "parallel.mode"]


def test_inactive_keys_say_why() -> None:
    spec = spec_from_dict(
        {
            "name": "t",
            "model": {"name": "mlp"},
            "data": {"dataset": "sklearn.digits", "batch_size": 8, "val_fraction": 0.0},
            "devices": {"accelerator": "cpu", "ids": [0]},
            "parallel": {"mode": "ddp", "dim": 1},
            "optim": {"name": "adam", "lr": 0.1},
        }
    )
    found = inactive_keys(spec)
    assert found["parallel.dim"] == 'dp only (mode = "ddp")' and "parallel.backend" not in found
    assert found["devices.ids"] == 'GPU ids (accelerator = "cpu")'
    assert found["data.num_samples"] == 'synthetic only (dataset = "sklearn.digits")'
    assert found["data.split_seed"] == "no split (val_fraction = 0)"
    assert found["optim.momentum"] == 'sgd and rmsprop only (optim.name = "adam")'
    assert set(set_inactive_keys(spec)) == {"parallel.dim", "devices.ids"}  # what the spec writes
    assert "parallel.dim" not in active_params(spec) and "devices.ids" not in active_params(spec)


def test_the_resolved_spec_keeps_what_was_written_and_leaves_inactive_defaults_out() -> None:
    loaded = load_spec(DDP_SPEC, mode("none"))
    text = dump_spec(loaded.spec)
    assert "timeout_s = 120.0" in text and "nproc_per_node = 2" in text  # written, so kept
    assert "rdzv_id" not in text and "static_graph" not in text  # inactive defaults
    assert "split_seed = 0" in text


def test_unknown_keys_are_still_errors_under_any_mode() -> None:
    with pytest.raises(SpecError) as info:
        load_spec(DDP_SPEC, [*mode("none"), "parallel.backnd=gloo"])
    (issue,) = info.value.issues
    assert issue.key == "parallel.backnd" and 'did you mean "backend"?' in issue.message


def test_rules_between_ddp_options_apply_under_ddp_only() -> None:
    base = {
        "name": "t",
        "model": {"name": "mlp"},
        "data": {"dataset": "synthetic", "batch_size": 8},
        "optim": {"lr": 0.1},
        "devices": {"accelerator": "cpu"},
    }
    inert = {"nnodes": 2, "node_rank": 3, "backend": "nccl", "sync_batchnorm": True}
    spec = spec_from_dict({**base, "parallel": {"mode": "none", **inert}})
    assert resolve_devices(spec, {}, NO_GPU).world_size == 1
    with pytest.raises(SpecError) as info:
        spec_from_dict({**base, "parallel": {"mode": "ddp", **inert}})
    assert [i.key for i in info.value.issues] == ["parallel.node_rank"]
    with pytest.raises(SpecError) as info:
        spec_from_dict({**base, "parallel": {"mode": "ddp", "backend": "nccl", "sync_batchnorm": True}})
    assert [i.key for i in info.value.issues] == ["parallel.backend", "parallel.sync_batchnorm"]
    with pytest.raises(SpecError, match="must be host:port"):  # the form of a value is checked in every mode
        spec_from_dict({**base, "parallel": {"mode": "none", "rdzv_endpoint": "nohost"}})


def test_auto_finding_no_gpu_leaves_inactive_cuda_options_alone() -> None:
    spec = spec_from_dict(
        {
            "name": "t",
            "model": {"name": "mlp"},
            "data": {"dataset": "synthetic", "batch_size": 8},
            "optim": {"lr": 0.1},
            "parallel": {"mode": "none", "backend": "nccl", "sync_batchnorm": True},
        }
    )
    assert resolve_devices(spec, {}, NO_GPU).accelerator == "cpu"
    ddp = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"mode": "ddp"})})
    with pytest.raises(DeviceError) as info:
        resolve_devices(ddp, {}, NO_GPU)
    assert info.value.key == "parallel.backend"


# ----------------------------------------------------------------------------- values that cannot apply


def test_mode_none_with_two_ids_runs_on_the_first_and_says_so() -> None:
    spec = spec_from_dict(
        {
            "name": "t",
            "model": {"name": "mlp"},
            "data": {"dataset": "synthetic", "batch_size": 8},
            "optim": {"lr": 0.1},
            "devices": {"accelerator": "cuda", "ids": [1, 0]},
        }
    )
    plan = resolve_devices(spec, {}, gpus(2))
    assert plan.requested_ids == [1] and plan.names == ["Fake GPU 1"]
    assert 'devices.ids = [1, 0]: mode = "none" runs on one device, the first: 1' in plan.notes


def test_plan_and_exec_print_the_note_of_what_runs_instead(write_spec, store, capsys) -> None:
    spec = write_spec()
    assert main(["plan", str(spec), "--set", "devices.ids=[0, 1]"]) == 0
    out = capsys.readouterr().out
    assert "note           devices.ids = [0, 1] is ignored: the run is on cpu" in out


# ----------------------------------------------------------------------------- --unset


def test_unset_removes_a_key_written_in_a_base_file_so_its_default_applies(tmp_path: Path) -> None:
    digits = REPO / "experiments" / "digits_mlp.toml"  # optim.momentum comes from base/digits.toml
    loaded = load_spec(digits, ["optim.lr=0.05"], ["optim.momentum", "devices.ids"])
    assert loaded.spec.optim.momentum == 0.0 and loaded.spec.devices.ids == "all" and loaded.spec.optim.lr == 0.05
    # devices.ids is written in no file: its --unset changes nothing and is dropped
    assert loaded.command_line() == ["--unset", "optim.momentum", "--set", "optim.lr=0.05"]
    assert load_spec(digits, [], ["train.clip_grad_norm"]).spec == load_spec(digits).spec  # not written: a no-op


def test_unset_comes_before_set() -> None:
    loaded = load_spec(DDP_SPEC, ["parallel.timeout_s=30"], ["parallel.timeout_s"])
    assert loaded.spec.parallel.timeout_s == 30.0


def test_unset_of_an_unknown_key_exits_2_with_did_you_mean(capsys) -> None:
    assert main(["plan", str(DDP_SPEC), "--unset", "parallel.timeuot_s"]) == 2
    err = capsys.readouterr().err
    assert "--unset: parallel.timeuot_s: unknown key" in err and "did you mean parallel.timeout_s?" in err
    assert "Traceback" not in err
    assert main(["exec", str(DDP_SPEC), "--unset", "not a key"]) == 2
    assert "expected a dotted key" in capsys.readouterr().err


def test_gpu_only_keys_are_no_params_of_a_run_on_cpu_whatever_chose_it() -> None:
    from tests.helpers import spec_object

    auto = spec_object(devices={"accelerator": "auto", "ids": [0]}, parallel={"mode": "ddp", "nproc_per_node": 2})
    gpu_only = {"devices.ids", "parallel.sync_batchnorm"}
    assert gpu_only <= set(spec_params(auto)) and gpu_only <= set(spec_params(auto, "cuda"))  # may run on GPUs
    assert not gpu_only & set(spec_params(auto, "cpu"))  # "auto" chose the CPU
    cpu = spec_object(devices={"accelerator": "cpu"}, parallel={"mode": "ddp", "nproc_per_node": 2})
    assert "parallel.sync_batchnorm" not in spec_params(cpu) and "parallel.backend" in spec_params(cpu)


@pytest.mark.integration  # starts several processes: the driver's training child
@pytest.mark.created_store
def test_exec_of_a_sweep_spec_notes_that_sweep_is_ignored_and_logs_only_what_applies(
    write_spec, store, monkeypatch, capsys
) -> None:
    from mlflow.tracking import MlflowClient

    from tests.helpers import spec_text

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # accelerator = "auto" chooses the CPU
    text = spec_text(tracking={"uri": store, "experiment": "tests"}, devices={"accelerator": "auto", "ids": [0]})
    spec = write_spec('[sweep]\nparams = { "optim.lr" = { values = [0.1, 0.2] } }\n', text=text)
    assert main(["exec", str(spec)]) == 0
    err = capsys.readouterr().err
    assert f"note: [sweep] is ignored by runner exec; run `runner sweep {spec}` for the study" in err
    assert "devices.ids = [0] is ignored: the run is on cpu" in err
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    params = run.data.params
    assert not [k for k in params if k.startswith(("sweep.", "devices.ids"))]
    assert "optim.lr" in params and "devices.accelerator" in params
    assert run.data.tags["runner.notes"].startswith("devices.ids = [0] is ignored: the run is on cpu; [sweep] is")
    assert "- [sweep] is ignored by runner exec" in run.data.tags["mlflow.note.content"]  # whole, on the run's page
    other = write_spec('[sweep]\nparams = { "optim.lr" = { values = [0.5] } }\n', text=text, name="other.toml")
    capsys.readouterr()
    assert main(["diff", run.info.run_id, str(other), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"] == {}  # diff compares what the params hold


def test_plan_of_a_sweep_spec_shows_its_trials_without_the_note_that_exec_ignores_sweep(capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["plan", str(REPO / "experiments" / "sweep_lr.toml")]) == 0
    out = capsys.readouterr().out
    assert "trials         6 (runner sweep)" in out
    assert "[sweep]" not in out and "sweep:" not in out


def test_image_keys_with_a_data_factory_and_best_checkpoint_keys_without_a_monitor_are_not_logged() -> None:
    base = {"name": "t", "model": {"name": "mlp"}, "optim": {"lr": 0.1}}
    data = {"dataset": "mine:data", "batch_size": 8, "image_size": 32, "num_channels": 3}
    spec = spec_from_dict({**base, "data": data, "checkpoint": {"keep_best": 3}})
    found = inactive_keys(spec)
    assert found["data.image_size"] == 'image datasets only (dataset = "mine:data")'
    assert found["checkpoint.keep_best"] == "checkpoint.monitor only (unset)"
    params = active_params(spec)
    assert not {"data.image_size", "data.num_channels", "checkpoint.keep_best", "checkpoint.goal"} & set(params)
    digits = spec_from_dict(
        {**base, "data": {**data, "dataset": "sklearn.digits"}, "checkpoint": {"monitor": "val/loss"}}
    )
    assert {"data.image_size", "checkpoint.keep_best"} <= set(active_params(digits))


def test_a_data_factorys_split_keys_wait_for_the_data_and_other_datasets_log_them_at_once() -> None:
    base = {"name": "t", "model": {"name": "mlp"}, "optim": {"lr": 0.1}}
    factory = spec_from_dict({**base, "data": {"dataset": "mine:data", "batch_size": 8, "test_fraction": 0.1}})
    split = {"data.val_fraction", "data.test_fraction", "data.split_seed"}
    assert not split & set(spec_params(factory))  # a new run's params: the factory may return its own sets
    assert set(spec_params(factory, split=True)) == split  # logged once its one set was split
    digits = spec_from_dict({**base, "data": {"dataset": "sklearn.digits", "batch_size": 8, "test_fraction": 0.1}})
    assert split <= set(spec_params(digits))
