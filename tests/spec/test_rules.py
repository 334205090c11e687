"""Each rule between keys is checked in one place with one wording: the schema when the spec decides, else devices."""

from __future__ import annotations

import pytest
import tomli_w

from runner.cli import main
from runner.devices.inventory import GpuInfo, Inventory
from runner.devices.resolve import resolve_devices
from runner.errors import DeviceError, SpecError
from runner.spec import rules
from runner.spec.loading import spec_from_dict
from runner.spec.schema import ExperimentSpec, static_world_size
from runner.spec.schema_parallel import DevicesSpec

NO_GPU = Inventory([], False, "nvidia-smi not found", [])


def gpus(n: int) -> Inventory:
    return Inventory([GpuInfo(i, f"gpu {i}") for i in range(n)], True, "fake", [])


def raw(mode: str = "none", accelerator: str = "auto", batch: int = 8, **tables: dict) -> dict:
    spec = {
        "name": "t",
        "model": {"name": "mlp"},
        "data": {"dataset": "synthetic", "batch_size": batch},
        "optim": {"lr": 0.1},
        "devices": {"accelerator": accelerator},
        "parallel": {"mode": mode},
    }
    for key, table in tables.items():
        spec[key] = {**spec.get(key, {}), **table}
    return spec


def issues(data: dict) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        spec_from_dict(data)
    return [(i.key, i.message) for i in info.value.issues]


def device_error(spec: ExperimentSpec, inventory: Inventory) -> DeviceError:
    with pytest.raises(DeviceError) as info:
        resolve_devices(spec, {}, inventory)
    return info.value


def on_cpu(spec: ExperimentSpec) -> ExperimentSpec:
    """The same spec with ``accelerator = "cpu"``, bypassing validation (what the schema would reject)."""
    return spec.model_copy(update={"devices": DevicesSpec(accelerator="cpu")})


# ----------------------------------------------------------------------------- dp needs CUDA


def test_dp_on_cpu_is_one_issue_from_the_schema():
    [(key, message)] = issues(raw("dp", "cpu"))
    assert key == "parallel.mode"
    assert (
        message
        == 'mode = "dp" needs CUDA GPUs but accelerator = "cpu": use mode = "none", or "ddp" (backend gloo runs on CPU)'
    )


def test_dp_when_auto_finds_no_gpu_is_one_device_error():
    spec = spec_from_dict(raw("dp"))  # the schema cannot know: auto may find a GPU
    error = device_error(spec, NO_GPU)
    assert error.key == "parallel.mode"
    assert error.message.startswith('mode = "dp" needs CUDA GPUs but accelerator = "auto" chose cpu since no GPU')
    assert error.message.endswith(': use mode = "none", or "ddp" (backend gloo runs on CPU)')
    assert resolve_devices(spec, {}, gpus(2)).accelerator == "cuda"


def test_devices_leave_the_static_dp_rule_to_the_schema():
    plan = resolve_devices(on_cpu(spec_from_dict(raw("dp"))), {}, NO_GPU)
    assert plan.accelerator == "cpu"  # not checked a second time here


# ----------------------------------------------------------------------------- nccl needs CUDA


def test_nccl_on_cpu_is_one_issue_from_the_schema():
    found = issues(raw("ddp", "cpu", parallel={"backend": "nccl"}))
    assert found == [
        ("parallel.backend", 'backend = "nccl" needs CUDA but accelerator = "cpu": use backend = "gloo" (or "auto")')
    ]


def test_nccl_when_auto_finds_no_gpu_is_one_device_error():
    spec = spec_from_dict(raw("ddp", parallel={"backend": "nccl"}))
    error = device_error(spec, NO_GPU)
    assert error.key == "parallel.backend"
    assert error.message.startswith('backend = "nccl" needs CUDA but accelerator = "auto" chose cpu since')
    assert resolve_devices(on_cpu(spec), {}, NO_GPU).backend == "nccl"  # the schema's to refuse


@pytest.mark.parametrize(
    ("tables", "key", "stem"),
    [
        ({"parallel": {"mode": "ddp", "sync_batchnorm": True}}, "parallel.sync_batchnorm", "sync_batchnorm needs CUDA"),
        ({"train": {"amp": "fp16"}}, "train.amp", 'amp = "fp16" needs CUDA'),
    ],
)
def test_other_cuda_only_settings_follow_the_same_split(tables, key, stem):
    assert [k for k, _ in issues(raw(accelerator="cpu", **tables))] == [key]
    error = device_error(spec_from_dict(raw(**tables)), NO_GPU)
    assert error.key == key and error.message.startswith(stem)


