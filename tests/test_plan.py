"""The plan: device errors placed at FILE:LINE: key, the launcher's WORLD_SIZE checked once, the launch method."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.devices.inventory import GpuInfo, Inventory
from runner.errors import DeviceError, UsageError
from runner.plan import launched_externally, make_plan
from runner.spec.loading import key_line, load_spec
from tests.helpers import SMALL, memory_spec, spec_text

NO_GPU = Inventory([], False, "nvidia-smi not found", [])
WORKER = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}


def load(tmp_path: Path, mode: str = "none", extra: str = ""):
    text = spec_text(SMALL, compact=True, parallel={"mode": mode}, tracking={"enabled": False})  # mode at line 8
    path = tmp_path / "spec.toml"
    path.write_text(text + extra, encoding="utf-8")
    return load_spec(path)


def test_device_error_is_placed_at_the_key_line(tmp_path: Path):
    loaded = load(tmp_path, "dp")
    with pytest.raises(DeviceError) as info:
        make_plan(loaded, env={}, inventory=NO_GPU)
    text = str(info.value)
    assert text.startswith(f'{loaded.path}:8: parallel.mode: mode = "dp" needs CUDA GPUs but')
    assert (info.value.file, info.value.line, info.value.key) == (loaded.path, 8, "parallel.mode")


def test_device_error_names_the_accelerator_line_and_defaults_have_none(tmp_path: Path):
    loaded = load(tmp_path, extra='[devices]\naccelerator = "cuda"\n')
    with pytest.raises(DeviceError) as info:
        make_plan(loaded, env={}, inventory=NO_GPU)
    assert str(info.value).startswith(f'{loaded.path}:14: devices.accelerator: accelerator = "cuda" but no GPU')
    assert key_line(loaded, "train.epochs") is None and key_line(loaded, "") is None


def test_device_error_for_a_key_set_by_an_override_names_no_line(tmp_path: Path):
    loaded = load_spec(load(tmp_path).path, ['parallel.mode="dp"'])
    with pytest.raises(DeviceError) as info:
        make_plan(loaded, env={}, inventory=NO_GPU)
    assert str(info.value).startswith(f'{loaded.path}: parallel.mode: mode = "dp" needs CUDA GPUs')
    assert key_line(loaded, "parallel.mode") is None and key_line(loaded, "optim.lr") == 10


def test_launch_method_without_a_launcher(tmp_path: Path):
    assert make_plan(load(tmp_path), env={}, inventory=NO_GPU).launch == "in-process"
    plan = make_plan(load(tmp_path, "ddp"), env={}, inventory=NO_GPU)
    assert plan.launch == "elastic" and not plan.launcher.external


def test_world_size_must_agree_with_the_spec(tmp_path: Path):
    with pytest.raises(UsageError, match=r'WORLD_SIZE=2\) but parallel.mode = "none"'):
        make_plan(load(tmp_path), env=WORKER, inventory=NO_GPU)
    with pytest.raises(UsageError, match="WORLD_SIZE=2 workers but the spec's world size is 1"):
        make_plan(load(tmp_path, "ddp"), env=WORKER, inventory=NO_GPU)
    agreeing = load_spec(load(tmp_path, "ddp").path, ["parallel.nproc_per_node=2"])
    plan = make_plan(agreeing, env={**WORKER, "RANK": "1", "RUNNER_RUN_ID": "abc"}, inventory=NO_GPU)
    assert plan.launch == "external"
    assert (plan.launcher.rank, plan.launcher.world_size, plan.launcher.run_id) == (1, 2, "abc")


def test_launcher_variables_that_are_not_integers_are_a_usage_error(tmp_path: Path):
    with pytest.raises(UsageError, match="WORLD_SIZE='two' is not an integer"):
        make_plan(load(tmp_path), env={**WORKER, "WORLD_SIZE": "two"}, inventory=NO_GPU)


def test_launched_externally_needs_all_three_variables():
    assert launched_externally(WORKER)
    assert not launched_externally({"RANK": "0", "WORLD_SIZE": "2"})


def test_plan_describes_itself(tmp_path: Path):
    info = make_plan(load(tmp_path, "ddp"), env={}, inventory=gpu_free()).describe()
    assert info["launch"] == "elastic" and info["world_size"] == 1 and info["rendezvous"]["backend"] == "c10d"
    assert info["tracking_uri"] is None and info["devices"]["backend"] == "gloo"


def gpu_free() -> Inventory:
    return Inventory([GpuInfo(0, "x")], False, "fake", [])


# ----------------------------------------------------------------------------- memory per device (runner plan)


def _cnn(tmp_path: Path):
    return memory_spec(tmp_path, tracking={"enabled": False})


def test_the_fake_step_estimate_is_within_5_percent_of_a_real_step(tmp_path: Path) -> None:
    from runner.plan_report import fake_step

    loaded = _cnn(tmp_path)
    estimate = fake_step(loaded, 32, count_flops=True)
    real = fake_step(loaded, 32, fake=False, count_flops=True)  # MemTracker on real CPU tensors
    for kind in ("params", "grads", "optimizer", "activations", "peak"):
        assert estimate[kind] == pytest.approx(real[kind], rel=0.05), kind
    assert estimate["optimizer"] == pytest.approx(2 * estimate["params"], rel=0.01)  # Adam: two moments a parameter
    assert estimate["flops"] == real["flops"] > 0  # torch.utils.flop_counter counts the same ops on fake tensors


def test_the_modes_keep_what_each_keeps(tmp_path: Path) -> None:
    from runner.plan_report import estimate_memory

    memory = estimate_memory(_cnn(tmp_path), 4)
    (none,), (dp0, dp_rest), (ddp,), (fsdp,) = (memory["modes"][m] for m in ("none", "dp", "ddp", "fsdp"))
    assert memory["devices"] == 4 and dp_rest["device"] == "1-3"
    assert dp0["activations"] == ddp["activations"] < none["activations"]  # 8 samples a device against 32
    assert dp_rest["optimizer"] == 0 < dp0["optimizer"] and dp0["peak"] > dp_rest["peak"]  # device 0 steps alone
    assert ddp["grads"] > none["grads"] and ddp["peak"] > dp_rest["peak"]  # the gradient buckets
    assert fsdp["optimizer"] == pytest.approx(ddp["optimizer"] / 4, rel=0.02)  # shards (FSDPMemTracker, fake group)
    assert fsdp["peak"] < ddp["peak"] and fsdp["grads"] < ddp["grads"] / 4


def test_the_table_says_what_fits_and_which_switch_would(tmp_path: Path) -> None:
    from runner.plan_report import estimate_memory, format_memory

    loaded = _cnn(tmp_path)
    memory = estimate_memory(loaded, 2)
    peak = memory["modes"]["none"][0]["peak"]
    lines = format_memory(memory, [], loaded.spec)
    assert "no GPU visible here" in lines[-1] and not any("spare" in line for line in lines)
    roomy = "\n".join(format_memory(memory, [("A", 10 * peak), ("B", 20 * peak)], loaded.spec))
    assert "against the smallest visible GPU" in roomy and roomy.count("GiB spare") == 5 and "to fit" not in roomy
    tight = format_memory(memory, [("A", int(peak * 0.9))], loaded.spec)[-1]
    assert tight.strip().startswith("to fit:") and "data.batch_size = " in tight
    assert "train.activation_checkpointing = true" in tight
    assert "not estimated" in format_memory({"error": "ValueError: x"}, [], loaded.spec)[0]


def test_profile_ranks_that_record_nothing_are_noted_and_negative_ones_refused(tmp_path: Path) -> None:
    from runner.errors import SpecError

    loaded = load(tmp_path, "ddp", "\n[profile]\nranks = [0, 7]\n")
    plan = make_plan(loaded, env={}, inventory=NO_GPU)
    assert plan.devices.world_size == 1
    assert "profile.ranks [7] will record nothing: this job has ranks 0 to 0" in plan.notes
    assert not [
        n for n in make_plan(load(tmp_path, "ddp", "\n[profile]\n"), env={}, inventory=NO_GPU).notes if "profile" in n
    ]
    with pytest.raises(SpecError, match=r"profile\.ranks\[0\]: got -1; expected a value >= 0"):
        load(tmp_path, "none", "\n[profile]\nranks = [-1]\n")


def test_a_profile_that_recorded_nothing_says_why(tmp_path: Path) -> None:
    from runner.training.setup import profile_notes

    loaded = load(tmp_path, "none", f"\n[profile]\nwait = {2**63 - 1}\n")
    (note,) = profile_notes(loaded.spec, 0, tmp_path)
    assert note.startswith(f"[profile] recorded nothing on rank 0: the job ended before wait = {2**63 - 1} steps")
    assert profile_notes(loaded.spec, 1, tmp_path) == []  # rank 1 was not asked to record
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank0.trace.json").write_text("{}")
    assert profile_notes(loaded.spec, 0, tmp_path) == []


def test_an_issue_at_a_list_entry_set_by_an_override_names_that_override(tmp_path: Path):
    """data.transforms[0] read as ("data", "transforms[0]") matched no --set: it was placed in the file, no line."""
    from runner.errors import SpecError, SpecIssue
    from runner.spec.loading import relocate_issues

    loaded = load_spec(load(tmp_path).path, ['data.transforms=["RandomFlp"]'])
    issue = SpecIssue(None, None, "data.transforms[0].name", "no such transform")
    (moved,) = relocate_issues(SpecError(issue), loaded).issues
    assert moved.line is None and moved.message == 'no such transform (from --set data.transforms=["RandomFlp"])'
    assert key_line(loaded, "data.transforms[0]") is None and key_line(loaded, "optim.lr") == 10
