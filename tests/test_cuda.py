"""CUDA tests of runner.devices.resolve and runner.strategies; skipped, with the reason, without enough GPUs."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from runner.devices.environment import LauncherEnvironment
from runner.devices.inventory import probe_inventory
from runner.devices.resolve import resolve_devices
from runner.errors import TrainingError
from runner.spec.schema import ExperimentSpec
from runner.strategies import make_strategy
from runner.strategies.base import DataParallelStrategy
from tests.helpers import elastic_run, spec_object

pytestmark = pytest.mark.cuda


def _cuda_gap(min_gpus: int) -> str | None:
    """What is missing for a test that needs ``min_gpus`` GPUs, or ``None`` (never initialises CUDA)."""
    if not torch.backends.cuda.is_built():
        return f"needs CUDA: torch {torch.__version__} is built without it"
    count = torch.cuda.device_count()  # NVML-based before CUDA initialises
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "CUDA_VISIBLE_DEVICES unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
        return f"needs CUDA: no GPU visible ({where})"
    if count < min_gpus:
        return f"needs {min_gpus} GPUs, {count} visible"
    return None


def requires_gpus(min_gpus: int = 1) -> pytest.MarkDecorator:
    """The one skip helper: skip unless ``min_gpus`` CUDA devices are visible, naming what is missing."""
    gap = _cuda_gap(min_gpus)
    return pytest.mark.skipif(gap is not None, reason=gap or "")


def make_spec(
    mode: str, ids="all", batch: int = 10, parallel: dict | None = None, accelerator: str = "cuda"
) -> ExperimentSpec:
    return spec_object(
        data={"batch_size": batch},
        devices={"accelerator": accelerator, "ids": ids},
        parallel={"mode": mode, **(parallel or {})},
    )


def run_child(code: str, env_update: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (CUDA not yet initialised); it prints one JSON line."""
    env = dict(os.environ, **(env_update or {}))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SEEN: list[tuple[str, int]] = []  # (device, rows) per replica call; replicas share this module-level list


class Recorder(nn.Module):
    def __init__(self, batchnorm: bool = False, bad_output: bool = False):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.bn = nn.BatchNorm1d(4) if batchnorm else nn.Identity()
        self.bad_output = bad_output

    def forward(self, x):
        SEEN.append((str(x.device), int(x.shape[0])))
        out = self.bn(self.fc(x))
        return {"logits": out, "aux": "text"} if self.bad_output else out


# --------------------------------------------------------------------------- devices


