"""Tests for runner.strategies on CPU: strategies, a one-process gloo group, state dicts, gatherable outputs."""

from __future__ import annotations

import itertools
import socket
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from runner.devices.environment import LauncherEnvironment
from runner.devices.inventory import GpuInfo, Inventory
from runner.devices.resolve import resolve_devices
from runner.errors import DeviceError, TrainingError, UsageError
from runner.plan import make_plan
from runner.spec.loading import load_spec
from runner.spec.schema import ExperimentSpec
from runner.strategies import make_strategy
from runner.strategies.base import (
    DataParallelStrategy,
    SingleDevice,
    _GatherCheckedDataParallel,
    check_gatherable,
    unwrap,
)
from runner.strategies.distributed import DDPStrategy, describe_unused_parameters_error, is_unused_parameters_error
from runner.training import checkpoint as ckpt
from runner.training import shards
from tests.helpers import spec_object

DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def make_spec(
    mode: str = "none", accelerator: str = "cpu", batch: int = 8, parallel: dict | None = None
) -> ExperimentSpec:
    return spec_object(
        data={"batch_size": batch}, devices={"accelerator": accelerator}, parallel={"mode": mode, **(parallel or {})}
    )


def cpu_plan(spec: ExperimentSpec):
    return resolve_devices(spec, {}, Inventory([], False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def clean_dist_env(monkeypatch):
    """Start without launcher variables; never leak a process group or thread setting."""
    for var in DIST_VARS:
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)


@pytest.fixture
def ddp_one(monkeypatch):
    """A set-up DDPStrategy in a one-process gloo group."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    spec = make_spec("ddp", parallel={"timeout_s": 60.0})
    strategy = make_strategy(spec.parallel, cpu_plan(spec), LauncherEnvironment.detect())
    strategy.setup()
    yield strategy
    strategy.teardown()


class Net(nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 3) if unused else None

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


# --------------------------------------------------------------------------- none / dp


def test_make_strategy_picks_class_per_mode():
    assert isinstance(make_strategy(make_spec("none").parallel, cpu_plan(make_spec("none"))), SingleDevice)
    assert isinstance(make_strategy(make_spec("ddp").parallel, cpu_plan(make_spec("ddp"))), DDPStrategy)


def test_single_device_cpu_is_trivial():
    strategy = make_strategy(make_spec().parallel, cpu_plan(make_spec()))
    strategy.setup()
    assert (strategy.rank, strategy.local_rank, strategy.world_size, strategy.is_main) == (0, 0, 1, True)
    assert strategy.device == torch.device("cpu") == strategy.output_device
    model = Net()
    wrapped = strategy.wrap(model)
    assert wrapped is model and strategy.unwrap(wrapped) is model and strategy.eval_module(wrapped) is model
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(strategy.all_reduce_sum(t), t)
    assert strategy.all_gather_object("x") == ["x"]
    assert strategy.reduce_stop_decision(0, settle=True) is False and strategy.reduce_stop_decision(7) is True
    strategy.barrier()
    with strategy.no_sync(wrapped):
        pass
    strategy.teardown()


def test_single_device_on_cuda_plan_targets_cuda0():
    spec = make_spec(accelerator="auto")
    plan = resolve_devices(spec, {}, Inventory([GpuInfo(0, "x"), GpuInfo(1, "y")], True))
    strategy = make_strategy(spec.parallel, plan)
    assert strategy.device == torch.device("cuda", 0)  # creating the device object does not touch CUDA


def test_dp_without_gpus_is_refused_before_any_strategy_exists():
    # The strategy assumes a CUDA plan: device resolution is where "dp needs CUDA" is checked.
    with pytest.raises(DeviceError, match="dp"):
        resolve_devices(make_spec("dp", accelerator="auto"), {}, Inventory([], False))


def test_dp_strategy_output_device_from_plan():
    spec = make_spec("dp", accelerator="cuda", parallel={"output_device": 2})
    plan = resolve_devices(spec, {}, Inventory([GpuInfo(i, "g") for i in range(3)], True))
    strategy = make_strategy(spec.parallel, plan)
    assert isinstance(strategy, DataParallelStrategy)
    assert strategy.device == torch.device("cuda", 0) and strategy.output_device == torch.device("cuda", 2)


# --------------------------------------------------------------------------- ddp, one process


def test_ddp_needs_launcher_env():
    spec = make_spec("ddp")
    strategy = make_strategy(spec.parallel, cpu_plan(spec), LauncherEnvironment.detect())
    with pytest.raises(UsageError, match="RANK"):
        strategy.setup()
    with pytest.raises(UsageError, match="RANK"):  # no environment handed in: not started by a launcher
        make_strategy(spec.parallel, cpu_plan(spec)).setup()


def test_ddp_world_size_must_match_plan(write_spec):
    # Checked once, when the plan is made, before any worker or strategy exists.
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    loaded = load_spec(write_spec('[parallel]\nmode = "ddp"\n'))
    with pytest.raises(UsageError, match="WORLD_SIZE=2"):
        make_plan(loaded, env=env, inventory=Inventory([], False))


def test_ddp_one_process_collectives(ddp_one):
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert (ddp_one.rank, ddp_one.local_rank, ddp_one.world_size, ddp_one.is_main) == (0, 0, 1, True)
    t = torch.tensor([1.5, 2.0])
    out = ddp_one.all_reduce_sum(t)
    assert torch.equal(out, t) and out is not t
    assert ddp_one.all_gather_object(3) == [3]
    ddp_one.barrier()


def test_single_device_answers_the_stop_decision_at_once():
    strategy = make_strategy(make_spec().parallel, cpu_plan(make_spec()))
    assert [strategy.reduce_stop_decision(flag) for flag in (False, True, False)] == [False, True, False]
    assert strategy.reduce_stop_decision(True, settle=True) is True


def test_ddp_stop_decision_asks_the_ranks_only_when_settled_and_stays(ddp_one, monkeypatch):
    reductions = []
    real = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        reductions.append((tensor.device, kwargs.get("group")))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording)
    # Hot path: no collective, the answer agreed so far (a flag waits for the next settling call).
    assert [ddp_one.reduce_stop_decision(flag) for flag in (False, True, False)] == [False, False, False]
    assert reductions == []
    assert ddp_one.reduce_stop_decision(False, settle=True) is False
    assert ddp_one.reduce_stop_decision(True, settle=True) is True  # the current flag counts
    assert reductions == [(torch.device("cpu"), ddp_one._flag_group)] * 2  # on the CPU gloo side group
    assert dist.get_backend(ddp_one._flag_group) == "gloo" and ddp_one._flag_group is not dist.group.WORLD
    assert ddp_one.reduce_stop_decision(False) is True and ddp_one.reduce_stop_decision(False, settle=True) is True
    assert len(reductions) == 2  # final: no more collectives
    ddp_one.teardown()
    assert ddp_one._flag_group is None


def test_ddp_wrap_eval_and_teardown_twice(ddp_one):
    model = Net()
    wrapped = ddp_one.wrap(model)
    assert isinstance(wrapped, nn.parallel.DistributedDataParallel)
    assert ddp_one.unwrap(wrapped) is model and ddp_one.eval_module(wrapped) is model
    with ddp_one.no_sync(wrapped):
        wrapped(torch.randn(4, 4)).sum().backward()
    ddp_one.teardown()
    ddp_one.teardown()
    assert not dist.is_initialized()


def test_ddp_unused_parameters_error_names_them(ddp_one):
    model = Net(unused=True)
    wrapped = ddp_one.wrap(model)
    with pytest.raises(RuntimeError) as caught:
        for _ in range(2):
            wrapped(torch.randn(4, 4)).sum().backward()
    assert is_unused_parameters_error(caught.value)
    err = describe_unused_parameters_error(caught.value, wrapped)
    assert isinstance(err, TrainingError)
    assert "spare.weight" in str(err) and "spare.bias" in str(err)
    assert "parallel.find_unused_parameters" in str(err)


@pytest.mark.parametrize(
    ("message", "expect"),
    [
        (
            "Expected to have finished reduction ...\n"
            "Parameters which did not receive grad for rank 1: b.bias, b.weight\n",
            ["b.bias", "b.weight", "rank 1"],
        ),
        (
            "Expected to have finished reduction ...\n"
            "Parameter indices which did not receive grad for rank 0: 0 3\n In addition",
            ["a.weight, bn.bias", "rank 0"],
        ),
        ("Expected to have finished reduction ... static_graph set to True.", ["static_graph = false"]),
    ],
)
def test_describe_unused_parameters_parses_messages(message, expect):
    err = describe_unused_parameters_error(RuntimeError(message), Net())
    for piece in expect:
        assert piece in str(err)


def test_describe_unused_parameters_falls_back_to_missing_grads():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0](torch.randn(1, 2)).sum().backward()
    err = describe_unused_parameters_error(RuntimeError("Expected to have finished reduction"), model)
    assert "1.weight, 1.bias" in str(err)


# --------------------------------------------------------------------------- state dicts


def _wrap(mode: str, model: nn.Module) -> nn.Module:
    if mode == "dp":
        return nn.DataParallel(model)  # without CUDA it keeps the module on CPU, keys still 'module.'
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    return model


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(["none", "dp", "ddp"], repeat=2)))
def test_a_checkpoint_of_one_mode_loads_into_another(request, tmp_path: Path, src: str, dst: str) -> None:
    """Keys carry no wrapper prefix: the strategies hand DCP the unwrapped model (``Strategy.checkpoint_state``)."""
    if "ddp" in (src, dst):
        request.getfixturevalue("ddp_one")  # DDP needs a process group; the others do without its set-up
    torch.manual_seed(0)
    source = _wrap(src, Net())
    with torch.no_grad():
        unwrap(source).bn.running_mean.add_(1.0)
    saved = get_model_state_dict(unwrap(source))
    assert not any(k.startswith("module.") for k in saved)
    dcp.save({"model": saved}, checkpoint_id=tmp_path)
    torch.manual_seed(1)
    target = _wrap(dst, Net())
    state = {"model": get_model_state_dict(unwrap(target))}
    shards.load_checkpoint(tmp_path, state)
    set_model_state_dict(unwrap(target), state["model"])
    for (name, a), (_, b) in zip(unwrap(source).state_dict().items(), unwrap(target).state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_checkpoint_of_another_model_does_not_load_and_names_the_key(tmp_path: Path) -> None:
    dcp.save({"model": get_model_state_dict(nn.Linear(2, 2))}, checkpoint_id=tmp_path)
    state = {"model": get_model_state_dict(Net())}
    with pytest.raises(ckpt.CheckpointError, match=r"the shards do not load .*model\.a\.weight"):
        shards.load_checkpoint(tmp_path, state)


# --------------------------------------------------------------------------- gatherable outputs

Pair = namedtuple("Pair", "logits aux")


@pytest.mark.parametrize(
    "output",
    [
        torch.zeros(2),
        None,
        (torch.zeros(2), torch.ones(2)),
        [torch.zeros(1)],
        {"a": torch.zeros(1), "b": {"c": None}},
        Pair(torch.zeros(1), torch.zeros(1)),
    ],
)
def test_check_gatherable_accepts_tensors_and_containers(output):
    check_gatherable(output)


@pytest.mark.parametrize(
    ("output", "expect"),
    [
        ({"logits": torch.zeros(1), "aux": "text"}, "output['aux'] is a str"),
        ((torch.zeros(1), 3), "output[1] is a int"),
        ({"a": [torch.zeros(1), {"b": 1.5}]}, "output['a'][1]['b'] is a float"),
        (Pair(torch.zeros(1), object()), "output[1] is a object"),
    ],
)
def test_check_gatherable_names_offending_path(output, expect):
    with pytest.raises(TrainingError) as err:
        check_gatherable(output)
    assert expect in str(err.value) and 'mode = "dp"' in str(err.value)


def test_dataparallel_wrapper_checks_before_gathering():
    wrapper = _GatherCheckedDataParallel(nn.Linear(2, 2))
    with pytest.raises(TrainingError, match=r"output\['aux'\] is a str"):
        wrapper.gather([{"aux": "x"}, {"aux": "y"}], 0)


def test_torchs_rendezvous_store_binds_every_interface_as_the_plan_says() -> None:
    """torch's TCPStore takes no bind address: a server for 127.0.0.1 still listens on every interface.

    When torch learns to bind one address, this fails: then runner should bind loopback on one node and
    the README and ``runner plan`` should stop saying otherwise.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == store.port:
                listening.append(local.rsplit(":", 1)[0])
    assert listening and all(set(address) == {"0"} for address in listening), listening  # 0.0.0.0 or ::
