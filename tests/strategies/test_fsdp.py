"""Tests for the fsdp strategy on CPU in a one-process gloo group, and the mode's spec declaration."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from runner.cli import main
from runner.devices.environment import LauncherEnvironment
from runner.errors import SpecError
from runner.launch.prebuild import _compile_backend
from runner.spec.dump import inactive_keys
from runner.spec.schema_parallel import MODES, ParallelSpec
from runner.strategies import STRATEGIES, make_strategy
from runner.strategies.base import SingleDevice, find_blocks
from runner.strategies.distributed import FSDPStrategy
from runner.training import shards
from tests.helpers import spec_text
from tests.strategies.test_ddp import DIST_VARS, clean_dist_env, cpu_plan, free_port, make_spec  # noqa: F401


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("scale", torch.full((width,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.blocks(x)))


@pytest.fixture
def fsdp_one(monkeypatch):
    """A set-up FSDPStrategy in a one-process gloo group."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def make(**parallel):
        spec = make_spec("fsdp", parallel={"timeout_s": 60.0, **parallel})
        strategy = make_strategy(spec.parallel, cpu_plan(spec), LauncherEnvironment.detect())
        strategy.setup()
        return strategy

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def test_every_mode_has_a_strategy_and_a_declaration():
    modes = ParallelSpec.model_fields["mode"].annotation.__args__
    assert list(STRATEGIES) == list(MODES) == list(modes)


def test_fsdp_keys_are_active_and_ddp_only_keys_inactive_under_fsdp():
    spec = make_spec("fsdp", parallel={"fsdp_blocks": ["Block"], "find_unused_parameters": True, "dim": 1})
    inactive = inactive_keys(spec)
    assert inactive["parallel.find_unused_parameters"] == 'ddp only (mode = "fsdp")'
    assert inactive["parallel.dim"] == 'dp only (mode = "fsdp")'
    assert "parallel.fsdp_blocks" not in inactive and "parallel.timeout_s" not in inactive
    assert inactive_keys(make_spec("ddp"))["parallel.fsdp_blocks"] == 'fsdp only (mode = "ddp")'
    assert inactive_keys(make_spec())["parallel.timeout_s"] == 'ddp and fsdp only (mode = "none")'


def test_fsdp_plan_is_one_process_per_device_with_gloo_on_cpu():
    spec = make_spec("fsdp", parallel={"nproc_per_node": 2})
    plan = cpu_plan(spec)
    assert (plan.world_size, plan.backend, plan.per_device_batch) == (2, "gloo", [4, 4])


def test_blocks_default_to_children_with_parameters_and_names_are_checked():
    model = Net()
    assert find_blocks(model, None) == [model.blocks, model.head]
    assert find_blocks(model, ["Block"]) == list(model.blocks)
    with pytest.raises(SpecError) as caught:
        find_blocks(model, ["Blok"])
    issue = caught.value.issues[0]
    assert issue.key == "parallel.fsdp_blocks" and "'Blok'" in issue.message and '"Block"' in issue.message


