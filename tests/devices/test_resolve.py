"""Tests for runner.devices.resolve: probing, resolution over fake inventories, narrowing the environment."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from runner.devices.inventory import GpuInfo, Inventory, probe_inventory
from runner.devices.resolve import (
    DevicePlan,
    apply_device_env,
    apply_threads,
    chunk_sizes,
    resolve_devices,
    threads_per_process,
)
from runner.errors import DeviceError
from runner.spec.schema import ExperimentSpec
from tests.helpers import SMALL, spec_dict, spec_object

UUIDS = [f"GPU-{i}aaa1111-2222-3333-4444-55556666777{i}" for i in range(4)]


class FakeNvml:
    """A stand-in for the ``pynvml`` module over ``(name, uuid, MiB, PCI bus id)`` devices, in NVML's order."""

    class NVMLError(Exception):
        pass

    def __init__(self, devices: list[tuple[str, str, int | None, str]], fail: str | None = None) -> None:
        self.devices = devices
        self.fail = fail
        self.shut_down = False

    def nvmlInit(self) -> None:
        if self.fail:
            raise self.NVMLError(self.fail)

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple[str, str, int | None, str]:
        return self.devices[i]

    def nvmlDeviceGetName(self, handle) -> bytes:
        return handle[0].encode()  # older pynvml releases return bytes

    def nvmlDeviceGetUUID(self, handle) -> str:
        return handle[1]

    def nvmlDeviceGetMemoryInfo(self, handle) -> types.SimpleNamespace:
        if handle[2] is None:
            raise self.NVMLError("Not Supported")
        return types.SimpleNamespace(total=handle[2] * 2**20)

    def nvmlDeviceGetPciInfo(self, handle) -> types.SimpleNamespace:
        return types.SimpleNamespace(busId=handle[3])


def four_a100s() -> FakeNvml:
    """Four A100s (80 GiB), enumerated by NVML in PCI bus order."""
    return FakeNvml([("NVIDIA A100-SXM4-80GB", UUIDS[i], 81920, f"00000000:{16 * (i + 1):02X}:00.0") for i in range(4)])


def make_spec(mode: str = "none", accelerator: str = "auto", ids="all", batch: int = 8, **sections) -> ExperimentSpec:
    """A minimal valid spec; ``sections`` update whole tables (``parallel={...}``, ``train={...}``)."""
    raw = spec_dict(
        SMALL, data={"batch_size": batch}, devices={"accelerator": accelerator, "ids": ids}, parallel={"mode": mode}
    )
    return spec_object(raw, **sections)


def fake_inventory(n: int, entries: list[str] | None = None, cuda: bool = True) -> Inventory:
    """``n`` visible A100s; ``entries`` are their inherited CUDA_VISIBLE_DEVICES items."""
    gpus = [
        GpuInfo(
            i,
            f"GPU model {i}",
            UUIDS[i] if i < len(UUIDS) else None,
            80 * 2**30,
            entries[i] if entries else None,
            int(entries[i]) if entries and entries[i].isdigit() else (None if entries else i),
        )
        for i in range(n)
    ]
    return Inventory(gpus, cuda and n > 0, "fake", [])


# --------------------------------------------------------------------------- probe


@pytest.mark.parametrize(
    ("visible", "expect_entries", "expect_physical"),
    [
        (None, ["0", "1", "2", "3"], [0, 1, 2, 3]),
        ("2,0", ["2", "0"], [2, 0]),
        ("", [], []),
        ("-1", [], []),
        ("1,-1,2", ["1"], [1]),
        ("1,7,2", ["1"], [1]),
        ("1,1", [], []),
        (f"{UUIDS[3]},{UUIDS[1][:12]}", [UUIDS[3], UUIDS[1][:12]], [3, 1]),
    ],
)
def test_probe_maps_inherited_visible_devices(visible, expect_entries, expect_physical):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    inv = probe_inventory(env, nvml=four_a100s())
    assert [g.visible_entry for g in inv.gpus] == expect_entries
    assert [g.physical_index for g in inv.gpus] == expect_physical
    assert [g.index for g in inv.gpus] == list(range(len(expect_entries)))
    if expect_entries:
        assert inv.gpus[0].name == "NVIDIA A100-SXM4-80GB"
        assert inv.gpus[0].total_memory_bytes == 81920 * 2**20
        assert inv.gpus[0].uuid == UUIDS[expect_physical[0]]