# ----------------------------------------------------------------------------- batch split


def test_batch_rule_wording():
    assert rules.batch_split_problem(12, 4, 3) is None
    assert (
        rules.batch_split_problem(10, 4, 1)
        == "batch_size = 10 is not divisible by world size 4: use a multiple of 4, e.g. 8"
    )
    assert rules.batch_split_problem(12, 4, 2) == (
        "batch_size = 12 is not divisible by world size 4 x grad_accum_steps 2 = 8: use a multiple of 8, e.g. 8"
    )
    assert rules.batch_split_problem(10, 1, 3) == (
        "batch_size = 10 is not divisible by grad_accum_steps 3: use a multiple of 3, e.g. 9"
    )


def test_batch_with_a_static_world_size_is_checked_by_the_schema_only():
    data = raw("ddp", "cpu", batch=10, parallel={"nproc_per_node": 4})
    assert issues(data) == [("data.batch_size", rules.batch_split_problem(10, 4, 1))]
    valid = spec_from_dict(raw("ddp", "cpu", batch=8, parallel={"nproc_per_node": 4}))
    assert static_world_size(valid) == 4


def test_batch_with_a_machine_world_size_is_checked_by_devices_only():
    spec = spec_from_dict(raw("ddp", batch=10))  # ids = "all": the world size is the GPU count
    assert static_world_size(spec) is None
    error = device_error(spec, gpus(4))
    assert (error.key, error.message) == ("data.batch_size", rules.batch_split_problem(10, 4, 1))
    assert resolve_devices(spec, {}, gpus(2)).per_device_batch == [5, 5]


def test_accumulation_is_static_also_when_the_world_size_is_the_machines(capsys, tmp_path):
    data = raw("ddp", batch=10, train={"grad_accum_steps": 4})  # ids = "all": the world size is the GPU count
    assert static_world_size(spec_from_dict(raw("ddp", batch=12, train={"grad_accum_steps": 4}))) is None
    assert issues(data) == [("data.batch_size", rules.batch_split_problem(10, 1, 4))]
    assert rules.batch_split_problem(10, 1, 4) == (
        "batch_size = 10 is not divisible by grad_accum_steps 4: use a multiple of 4, e.g. 8"
    )
    path = tmp_path / "accum.toml"
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    assert main(["validate", str(path)]) == 2  # runner validate reports it, without the machine
    assert f"{path}:" in capsys.readouterr().err


def test_devices_then_check_the_machines_world_size_only_once():
    spec = spec_from_dict(raw("ddp", batch=12, train={"grad_accum_steps": 4}))  # 12 divides by 4
    error = device_error(spec, gpus(2))
    assert (error.key, error.message) == ("data.batch_size", rules.batch_split_problem(12, 2, 4))
    assert resolve_devices(spec, {}, gpus(3)).per_device_batch == [1, 1, 1]


def test_accumulation_under_one_process_is_static():
    assert issues(raw(batch=10, train={"grad_accum_steps": 3})) == [
        ("data.batch_size", rules.batch_split_problem(10, 1, 3))
    ]


# ----------------------------------------------------------------------------- processes per GPU


def test_nproc_against_an_id_list_is_static_and_against_all_is_the_machines():
    data = raw("ddp", "cuda", batch=6, devices={"ids": [0, 1]}, parallel={"nproc_per_node": 3})
    keys = [k for k, _ in issues(data)]
    assert keys[0] == "parallel.nproc_per_node"
    spec = spec_from_dict(raw("ddp", batch=6, parallel={"nproc_per_node": 3}))
    error = device_error(spec, gpus(2))
    assert (error.key, error.message) == ("parallel.nproc_per_node", rules.nproc_mismatch(3, "all", 2))


def test_output_device_against_all_is_the_machines():
    spec = spec_from_dict(raw("dp", parallel={"output_device": 3}))
    error = device_error(spec, gpus(2))
    assert (error.key, error.message) == ("parallel.output_device", rules.output_device_not_chosen(3, [0, 1]))
    static = issues(raw("dp", "cuda", devices={"ids": [0, 1]}, parallel={"output_device": 3}))
    assert static == [("parallel.output_device", rules.output_device_not_chosen(3, [0, 1]))]