@requires_gpus(1)
def test_probe_matches_torch_without_initialising_cuda():
    res = run_child(
        """
        import json, torch
        from runner.devices.inventory import probe_inventory
        inv = probe_inventory()
        initialised = torch.cuda.is_initialized()
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        print(json.dumps({
            "initialised_by_probe": initialised,
            "probe": [[g.name, g.uuid] for g in inv.gpus],
            "torch": [[p.name, "GPU-" + str(p.uuid)] for p in props],
            "cuda_available": inv.cuda_available,
        }))
        """,
        {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
    )
    assert res["initialised_by_probe"] is False
    assert res["cuda_available"] is True
    assert res["probe"] == res["torch"]


@requires_gpus(1)
@pytest.mark.parametrize("form", ["index", "uuid"])
def test_narrowing_selects_the_planned_card(form):
    inv = probe_inventory()
    last = inv.gpus[-1]
    inherited = {} if form == "index" else {"CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in inv.gpus)}
    res = run_child(
        f"""
        import json, os, torch
        from runner.devices.inventory import probe_inventory
        from runner.devices.resolve import apply_device_env
        from runner.devices.resolve import resolve_devices
        from runner.spec.schema import ExperimentSpec
        spec = ExperimentSpec.model_validate({{"name": "t", "model": {{"name": "mlp"}},
            "data": {{"dataset": "synthetic", "batch_size": 4}}, "optim": {{"lr": 0.1}},
            "devices": {{"accelerator": "cuda", "ids": [{last.index}]}}}})
        plan = resolve_devices(spec, os.environ, probe_inventory())
        apply_device_env(plan)
        p = torch.cuda.get_device_properties(0)
        print(json.dumps({{"count": torch.cuda.device_count(), "uuid": "GPU-" + str(p.uuid),
            "planned": plan.uuids[0], "selected": plan.selected, "env": os.environ["CUDA_VISIBLE_DEVICES"]}}))
        """,
        inherited,
    )
    assert res["count"] == 1
    assert res["uuid"] == res["planned"] == last.uuid
    expect_entry = last.uuid if form == "uuid" else last.visible_entry
    assert res["selected"] == [expect_entry] and res["env"] == expect_entry


@requires_gpus(1)
def test_apply_refuses_after_real_cuda_init():
    res = run_child(
        """
        import json, torch
        from runner.devices.resolve import apply_device_env
        from runner.devices.resolve import DevicePlan
        from runner.errors import DeviceError
        torch.cuda.init()
        plan = DevicePlan("cuda", "none", [0], ["0"], ["0"], ["x"], [None], 1, 1, 1, None, 1, [1],
                          {"CUDA_VISIBLE_DEVICES": "0,0"})
        try:
            apply_device_env(plan)
            print(json.dumps({"raised": False}))
        except DeviceError as e:
            print(json.dumps({"raised": True, "msg": str(e)}))
        """
    )
    assert res["raised"] and "already initialised" in res["msg"]


# --------------------------------------------------------------------------- none / dp


def _reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str) -> dict[str, torch.Tensor]:
    ref = Recorder().to(device)
    ref.load_state_dict(model.state_dict())
    nn.functional.mse_loss(ref(x.to(device)), y.to(device)).backward()
    return {n: p.grad.detach().cpu() for n, p in ref.named_parameters()}


@requires_gpus(1)
def test_none_step_on_cuda_matches_cpu():
    spec = make_spec("none", ids=[0])
    plan = resolve_devices(spec, os.environ, probe_inventory())
    strategy = make_strategy(spec.parallel, plan, LauncherEnvironment.detect())
    torch.manual_seed(0)
    model = Recorder()
    cpu_grads = _reference_grads(model, *_data(8), device="cpu")
    wrapped = strategy.wrap(model)
    assert next(wrapped.parameters()).device == torch.device("cuda", 0)
    x, y = _data(8)
    nn.functional.mse_loss(wrapped(x.to(strategy.device)), y.to(strategy.output_device)).backward()
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(dict(wrapped.named_parameters())[name].grad.cpu(), grad, rtol=1e-4, atol=1e-5)


@requires_gpus(1)
def test_dp_with_one_device_runs_unwrapped():
    spec = make_spec("dp", ids=[0])
    plan = resolve_devices(spec, os.environ, probe_inventory())
    assert any("unwrapped" in n for n in plan.notes)
    wrapped = make_strategy(spec.parallel, plan, LauncherEnvironment.detect()).wrap(Recorder())
    assert not isinstance(wrapped, nn.DataParallel)


def _data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(batch, 6, generator=gen), torch.randn(batch, 4, generator=gen)


@requires_gpus(2)
@pytest.mark.parametrize("batch", [10, 2])
def test_dp_step_splits_and_gathers(batch):
    n = torch.cuda.device_count()
    spec = make_spec("dp", batch=batch, parallel={"output_device": n - 1})
    plan = resolve_devices(spec, os.environ, probe_inventory())
    strategy = make_strategy(spec.parallel, plan, LauncherEnvironment.detect())
    assert isinstance(strategy, DataParallelStrategy)
    torch.manual_seed(0)
    model = Recorder()
    expected = _reference_grads(model, *_data(batch), device="cuda:0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = strategy.wrap(model)
    assert not [w for w in caught if "BatchNorm" in str(w.message)]  # no BatchNorm, no warning
    assert isinstance(wrapped, nn.DataParallel) and wrapped.device_ids == list(range(n))
    SEEN.clear()
    x, y = _data(batch)
    out = wrapped(x.to(strategy.device))
    assert out.device == strategy.output_device == torch.device("cuda", n - 1)
    assert out.shape == (batch, 4)
    used = [size for size in plan.per_device_batch if size]
    assert sorted(SEEN) == sorted((f"cuda:{i}", size) for i, size in enumerate(used))
    nn.functional.mse_loss(out, y.to(strategy.output_device)).backward()
    for name, p in strategy.unwrap(wrapped).named_parameters():
        assert p.grad.device == torch.device("cuda", 0)
        torch.testing.assert_close(p.grad.cpu(), expected[name], rtol=1e-4, atol=1e-5)


@requires_gpus(2)
def test_dp_warns_about_batchnorm_and_explains_ungatherable_output():
    spec = make_spec("dp", batch=4)
    strategy = make_strategy(
        spec.parallel, resolve_devices(spec, os.environ, probe_inventory()), LauncherEnvironment.detect()
    )
    with pytest.warns(UserWarning, match="sync_batchnorm"):
        strategy.wrap(Recorder(batchnorm=True))
    wrapped = strategy.wrap(Recorder(bad_output=True))
    with pytest.raises(TrainingError, match=r"output\['aux'\] is a str"):
        wrapped(torch.randn(4, 6, device=strategy.device))


class LossOutput(nn.Module):
    """forward(x, y) returns a dataclass with the batch's mean loss, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x, y):
        logits = self.fc(x)
        return _Out(nn.functional.mse_loss(logits, y), logits)


@dataclasses.dataclass
class _Out:
    loss: torch.Tensor
    logits: torch.Tensor


@requires_gpus(2)
@pytest.mark.parametrize("batch", [10, 3])
def test_dp_gathers_dataclass_outputs_as_dicts_and_weighs_the_replica_losses(batch):
    spec = make_spec("dp", batch=batch)
    strategy = make_strategy(
        spec.parallel, resolve_devices(spec, os.environ, probe_inventory()), LauncherEnvironment.detect()
    )
    torch.manual_seed(0)
    model = LossOutput()
    x, y = _data(batch)
    reference = model.to("cuda:0")(x.to("cuda:0"), y.to("cuda:0"))
    wrapped = strategy.wrap(model)
    out = wrapped(x.to(strategy.device), y.to(strategy.device))
    assert isinstance(out, dict) and set(out) == {"loss", "logits"} and out["loss"].dim() == 0
    assert out["loss"].device == strategy.output_device
    torch.testing.assert_close(out["loss"], reference.loss.to(strategy.output_device), rtol=1e-5, atol=1e-6)
    assert out["logits"].shape == (batch, 4)


# --------------------------------------------------------------------------- ddp (nccl)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@requires_gpus(1)
def test_ddp_nccl_one_process(monkeypatch):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    spec = make_spec("ddp", ids=[0], batch=8, parallel={"timeout_s": 120.0})
    plan = resolve_devices(spec, os.environ, probe_inventory())
    assert plan.backend == "nccl"
    strategy = make_strategy(spec.parallel, plan, LauncherEnvironment.detect())
    strategy.setup()
    try:
        assert dist.get_backend() == "nccl" and strategy.device == torch.device("cuda", 0)
        t = torch.tensor([2.0, 3.0])
        assert torch.equal(strategy.all_reduce_sum(t), t)
        assert torch.equal(strategy.all_reduce_sum(t.cuda()).cpu(), t)
        assert strategy.all_gather_object("a") == ["a"]
        strategy.barrier()
        wrapped = strategy.wrap(Recorder())
        x, y = _data(8)
        nn.functional.mse_loss(wrapped(x.cuda()), y.cuda()).backward()
        assert all(p.grad is not None for p in wrapped.parameters())
    finally:
        strategy.teardown()
        strategy.teardown()
    assert not dist.is_initialized()


@requires_gpus(1)
def test_ddp_nccl_stop_decision_never_synchronises_the_device(monkeypatch):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    spec = make_spec("ddp", ids=[0], batch=8, parallel={"timeout_s": 120.0})
    strategy = make_strategy(
        spec.parallel, resolve_devices(spec, os.environ, probe_inventory()), LauncherEnvironment.detect()
    )
    strategy.setup()
    try:
        assert dist.get_backend() == "nccl"
        torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation raises
        try:
            answers = [strategy.reduce_stop_decision(flag) for flag in (False, True, False)]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert answers == [False, False, True]
    finally:
        strategy.teardown()


@requires_gpus(1)
def test_fp16_precision_scales_on_cuda():
    from runner.strategies.base import Precision

    device = torch.device("cuda", 0)
    precision = Precision("fp16", device)
    assert precision.scaling and precision.dtype == torch.float16
    torch.manual_seed(0)
    model = Recorder().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(8)
    with precision.autocast():
        out = model(x.to(device))
    assert out.dtype == torch.float16
    before = model.fc.weight.detach().clone()
    precision.backward(nn.functional.mse_loss(out.float(), y.to(device)))
    precision.unscale_(optimizer)
    precision.step(optimizer)
    assert not torch.equal(before, model.fc.weight)
    state = precision.state_dict()
    assert state is not None and state["scale"] > 0
    again = Precision("fp16", device)
    again.load_state_dict({**state, "scale": 8.0})
    assert again.state_dict()["scale"] == 8.0


def _ddp_worker() -> dict:
    spec = make_spec("ddp", ids=[0, 1], batch=8, parallel={"timeout_s": 120.0})
    strategy = make_strategy(
        spec.parallel, resolve_devices(spec, os.environ, probe_inventory()), LauncherEnvironment.detect()
    )
    strategy.setup()
    try:
        rank = strategy.rank
        torch.manual_seed(0)
        wrapped = strategy.wrap(Recorder())
        x, y = _data(8)
        xs, ys = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
        nn.functional.mse_loss(wrapped(xs.to(strategy.device)), ys.to(strategy.device)).backward()
        return {
            "device": str(strategy.device),
            "sum": strategy.all_reduce_sum(torch.tensor([rank + 1.0])).item(),
            "grads": {n: p.grad.cpu() for n, p in strategy.unwrap(wrapped).named_parameters()},
        }
    finally:
        strategy.teardown()


@requires_gpus(2)
@pytest.mark.integration
@pytest.mark.timeout(180)
def test_ddp_nccl_two_processes_match_single_gradient():
    results = elastic_run(_ddp_worker, 2, "cuda")
    torch.manual_seed(0)
    expected = _reference_grads(Recorder(), *_data(8), device="cuda:0")
    assert [results[r]["device"] for r in (0, 1)] == ["cuda:0", "cuda:1"]
    for res in results.values():
        assert res["sum"] == 3.0
        for name, grad in expected.items():
            torch.testing.assert_close(res["grads"][name], grad, rtol=1e-4, atol=1e-5)


def test_skip_helper_names_what_is_missing():
    gap = _cuda_gap(10_000)
    assert gap is not None and ("needs" in gap)