def test_probe_notes_ignored_entries_and_duplicates():
    assert any("'7'" in n for n in probe_inventory({"CUDA_VISIBLE_DEVICES": "1,7"}, nvml=four_a100s()).notes)
    assert any("twice" in n for n in probe_inventory({"CUDA_VISIBLE_DEVICES": "1,1"}, nvml=four_a100s()).notes)
    ambiguous = probe_inventory({"CUDA_VISIBLE_DEVICES": "GPU-"}, nvml=four_a100s())
    assert ambiguous.gpus == [] and any("several" in n for n in ambiguous.notes)


def test_probe_without_nvml_reports_no_gpu():
    inv = probe_inventory({"CUDA_VISIBLE_DEVICES": "0"}, nvml=FakeNvml([], fail="Driver Not Loaded"))
    assert inv.gpus == [] and not inv.cuda_available and "NVML" in inv.source and "Driver Not Loaded" in inv.source


def test_probe_lists_gpus_in_pci_bus_order_and_shuts_nvml_down():
    nvml = FakeNvml([("B", UUIDS[1], 1024, "00000000:B1:00.0"), ("A", UUIDS[0], None, "00000000:3B:00.0")])
    inv = probe_inventory({}, nvml=nvml)
    assert [(g.name, g.physical_index, g.uuid) for g in inv.gpus] == [("A", 0, UUIDS[0]), ("B", 1, UUIDS[1])]
    assert inv.gpus[0].total_memory_bytes is None and inv.gpus[1].total_memory_bytes == 2**30
    assert nvml.shut_down and inv.source == "NVML (2 GPU(s) on the machine)"


def test_inventory_reads_no_nvidia_smi_output():
    text = (Path(__file__).parents[2] / "runner" / "devices" / "inventory.py").read_text()
    assert "nvidia-smi --query" not in text and "subprocess" not in text


