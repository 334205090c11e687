"""Two CPU processes (gloo) started by torch's elastic launcher: collectives and DDP gradients match one process."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from runner.devices.environment import LauncherEnvironment
from runner.devices.inventory import Inventory
from runner.devices.resolve import apply_threads, resolve_devices
from runner.spec.schema import ExperimentSpec
from runner.strategies import make_strategy
from tests.helpers import elastic_run, spec_object

pytestmark = pytest.mark.integration

WORLD = 2
BATCH = 8


def _spec() -> ExperimentSpec:
    return spec_object(
        data={"batch_size": BATCH},
        devices={"accelerator": "cpu"},
        parallel={"mode": "ddp", "nproc_per_node": WORLD, "timeout_s": 60.0},
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    return torch.randn(BATCH, 5, generator=gen), torch.randn(BATCH, 3, generator=gen)


def _worker() -> dict:
    """Runs in each elastic worker; returns what the test checks."""
    spec = _spec()
    plan = resolve_devices(spec, {}, Inventory([], False))
    apply_threads(plan)  # as runner's worker does, before the strategy's setup
    strategy = make_strategy(spec.parallel, plan, LauncherEnvironment.detect())
    strategy.setup()
    try:
        rank = strategy.rank
        out = {
            "rank": rank,
            "world": strategy.world_size,
            "local_rank": strategy.local_rank,
            "is_main": strategy.is_main,
            "threads": torch.get_num_threads(),
            "sum": strategy.all_reduce_sum(torch.tensor([rank + 1.0, 10.0])),
            "gathered": strategy.all_gather_object(rank * 10),
        }
        wrapped = strategy.wrap(_model())
        x, y = _batch()
        share = BATCH // WORLD
        xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        nn.functional.mse_loss(wrapped(xs), ys).backward()
        out["grads"] = {n: p.grad.clone() for n, p in strategy.unwrap(wrapped).named_parameters()}
        out["stop"] = _stop_answers(strategy)
        strategy.barrier()
        return out
    finally:
        strategy.teardown()


STOP_FLAGGED_AT = 3  # rank 1 alone raises its stop flag after step 3 (and keeps it raised)


LOG_EVERY = 2  # steps settle the decision at steps 2, 4, 6 (log steps)


def _stop_answers(strategy) -> dict[str, list[bool]]:
    """The stop decisions one rank gets: settled at an epoch boundary, then after steps 1..6 (settled at log steps)."""
    settled = [strategy.reduce_stop_decision(False, settle=True)]
    hot = [
        strategy.reduce_stop_decision(strategy.rank == 1 and step >= STOP_FLAGGED_AT, settle=step % LOG_EVERY == 0)
        for step in range(1, 7)
    ]
    settled.append(strategy.reduce_stop_decision(False, settle=True))  # final once True
    return {"hot": hot, "settled": settled}


@pytest.fixture(scope="module")
def results():
    return elastic_run(_worker, WORLD)


@pytest.mark.timeout(120)
def test_layout_and_threads(results):
    assert sorted(results) == [0, 1]
    for rank, res in results.items():
        assert (res["rank"], res["world"], res["local_rank"], res["is_main"]) == (rank, WORLD, rank, rank == 0)
    cores = len(os.sched_getaffinity(0))
    assert all(res["threads"] == max(1, cores // WORLD) for res in results.values())


@pytest.mark.timeout(120)
def test_collectives(results):
    for res in results.values():
        assert torch.equal(res["sum"], torch.tensor([3.0, 20.0]))
        assert res["gathered"] == [0, 10]


@pytest.mark.timeout(120)
def test_ddp_gradient_equals_single_process_gradient(results):
    model = _model()
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    for res in results.values():
        assert res["grads"].keys() == expected.keys()
        for name, grad in expected.items():
            torch.testing.assert_close(res["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(120)
def test_stop_decision_agrees_at_the_next_log_step_on_every_rank(results):
    # Rank 1 asks to stop after step 3; both ranks learn it after step 4 (the next log step), rank 0 too.
    expected_hot = [step > STOP_FLAGGED_AT for step in range(1, 7)]
    assert expected_hot == [False, False, False, True, True, True]
    for res in results.values():
        assert res["stop"]["hot"] == expected_hot
        assert res["stop"]["settled"] == [False, True]


def _overlapped_logs(every_n_steps: int = 4) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, str]]]:
    """Runs in each elastic worker: fit() logging every step, a checkpoint every ``every_n_steps``, a stop asked in
    step 3. Returns (logged step, optimizer steps taken when it was logged) and the checkpoints made."""
    from runner.errors import Interrupted
    from runner.training.loop import fit
    from tests.training.test_loop import RecordingTracker, Saves, make_parts, make_spec, request_stop_in_step

    spec = make_spec(log_every_n_steps=1)
    checkpoint = spec.checkpoint.model_copy(update={"every_n_steps": every_n_steps})
    spec = spec.model_copy(update={"parallel": _spec().parallel, "checkpoint": checkpoint})
    strategy = make_strategy(
        spec.parallel, resolve_devices(spec, {}, Inventory([], False)), LauncherEnvironment.detect()
    )
    strategy.setup()
    try:
        tracker, saves, taken, seen = RecordingTracker(), Saves(), [], []
        parts = request_stop_in_step(make_parts(spec, tracker, strategy=strategy, on_checkpoint=saves), 3)
        parts.optimizer.register_step_post_hook(lambda *_: taken.append(1))
        logged = tracker.log_metrics

        def log_metrics(metrics: dict[str, float], step: int) -> None:
            seen.append((step, len(taken)))
            logged(metrics, step)

        tracker.log_metrics = log_metrics
        with pytest.raises(Interrupted):
            fit(parts, spec.train, checkpoint_spec=spec.checkpoint)
        return seen, saves.calls
    finally:
        strategy.teardown()


def test_a_log_steps_reduction_overlaps_the_next_step_and_a_stop_in_it_settles_after_that_step() -> None:
    """Under several ranks the logged sums' all-reduce runs while the next step trains (docs/design.md, stopping)."""
    results = elastic_run(_overlapped_logs, WORLD, "overlap")
    assert results[0] == results[1]
    seen, saves = results[0]
    # step 1's values after step 2, and so on; step 4 is a checkpoint step: its log is waited for at once
    assert [(step, at) for step, at in seen if step <= 4] == [(1, 2), (2, 3), (3, 4), (4, 4)], seen
    assert saves == [(4, 0, 4, "step"), (4, 0, 4, "signal")]  # the stop asked in step 3 rode in step 3's log


def test_a_stop_settled_at_a_log_step_logs_that_step_before_its_checkpoint() -> None:
    """Step 3's log carries the stop asked in step 3 and is read after step 4, whose own log is then being reduced:
    it used to be dropped, so train/loss and lr of step 4 were lost and the resume began at step 5."""
    results = elastic_run(_overlapped_logs, WORLD, "stop-at-log", 100)
    assert results[0] == results[1]
    seen, saves = results[0]
    assert [step for step, _ in seen] == [1, 2, 3, 4], seen  # step 4's log too, before the stop's checkpoint
    assert saves == [(4, 0, 4, "signal")]