class Layers(nn.Module):
    """The usual hand-written transformer's shape: its layers in a top-level ``nn.ModuleList``."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_top_level_module_list_gives_its_items_as_blocks_and_cannot_be_named_itself(fsdp_one):
    # fully_shard refuses a container without a forward: the default blocks took the ModuleList itself, and every
    # such model failed under fsdp once its run existed.
    model = Layers()
    assert find_blocks(model, None) == [*model.layers, model.head]
    with pytest.raises(SpecError) as caught:
        find_blocks(model, ["ModuleList"])
    assert (
        "container without a forward" in caught.value.issues[0].message and "(Block)" in caught.value.issues[0].message
    )
    torch.manual_seed(0)
    reference = Layers()
    wrapped = fsdp_one().wrap(copy.deepcopy(reference))
    assert all(isinstance(layer, FSDPModule) for layer in wrapped.layers)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), reference(x))


def test_wrap_shards_blocks_then_root_and_evaluates_like_the_model(fsdp_one):
    strategy = fsdp_one(fsdp_blocks=["Block"])
    torch.manual_seed(0)
    reference = Net()
    model = Net()
    model.load_state_dict(reference.state_dict())
    wrapped = strategy.wrap(model)
    assert isinstance(wrapped, FSDPModule) and all(isinstance(b, FSDPModule) for b in wrapped.blocks)
    assert not isinstance(wrapped.head, FSDPModule)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(strategy.eval_module(wrapped)(x), reference(x))
        torch.testing.assert_close(wrapped(x), reference(x))


def test_no_sync_accumulates_gradients_as_the_plain_model(fsdp_one):
    strategy = fsdp_one()
    torch.manual_seed(0)
    plain = Net()
    model = Net()
    model.load_state_dict(plain.state_dict())
    wrapped = strategy.wrap(model)
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    with strategy.no_sync(wrapped):
        wrapped(x1).sum().backward()
    wrapped(x2).sum().backward()
    (plain(x1).sum() + plain(x2).sum()).backward()
    torch.testing.assert_close(wrapped.head.weight.grad.full_tensor(), plain.head.weight.grad)


def test_bf16_maps_to_a_mixed_precision_policy(fsdp_one):
    spec = make_spec("fsdp")
    strategy = FSDPStrategy(cpu_plan(spec), spec.parallel, LauncherEnvironment.detect({}), amp="bf16")
    assert strategy.policy.param_dtype == torch.bfloat16 and strategy.policy.reduce_dtype == torch.float32
    assert FSDPStrategy(cpu_plan(spec), spec.parallel, LauncherEnvironment.detect({})).policy.param_dtype is None


def _train_spec(**train):
    return make_spec(parallel={}).train.model_copy(update=train)


@pytest.mark.parametrize("train", [{"activation_checkpointing": True}, {"compile": True, "compile_backend": "eager"}])
def test_checkpointing_and_compile_keep_names_and_gradients_under_none_and_fsdp(fsdp_one, train):
    torch.manual_seed(0)
    reference = Net()
    x = torch.randn(4, 8)
    reference(x).sum().backward()
    single = SingleDevice(cpu_plan(make_spec()))
    strategy = fsdp_one()
    for wrap in (single.wrap, strategy.wrap):
        model = Net()
        model.load_state_dict(reference.state_dict())
        wrapped = wrap(model, _train_spec(**train))
        assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in reference.named_parameters()]
        wrapped(x).sum().backward()
        grad = wrapped.head.weight.grad
        torch.testing.assert_close(
            grad.full_tensor() if hasattr(grad, "full_tensor") else grad, reference.head.weight.grad
        )


def test_compile_and_checkpointing_are_refused_under_dp_and_an_unknown_backend_exits_2(write_spec, capsys):
    text = spec_text(train={"compile": True, "activation_checkpointing": True}, parallel={"mode": "dp"})
    assert main(["validate", str(write_spec(text=text))]) == 2
    err = capsys.readouterr().err
    assert 'train.compile: compile cannot apply under mode = "dp"' in err and "train.activation_checkpointing" in err
    with pytest.raises(SpecError) as caught:
        _compile_backend("inductr")
    assert caught.value.issues[0].key == "train.compile_backend" and '"inductor"' in caught.value.issues[0].message


def _gathered(wrapped: nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))


def _payload(step: int) -> dict:
    from runner.training.checkpoint import FORMAT_VERSION

    return {"format": FORMAT_VERSION, "state": {"global_step": step}, "rng": []}


def test_a_sharded_checkpoint_saves_each_ranks_shards_and_loads_into_none_and_back(fsdp_one, tmp_path):
    from runner.training import checkpoint as ckpt

    strategy = fsdp_one()
    torch.manual_seed(0)
    wrapped = strategy.wrap(Net())
    opt = torch.optim.Adam(wrapped.parameters(), lr=0.1)
    wrapped(torch.randn(4, 8)).sum().backward()
    opt.step()
    folder = tmp_path / "ck"
    for step in (1, 2, 3):  # keep_last = 2: the oldest folder and its digest go
        ckpt.save_checkpoint(folder, strategy.checkpoint_state(wrapped, opt), _payload(step), step, 2, strategy.barrier)
    assert sorted(p.name for p in folder.iterdir()) == [
        "step-00000002",
        "step-00000002.sha256",
        "step-00000003",
        "step-00000003.sha256",
    ]
    newest = folder / "step-00000003"
    assert sorted(p.name for p in newest.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    found = ckpt.load_latest(folder)
    assert found is not None and found.path == newest and found.payload["state"]["global_step"] == 3
    whole = _gathered(wrapped)  # as the none mode holds it
    exported = shards.whole_model(found.path)  # what `runner export` writes: no process group needed
    assert exported.keys() == whole.keys()
    for key, value in whole.items():
        assert torch.equal(exported[key], value), key

    single = SingleDevice(cpu_plan(make_spec()))  # a sharded checkpoint resumes under none
    plain = Net()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    state = single.checkpoint_state(plain, plain_opt)
    shards.load_checkpoint(newest, state)
    single.set_checkpoint_state(plain, plain_opt, state)
    for key, value in whole.items():
        assert torch.equal(plain.state_dict()[key], value), key
    first = next(iter(wrapped.parameters()))
    assert torch.equal(plain_opt.state_dict()["state"][0]["exp_avg"], opt.state[first]["exp_avg"].full_tensor())

    fresh = strategy.wrap(Net())  # and back into fsdp
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    state = strategy.checkpoint_state(fresh, fresh_opt)
    shards.load_checkpoint(newest, state)
    strategy.set_checkpoint_state(fresh, fresh_opt, state)
    for key, value in _gathered(fresh).items():
        assert torch.equal(value, whole[key]), key


def test_a_damaged_shard_or_a_metadata_that_would_run_code_is_never_loaded(fsdp_one, tmp_path):
    import os
    import pickle

    from runner.training import checkpoint as ckpt

    strategy = fsdp_one()
    wrapped = strategy.wrap(Net())
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    folder = tmp_path / "ck"
    for step in (1, 2):
        ckpt.save_checkpoint(folder, strategy.checkpoint_state(wrapped, opt), _payload(step), step, 5, strategy.barrier)
    shard = folder / "step-00000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged in place: same size, same name
    shard.write_bytes(bytes(data))
    found = ckpt.load_latest(folder)
    assert found is not None and found.path.name == "step-00000001"  # the previous good one
    ((skipped, reason),) = found.skipped
    assert skipped.name == "step-00000002" and "SHA-256 of step-00000002/__0_0.distcp differs" in reason

    class Exploit:
        def __reduce__(self):
            return (os.system, ("true",))

    metadata = folder / "step-00000001" / ".metadata"
    metadata.write_bytes(pickle.dumps(Exploit()))  # and its digest rewritten, as whoever can write the folder can
    digests = {f"step-00000001/{p.name}": ckpt._sha256(p) for p in (folder / "step-00000001").iterdir()}
    ckpt.write_digest(folder / "step-00000001", digests)
    state = strategy.checkpoint_state(wrapped, opt)
    with pytest.raises(ckpt.CheckpointError, match=r"refused: its \.metadata names (posix|os)\.system"):
        shards.load_checkpoint(folder / "step-00000001", state)


def test_an_optimizer_state_without_tensors_loads_under_fsdp(fsdp_one, tmp_path):
    # plain SGD keeps no tensor state: torch's full-state loader failed on it ("Expected device to be set"),
    # which ended an fsdp run FAILED when it resumed from a checkpoint of the digits example
    from runner.training import checkpoint as ckpt

    strategy, single = fsdp_one(), SingleDevice(cpu_plan(make_spec()))
    plain = Net()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    plain(torch.randn(4, 8)).sum().backward()
    plain_opt.step()
    plain_opt.param_groups[0]["lr"] = 0.0125  # as a schedule would have left it
    ckpt.save_checkpoint(tmp_path, single.checkpoint_state(plain, plain_opt), _payload(1), 1, 1, strategy.barrier)
    fresh = strategy.wrap(Net())
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05)
    state = strategy.checkpoint_state(fresh, fresh_opt)
    shards.load_checkpoint(tmp_path / "step-00000001", state)
    strategy.set_checkpoint_state(fresh, fresh_opt, state)
    assert fresh_opt.param_groups[0]["lr"] == 0.0125


def test_a_background_save_is_in_place_once_finished_and_a_failed_one_is_named_and_never_used(
    fsdp_one, tmp_path, monkeypatch
):
    from torch.distributed.checkpoint import FileSystemWriter

    from runner.training import checkpoint as ckpt

    strategy = fsdp_one()
    wrapped = strategy.wrap(Net())
    opt = torch.optim.Adam(wrapped.parameters(), lr=0.1)
    wrapped(torch.randn(4, 8)).sum().backward()
    opt.step()
    folder, group = tmp_path / "ck", strategy.save_group()

    def save(step: int) -> ckpt.PendingSave | None:  # in the background, keeping the newest two
        state = strategy.checkpoint_state(wrapped, opt)
        return ckpt.save_checkpoint(
            folder, state, _payload(step), step, 2, strategy.barrier, background=True, group=group
        )

    pending = save(1)
    assert pending is not None
    before = {k: v.clone() for k, v in _gathered(wrapped).items()}
    with torch.no_grad():
        for p in wrapped.parameters():  # training goes on: the save holds the state it was given
            p.add_(1.0)
    pending.finish()
    found = ckpt.load_latest(folder)
    assert found is not None and found.path.name == "step-00000001"
    for key, value in shards.whole_model(found.path).items():
        assert torch.equal(value, before[key]), key

    def fail(*_args, **_kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", fail)
    pending = save(2)
    assert pending is not None
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint step-00000002 was not saved .*No space left"):
        pending.finish()
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step-00000001"]  # the failed one is never used


class Tied(nn.Module):
    """A language-model shape: the output head shares the embedding's weight (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.embed(x))))


def test_tied_weights_stay_with_the_root_by_default_and_named_blocks_that_tie_are_refused(fsdp_one):
    """fsdp's default blocks failed on a tied embedding after the run existed, with advice no key could follow."""
    model = Tied()
    assert find_blocks(model, None) == [model.body]  # embed and head share a weight: the root's unit holds it
    with pytest.raises(SpecError, match=r"parallel\.fsdp_blocks: .*tied weights.*fsdp_blocks = \[\] shards"):
        find_blocks(model, ["Embedding", "Linear"])
    torch.manual_seed(0)
    wrapped = fsdp_one().wrap(model)
    x = torch.tensor([[1, 2, 3]])
    wrapped(x).sum().backward()  # trains: one step's gradients reach the shared weight
    assert model.embed.weight.grad is not None