def test_probe_with_units_and_order_note():
    nvml = FakeNvml([("Tesla T4", "GPU-abc", 15360, "00000000:00:04.0")])
    inv = probe_inventory({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, nvml=nvml)
    assert inv.gpus[0].total_memory_bytes == 15360 * 2**20
    assert any("FASTEST_FIRST" in n for n in inv.notes)


def test_probe_does_not_initialise_cuda_or_touch_env(monkeypatch):
    import torch

    env = {"CUDA_VISIBLE_DEVICES": "1"}
    probe_inventory(env, nvml=four_a100s())
    assert env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert not torch.cuda.is_initialized()


def test_probe_real_machine_runs():
    inv = probe_inventory()  # NVML or not: must not raise
    assert isinstance(inv, Inventory)


# --------------------------------------------------------------------------- accelerator


def test_auto_picks_cpu_without_gpu():
    plan = resolve_devices(make_spec(), {}, fake_inventory(0))
    assert plan.accelerator == "cpu" and plan.requested_ids == [] and plan.env == {}
    assert plan.per_device_batch == [8] and plan.world_size == 1 and plan.backend is None


def test_auto_picks_cuda_with_gpu():
    plan = resolve_devices(make_spec(), {}, fake_inventory(4))
    assert plan.accelerator == "cuda"
    assert plan.requested_ids == [0] and plan.selected == ["0"]
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert any("only device 0" in n for n in plan.notes)


def test_auto_without_cuda_build_uses_cpu_with_note():
    plan = resolve_devices(make_spec(), {}, fake_inventory(2, cuda=False))
    assert plan.accelerator == "cpu" and any("without CUDA" in n for n in plan.notes)


def test_cuda_without_gpu_is_an_error_not_a_fallback():
    with pytest.raises(DeviceError) as err:
        resolve_devices(make_spec(accelerator="cuda"), {"CUDA_VISIBLE_DEVICES": ""}, fake_inventory(0))
    msg = str(err.value)
    assert 'accelerator = "cuda" but' in msg and "no GPU is visible" in msg and "CUDA_VISIBLE_DEVICES=''" in msg


def test_cuda_with_cpu_only_torch_is_an_error():
    with pytest.raises(DeviceError, match="without CUDA"):
        resolve_devices(make_spec(accelerator="cuda"), {}, fake_inventory(1, cuda=False))


def test_cpu_on_gpu_machine_hides_gpus():
    plan = resolve_devices(make_spec(accelerator="cpu"), {}, fake_inventory(4))
    assert plan.accelerator == "cpu" and plan.env == {"CUDA_VISIBLE_DEVICES": ""}


def test_user_device_order_is_kept():
    plan = resolve_devices(make_spec(), {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, fake_inventory(1))
    assert plan.env["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


@pytest.mark.parametrize(
    ("spec_kwargs", "match"),
    [
        ({"mode": "ddp", "parallel": {"backend": "nccl"}}, "nccl"),
        ({"mode": "ddp", "parallel": {"sync_batchnorm": True}}, "sync_batchnorm"),
        ({"train": {"amp": "fp16"}}, "fp16"),
    ],
)
def test_cuda_only_options_fail_when_auto_resolves_to_cpu(spec_kwargs, match):
    with pytest.raises(DeviceError, match=match):
        resolve_devices(make_spec(**spec_kwargs), {}, fake_inventory(0))


# --------------------------------------------------------------------------- ids


def test_ids_out_of_range_lists_both_numberings():
    inv = fake_inventory(2, entries=["5", "7"])
    with pytest.raises(DeviceError) as err:
        resolve_devices(make_spec(mode="dp", ids=[0, 2]), {"CUDA_VISIBLE_DEVICES": "5,7"}, inv)
    msg = str(err.value)
    assert "[0, 2]" in msg and "asks for [2]" in msg and "only 2 GPU(s)" in msg
    assert "CUDA_VISIBLE_DEVICES='5,7'" in msg
    assert "0 -> GPU model 0 (CUDA_VISIBLE_DEVICES entry 5)" in msg
    assert "1 -> GPU model 1 (CUDA_VISIBLE_DEVICES entry 7)" in msg


def test_ids_index_the_inherited_visible_set():
    inv = fake_inventory(3, entries=["4", "6", "7"])
    plan = resolve_devices(make_spec(mode="dp", ids=[2, 0]), {"CUDA_VISIBLE_DEVICES": "4,6,7"}, inv)
    assert plan.requested_ids == [2, 0]
    assert plan.visible == ["4", "6", "7"]
    assert plan.selected == ["7", "4"]
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "7,4"
    assert plan.names == ["GPU model 2", "GPU model 0"]
    assert plan.physical_indices == [7, 4]


def test_uuid_entries_stay_uuids():
    inv = fake_inventory(2, entries=[UUIDS[3], UUIDS[1]])
    plan = resolve_devices(
        make_spec(mode="dp", ids="all"), {"CUDA_VISIBLE_DEVICES": ",".join(UUIDS[i] for i in (3, 1))}, inv
    )
    assert plan.selected == [UUIDS[3], UUIDS[1]]
    assert plan.env["CUDA_VISIBLE_DEVICES"] == f"{UUIDS[3]},{UUIDS[1]}"
    assert plan.uuids == [UUIDS[0], UUIDS[1]]  # fake inventory's own uuid column


def test_uuid_entries_end_to_end_from_probe():
    env = {"CUDA_VISIBLE_DEVICES": f"{UUIDS[2]},{UUIDS[0]}"}
    inv = probe_inventory(env, nvml=four_a100s())
    plan = resolve_devices(make_spec(ids=[1]), env, inv)
    assert plan.selected == [UUIDS[0]] and plan.uuids == [UUIDS[0]] and plan.physical_indices == [0]
    described = plan.describe()
    assert described["devices"][0] == {
        "id": 1,
        "cuda_index": 0,
        "entry": UUIDS[0],
        "physical_index": 0,
        "name": "NVIDIA A100-SXM4-80GB",
        "uuid": UUIDS[0],
        "total_memory_bytes": 81920 * 2**20,
    }


def test_all_means_every_visible_gpu():
    plan = resolve_devices(make_spec(mode="dp"), {}, fake_inventory(4))
    assert plan.requested_ids == [0, 1, 2, 3] and plan.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_one_gpu_machine():
    plan = resolve_devices(make_spec(mode="none", ids=[0]), {}, fake_inventory(1))
    assert plan.accelerator == "cuda" and plan.selected == ["0"] and plan.notes == []
    with pytest.raises(DeviceError, match="only 1 GPU"):
        resolve_devices(make_spec(mode="none", ids=[1]), {}, fake_inventory(1))


# --------------------------------------------------------------------------- dp


def test_dp_without_gpu_suggests_none_or_ddp():
    with pytest.raises(DeviceError) as err:
        resolve_devices(make_spec(mode="dp"), {}, fake_inventory(0))
    assert '"none"' in str(err.value) and '"ddp"' in str(err.value) and "gloo" in str(err.value)


def test_dp_with_one_gpu_notes_unwrapped():
    plan = resolve_devices(make_spec(mode="dp"), {}, fake_inventory(1))
    assert plan.per_device_batch == [8]
    assert any("runs unwrapped" in n for n in plan.notes)


@pytest.mark.parametrize(
    ("batch", "n", "expect"),
    [(10, 4, [3, 3, 3, 1]), (8, 4, [2, 2, 2, 2]), (9, 4, [3, 3, 3, 0]), (2, 4, [1, 1, 0, 0]), (7, 2, [4, 3])],
)
def test_dp_split_follows_torch_chunk(batch, n, expect):
    import torch

    assert chunk_sizes(batch, n) == expect
    chunks = [c.shape[0] for c in torch.arange(batch).chunk(n)]
    assert chunks + [0] * (n - len(chunks)) == expect
    plan = resolve_devices(make_spec(mode="dp", batch=batch), {}, fake_inventory(n))
    assert plan.per_device_batch == expect and plan.world_size == 1
    assert (0 in expect) == any("idle" in note for note in plan.notes)


def test_dp_split_uses_micro_batch_with_accumulation():
    plan = resolve_devices(make_spec(mode="dp", batch=16, train={"grad_accum_steps": 2}), {}, fake_inventory(3))
    assert plan.per_device_batch == [3, 3, 2]


def test_dp_output_device_position():
    spec = make_spec(mode="dp", ids=[3, 1], parallel={"output_device": 1})
    assert resolve_devices(spec, {}, fake_inventory(4)).output_index == 1
    with pytest.raises(DeviceError, match="output_device = 3"):
        resolve_devices(make_spec(mode="dp", parallel={"output_device": 3}), {}, fake_inventory(2))


# --------------------------------------------------------------------------- ddp


def test_ddp_cuda_defaults():
    plan = resolve_devices(make_spec(mode="ddp", ids=[1, 3]), {}, fake_inventory(4))
    assert (plan.nproc_per_node, plan.nnodes, plan.world_size, plan.backend) == (2, 1, 2, "nccl")
    assert plan.per_device_batch == [4, 4]
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_ddp_cpu_defaults():
    plan = resolve_devices(make_spec(mode="ddp"), {}, fake_inventory(0))
    assert (plan.nproc_per_node, plan.world_size, plan.backend, plan.env) == (1, 1, "gloo", {})
    plan = resolve_devices(
        make_spec(mode="ddp", accelerator="cpu", parallel={"nproc_per_node": 2}), {}, fake_inventory(2)
    )
    assert (plan.world_size, plan.backend, plan.per_device_batch) == (2, "gloo", [4, 4])
    assert plan.env == {"CUDA_VISIBLE_DEVICES": ""}


def test_ddp_multi_node_world_size():
    spec = make_spec(mode="ddp", ids=[0, 1], batch=16, parallel={"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29500"})
    plan = resolve_devices(spec, {}, fake_inventory(2))
    assert (plan.world_size, plan.per_device_batch) == (4, [4, 4])


def test_ddp_gloo_on_cuda_allowed():
    plan = resolve_devices(make_spec(mode="ddp", parallel={"backend": "gloo"}), {}, fake_inventory(2))
    assert plan.backend == "gloo" and plan.accelerator == "cuda"


def test_ddp_nproc_must_match_gpus_when_ids_all():
    with pytest.raises(DeviceError, match="nproc_per_node = 3 but 2 GPU"):
        resolve_devices(make_spec(mode="ddp", parallel={"nproc_per_node": 3}, batch=6), {}, fake_inventory(2))


def test_ddp_batch_must_divide_world_times_accum():
    with pytest.raises(DeviceError) as err:
        resolve_devices(make_spec(mode="ddp", batch=12, train={"grad_accum_steps": 2}), {}, fake_inventory(4))
    msg = str(err.value)
    assert "batch_size = 12" in msg and "world size 4" in msg and "grad_accum_steps 2" in msg and "= 8" in msg


# --------------------------------------------------------------------------- describe / apply


def test_describe_is_json_able():
    plan = resolve_devices(make_spec(mode="dp", batch=10), {}, fake_inventory(4))
    described = json.loads(json.dumps(plan.describe()))
    assert [d["id"] for d in described["devices"]] == [0, 1, 2, 3]
    assert [d["cuda_index"] for d in described["devices"]] == [0, 1, 2, 3]
    assert described["per_device_batch"] == [3, 3, 3, 1]
    assert described["world_size"] == 1 and described["mode"] == "dp"


def _plan(env: dict[str, str]) -> DevicePlan:
    return DevicePlan("cuda", "none", [1], ["0", "1"], ["1"], ["x"], [None], 1, 1, 1, None, 8, [8], env)


def test_apply_sets_environment():
    environ = {"CUDA_VISIBLE_DEVICES": "0,1", "OTHER": "x"}
    apply_device_env(_plan({"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}), environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "OTHER": "x"}


def test_apply_refuses_after_cuda_init(monkeypatch):
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    environ = {"CUDA_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(DeviceError, match="already initialised"):
        apply_device_env(_plan({"CUDA_VISIBLE_DEVICES": "1"}), environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "0,1"}
    apply_device_env(_plan({"CUDA_VISIBLE_DEVICES": "0,1"}), environ)  # no change: fine


def test_resolving_and_applying_never_import_torch():
    code = (
        "import sys\n"
        "from runner.devices import inventory as device_env, inventory, resolve as devices\n"
        "inv = inventory.Inventory([inventory.GpuInfo(0, 'x')], True)\n"
        "assert device_env.cuda_initialized() is False\n"
        "env = {}\n"
        "plan = devices.DevicePlan('cuda', 'none', [0], ['0'], ['0'], ['x'], [None], 1, 1, 1, None, 1, [1],\n"
        "                          {'CUDA_VISIBLE_DEVICES': '0'})\n"
        "devices.apply_device_env(plan, env)\n"
        "assert env == {'CUDA_VISIBLE_DEVICES': '0'}\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- threads


@pytest.mark.parametrize(
    ("requested", "env", "cores", "processes", "expect"),
    [
        (0, {}, 8, 1, (8, "8 usable cores / 1 training processes")),  # none and dp: every usable core
        (0, {}, 8, 3, (2, "8 usable cores / 3 training processes")),  # ddp: shared out, rounded down
        (0, {}, 2, 4, (1, "2 usable cores / 4 training processes")),  # never below one
        (0, {"OMP_NUM_THREADS": "3"}, 8, 2, (3, "OMP_NUM_THREADS")),  # the user's variable overrides
        (0, {"OMP_NUM_THREADS": "x"}, 4, 1, (4, "4 usable cores / 1 training processes")),  # not a count: the rule
        (5, {"OMP_NUM_THREADS": "3"}, 8, 2, (5, "devices.threads_per_process")),  # the spec key wins
        (0, {"SLURM_CPUS_PER_TASK": "4"}, 64, 2, (2, "4 usable cores / 2 training processes")),  # Slurm's share
    ],
)
def test_threads_per_process_rule(requested, env, cores, processes, expect):
    assert threads_per_process(requested, env, cores, processes) == expect


@pytest.mark.parametrize(("mode", "nproc"), [("none", 1), ("ddp", 2)])
def test_plan_gives_every_mode_the_same_thread_rule(mode, nproc):
    parallel = {"mode": mode, "nproc_per_node": nproc} if mode == "ddp" else {"mode": mode}
    spec = spec_object(devices={"accelerator": "cpu"}, parallel=parallel)
    plan = resolve_devices(spec, {}, Inventory(cores=4))
    assert plan.threads_per_process == 4 // nproc
    assert plan.describe()["threads_per_process"] == 4 // nproc
    pinned = resolve_devices(
        spec_object(devices={"accelerator": "cpu", "threads_per_process": 3}), {}, Inventory(cores=4)
    )
    assert pinned.threads_per_process == 3 and pinned.threads_from == "devices.threads_per_process"


def test_apply_threads_sets_torch_threads():
    import torch

    before = torch.get_num_threads()
    plan = replace(_plan({}), threads_per_process=1 if before != 1 else 2)
    try:
        apply_threads(plan)
        assert torch.get_num_threads() == plan.threads_per_process
    finally:
        torch.set_num_threads(before)
