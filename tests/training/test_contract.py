"""The model contract, piece by piece: batches, outputs, losses, torchmetrics metrics, non-finite flags, BatchNorm batches."""

from __future__ import annotations

import dataclasses
import math
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from runner.devices.inventory import Inventory
from runner.devices.resolve import resolve_devices
from runner.errors import SpecError, TrainingError
from runner.spec.loading import spec_from_dict
from runner.strategies.base import (
    SingleDevice,
    _chunk_size,
    _GatherCheckedDataParallel,
    as_gatherable,
    combine_replica_losses,
)
from runner.training.batches import BatchIO
from runner.training.data import DatasetInfo
from runner.training.losses import build_loss
from runner.training.metrics import MetricSet, build_metric_plan
from runner.training.sampling import build_loaders, check_batchnorm_batches, one_sample_batches
from runner.training.sums import NonFiniteGuard, RunningSums

CPU = torch.device("cpu")
Pair = namedtuple("Pair", "logits aux")


@dataclasses.dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


def spec(**tables: Any):
    base = {
        "name": "t",
        "model": {"name": "mlp"},
        "data": {"dataset": "synthetic", "batch_size": 8, "num_samples": 40, "input_shape": [4], "num_classes": 3},
        "devices": {"accelerator": "cpu"},
        "optim": {"lr": 0.1},
    }
    for key, value in tables.items():
        base[key] = {**base.get(key, {}), **value}
    return spec_from_dict(base)


def info(num_classes: int = 3, target_shape: tuple[int, ...] = ()) -> DatasetInfo:
    return DatasetInfo((4,), num_classes, 32, 8, "synthetic", target_shape)


# --------------------------------------------------------------------------- batches and outputs


def test_a_dict_batch_is_moved_whole_and_the_model_gets_it_without_the_target() -> None:
    io = BatchIO("labels", "logits", model_loss=False)
    batch = io.prepare({"pixels": torch.ones(5, 4), "mask": torch.zeros(5, 4), "labels": torch.arange(5)}, CPU, CPU)
    assert set(batch.inputs) == {"pixels", "mask"} and batch.size == 5
    assert torch.equal(batch.target, torch.arange(5))
    seen = {}

    class Model(nn.Module):
        def forward(self, pixels, mask):
            seen.update(pixels=pixels, mask=mask)
            return {"logits": pixels + mask}

    out = io.forward(Model(), batch)
    assert set(seen) == {"pixels", "mask"} and io.prediction(out).shape == (5, 4)


def test_with_a_model_loss_forward_gets_the_targets_too() -> None:
    dict_io = BatchIO("labels", None, model_loss=True)
    batch = dict_io.prepare({"pixels": torch.ones(3, 2), "labels": torch.arange(3)}, CPU, CPU)
    assert set(batch.inputs) == {"pixels", "labels"}
    pair_io = BatchIO(None, None, model_loss=True)
    pair = pair_io.prepare((torch.ones(3, 2), torch.arange(3)), CPU, CPU)
    calls = []

    class Model(nn.Module):
        def forward(self, x, y):
            calls.append((x.shape, y.tolist()))
            return x.sum() * 0 + 1.5

    loss = pair_io.loss_of(pair_io.forward(Model(), pair))
    assert calls == [((3, 2), [0, 1, 2])] and float(loss) == 1.5


@pytest.mark.parametrize(
    ("out", "output", "expect"),
    [
        ({"loss": None, "logits": torch.ones(2, 3)}, "logits", (2, 3)),
        (Output(None, torch.ones(2, 3)), "logits", (2, 3)),
        (Pair(torch.ones(2, 3), torch.zeros(1)), 0, (2, 3)),
        (Pair(torch.ones(2, 3), torch.zeros(1)), "logits", (2, 3)),
        ((torch.zeros(1), torch.ones(2, 3)), -1, (2, 3)),
        (torch.ones(2, 3), None, (2, 3)),
    ],
)
def test_model_output_picks_the_prediction_by_key_attribute_or_index(out: Any, output: Any, expect: tuple) -> None:
    assert tuple(BatchIO(None, output, model_loss=False).prediction(out).shape) == expect


@pytest.mark.parametrize(
    ("out", "output", "fragments"),
    [
        (
            {"loss": None, "logits": torch.ones(2)},
            None,
            ("a dict with keys ['loss', 'logits']", 'model.output = "logits"'),
        ),
        (Output(None, torch.ones(2)), None, ("a dataclass Output with fields ['loss', 'logits']", "model.output")),
        ((torch.ones(2), torch.ones(2)), None, ("a tuple of 2 items", "model.output = 0")),
        ({"logits": torch.ones(2)}, "logit", ("has no entry 'logit'", "model.output")),
        ((torch.ones(2),), 3, ("has no entry 3",)),
        ({"logits": "text"}, "logits", ("is a str, not a tensor",)),
    ],
)
def test_an_output_without_a_usable_prediction_names_what_forward_returned(out: Any, output: Any, fragments) -> None:
    with pytest.raises(TrainingError) as err:
        BatchIO(None, output, model_loss=False).prediction(out)
    text = str(err.value)
    assert text.startswith("model.output: ")
    for fragment in fragments:
        assert fragment in text


@pytest.mark.parametrize(
    ("out", "fragment"),
    [
        ({"logits": torch.ones(2, 3)}, "returned a dict with keys ['logits']"),
        (torch.ones(4), "a loss of shape [4]"),
        (Output(None, torch.ones(2)), "returned a dataclass Output"),
    ],
)
def test_a_model_loss_that_is_missing_or_not_a_scalar_names_loss_name(out: Any, fragment: str) -> None:
    with pytest.raises(TrainingError) as err:
        BatchIO(None, None, model_loss=True).loss_of(out)
    assert str(err.value).startswith("loss.name: ") and fragment in str(err.value)


def test_hugging_face_style_loss_entries_are_found_by_key_and_attribute() -> None:
    io = BatchIO(None, "logits", model_loss=True)
    assert float(io.loss_of({"loss": torch.tensor(2.0), "logits": torch.ones(1)})) == 2.0
    assert float(io.loss_of(Output(torch.tensor(3.0), torch.ones(1)))) == 3.0


# --------------------------------------------------------------------------- losses: sums over samples


def _batch(io: BatchIO, x: torch.Tensor, y: torch.Tensor):
    return io.prepare((x, y), CPU, CPU)


def _mean(loss: Any, pred: torch.Tensor, batch: Any, io: BatchIO) -> torch.Tensor:
    return loss(pred, batch, io) / loss.count(batch)


def test_builtin_losses_divided_by_their_count_are_pytorchs_default_mean() -> None:
    io = BatchIO(None, None, model_loss=False)
    pred, target = torch.randn(6, 3), torch.randn(6, 3)
    mse = build_loss(spec(loss={"name": "mse"}).loss, None)
    assert torch.allclose(_mean(mse, pred, _batch(io, torch.zeros(6, 1), target), io).float(), F.mse_loss(pred, target))
    logits, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    ce = build_loss(spec(loss={"name": "cross_entropy", "kwargs": {"label_smoothing": 0.1}}).loss, None)
    expected = F.cross_entropy(logits, labels, label_smoothing=0.1, reduction="sum")
    assert torch.equal(ce(logits, _batch(io, torch.zeros(6, 1), labels), io), expected)
    bce = build_loss(spec(loss={"name": "bce_with_logits", "kwargs": {"pos_weight": [2.0, 1.0, 1.0]}}).loss, None)
    multi = (torch.rand(6, 3) > 0.5).float()
    got = _mean(bce, pred, _batch(io, torch.zeros(6, 1), multi), io).float()
    weight = torch.tensor([2.0, 1.0, 1.0])
    assert torch.allclose(got, F.binary_cross_entropy_with_logits(pred, multi, pos_weight=weight))


def test_a_sequence_models_loss_counts_each_token_as_pytorch_does() -> None:
    """A language model's nll was summed per sequence (35x F.nll_loss for 35 tokens): now it is the token mean,
    ignored positions and class weights counted as PyTorch's mean counts them."""
    io = BatchIO(None, None, model_loss=False)
    tokens = torch.randint(0, 5, (4, 35))
    tokens[0, :7] = -100
    flat = torch.log_softmax(torch.randn(4 * 35, 5), dim=1)  # word_language_model's (batch * time, ntoken)
    nll = build_loss(spec(loss={"name": "nll"}).loss, None)
    batch = _batch(io, torch.zeros(4, 1), tokens)
    assert torch.allclose(_mean(nll, flat, batch, io).float(), F.nll_loss(flat, tokens.reshape(-1)))
    assert nll.count(batch) == 4 * 35 - 7
    by_class = torch.randn(4, 5, 35)  # (batch, classes, time) as F.cross_entropy takes it
    weights = [1.0, 2.0, 0.5, 1.0, 3.0]
    ce = build_loss(spec(loss={"name": "cross_entropy", "kwargs": {"weight": weights}}).loss, None)
    expected = F.cross_entropy(by_class, tokens, weight=torch.tensor(weights))
    assert torch.allclose(_mean(ce, by_class, batch, io).float(), expected)
    soft = torch.softmax(torch.randn(4, 5, 35), dim=1)
    soft_batch = _batch(io, torch.zeros(4, 1), soft)
    assert torch.allclose(
        _mean(ce, by_class, soft_batch, io).float(), F.cross_entropy(by_class, soft, torch.tensor(weights))
    )


def test_a_target_out_of_bounds_names_num_classes_and_the_datasets_classes() -> None:
    io = BatchIO(None, None, model_loss=False)
    loss = build_loss(spec().loss, None)
    loss.dataset_classes = 10
    with pytest.raises(TrainingError) as err:
        loss(torch.randn(4, 3), _batch(io, torch.zeros(4, 1), torch.tensor([0, 6, 1, 2])), io)
    assert str(err.value).startswith(
        "model.kwargs.num_classes: the target holds class 6, but the model gives 3 outputs"
    )
    assert "the dataset has 10 classes" in str(err.value) and "set model.kwargs.num_classes = 10" in str(err.value)


def test_a_regression_prediction_that_does_not_fit_the_target_says_how_to_fix_it() -> None:
    io = BatchIO(None, None, model_loss=False)
    loss = build_loss(spec(loss={"name": "mse"}).loss, None)
    with pytest.raises(TrainingError, match=r"loss.name: .*num_classes = 1"):
        loss(torch.randn(4, 10), _batch(io, torch.zeros(4, 1), torch.randn(4)), io)


def test_the_same_samples_give_the_same_gradient_however_they_are_split() -> None:
    """The sum-over-samples contract: two halves, each its mean times its samples, add up to the whole."""
    for name in ("model", "tests_loss_mod:mean_abs"):
        io = BatchIO(None, None, model_loss=name == "model")
        x, y = torch.randn(7, 2), torch.randn(7)
        out = (lambda xs, ys: (xs.sum(1) - ys).abs().mean()) if name == "model" else (lambda xs, ys: xs.sum(1))
        loss = build_loss(spec(loss={"name": name}).loss, _write_loss_module())

        def total(xs: torch.Tensor, ys: torch.Tensor, out=out, loss=loss, io=io) -> torch.Tensor:
            return loss(out(xs, ys), _batch(io, xs, ys), io)

        whole = total(x, y)
        parts = total(x[:3], y[:3]) + total(x[3:], y[3:])
        assert torch.allclose(whole, parts, atol=1e-6), name


def _write_loss_module():
    import sys
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    (folder / "tests_loss_mod.py").write_text(
        "def mean_abs(pred, target):\n    return (pred - target).abs().mean()\n\n"
        "def per_sample(pred, target):\n    return (pred - target).abs()\n\n"
        "def weighted(pred, target, weight):\n    return weight * (pred - target).abs().mean()\n"
    )
    sys.modules.pop("tests_loss_mod", None)
    return folder


def test_a_custom_loss_must_return_a_scalar_and_take_its_kwargs() -> None:
    folder = _write_loss_module()
    io = BatchIO(None, None, model_loss=False)
    loss = build_loss(spec(loss={"name": "tests_loss_mod:per_sample"}).loss, folder)
    with pytest.raises(TrainingError, match=r"loss.name: 'tests_loss_mod:per_sample' returned a tensor of shape \[4\]"):
        loss(torch.randn(4), _batch(io, torch.zeros(4, 1), torch.randn(4)), io)
    with pytest.raises(SpecError, match=r"loss.kwargs"):
        build_loss(spec(loss={"name": "tests_loss_mod:weighted", "kwargs": {"wieght": 2.0}}).loss, folder)
    with pytest.raises(SpecError, match=r"loss.name: .*no attribute 'nope'"):
        build_loss(spec(loss={"name": "tests_loss_mod:nope"}).loss, folder)
    with pytest.raises(SpecError, match=r"loss.kwargs: cross_entropy"):
        build_loss(spec(loss={"name": "cross_entropy", "kwargs": {"smoothing": 0.1}}).loss, None)


def test_a_loss_whose_signature_names_output_and_batch_gets_all_forward_returned_and_the_whole_batch(tmp_path) -> None:
    import sys

    (tmp_path / "aux_loss_mod.py").write_text(
        "import torch.nn.functional as F\n\n"
        "def with_aux(output, batch, weight=0.5):\n"
        "    return F.cross_entropy(output['logits'], batch['labels']) + weight * output['aux_loss']\n\n"
        "def no_target(output):\n    return output['aux_loss']\n"
    )
    sys.modules.pop("aux_loss_mod", None)
    io = BatchIO("labels", "logits", model_loss=False)
    batch = io.prepare({"pixels": torch.randn(4, 3), "labels": torch.tensor([0, 1, 2, 0])}, CPU, CPU)
    assert set(io.whole(batch)) == {"pixels", "labels"}  # the target key too
    out = {"logits": torch.randn(4, 3), "aux_loss": torch.tensor(2.0)}
    loss = build_loss(spec(loss={"name": "aux_loss_mod:with_aux", "kwargs": {"weight": 0.25}}).loss, tmp_path)
    expected = torch.nn.functional.cross_entropy(out["logits"], batch.target) + 0.25 * 2.0
    assert float(loss(out, batch, io)) == pytest.approx(float(expected) * 4)  # the batch mean times its samples
    assert loss.needs_target is False  # it reads the target out of the batch itself: data.target may stay unset
    with pytest.raises(SpecError, match=r"loss.kwargs: .*function\(output=\.\.\., batch=\.\.\., \*\*loss.kwargs\)"):
        build_loss(spec(loss={"name": "aux_loss_mod:with_aux", "kwargs": {"wieght": 1.0}}).loss, tmp_path)


def test_an_output_metric_logs_the_sample_weighted_mean_of_a_scalar_forward_returns() -> None:
    s = spec(metrics={"val": ["accuracy", {"output": "aux_loss"}, {"output": "aux_loss", "log_as": "aux"}]})
    recipes = build_metric_plan(s, info(3), None).val
    assert [(r.name, r.output) for r in recipes] == [("accuracy", None), ("aux_loss", "aux_loss"), ("aux", "aux_loss")]
    io = BatchIO(None, "logits", model_loss=False)
    metrics = MetricSet(recipes, "val/", CPU)
    for size, aux in ((3, 1.0), (1, 5.0)):
        batch = io.prepare((torch.randn(size, 4), torch.zeros(size, dtype=torch.long)), CPU, CPU)
        metrics.add({"logits": torch.randn(size, 3), "aux_loss": torch.tensor(aux)}, batch, io)
    values = metrics.compute()
    assert values["val/aux_loss"] == values["val/aux"] == pytest.approx((3 * 1.0 + 1 * 5.0) / 4)
    assert "val/accuracy" in values
    batch = io.prepare((torch.randn(2, 4), torch.zeros(2, dtype=torch.long)), CPU, CPU)
    with pytest.raises(TrainingError, match=r"metrics.val\[1\]: output = 'aux_loss', but forward returned a dict"):
        metrics.add({"logits": torch.randn(2, 3)}, batch, io)
    with pytest.raises(SpecError, match=r"an output metric takes output"):
        spec(metrics={"train": [{"output": "aux_loss", "k": 1}]})


# --------------------------------------------------------------------------- metrics


def test_without_a_metrics_table_classification_keeps_accuracy_and_regression_has_none() -> None:
    plan = build_metric_plan(spec(), info(), None)
    assert plan.counted_accuracy and plan.train == plan.val == ()  # accuracy is counted in the loop's sums
    assert not build_metric_plan(spec(loss={"name": "mse"}), info(0), None).counted_accuracy
    assert build_metric_plan(spec(loss={"name": "mse"}), info(0), None).val == ()


def test_builtin_metrics_get_the_task_and_classes_from_the_data() -> None:
    s = spec(metrics={"val": ["accuracy", {"name": "top_k_accuracy", "k": 2}, "f1", "auroc"]})
    metrics = MetricSet(build_metric_plan(s, info(3), None).val, "val/", CPU)
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 2.0], [2.0, 0.0, 1.0]])
    labels = torch.tensor([0, 2, 2, 2])
    metrics.update(logits, labels)
    values = metrics.compute()
    assert values["val/accuracy"] == pytest.approx(0.5)
    assert values["val/top_k_accuracy"] == pytest.approx(1.0)  # every label is in the top 2
    assert set(values) == {"val/accuracy", "val/top_k_accuracy", "val/f1", "val/auroc"}
    with pytest.raises(SpecError, match=r"metrics.val\[0\]: accuracy needs the number of classes"):
        build_metric_plan(s, info(0), None)
    with pytest.raises(SpecError, match=r"metrics.val\[2\]: f1 rejected its arguments"):
        build_metric_plan(spec(metrics={"val": ["mae", "r2", {"name": "f1", "average": "bogus"}]}), info(3), None)


def test_regression_metrics_take_a_single_output_column() -> None:
    metrics = MetricSet(build_metric_plan(spec(metrics={"val": ["mae", "mse", "r2"]}), info(0), None).val, "v/", CPU)
    pred, target = torch.tensor([[1.0], [2.0], [4.0]]), torch.tensor([1.0, 3.0, 3.0])
    metrics.update(pred, target)
    values = metrics.compute()
    assert values["v/mae"] == pytest.approx(2 / 3) and values["v/mse"] == pytest.approx(2 / 3)
    assert values["v/r2"] == pytest.approx(1 - 2 / (8 / 3), rel=1e-5)


def test_a_factory_must_return_a_torchmetrics_metric(tmp_path) -> None:
    (tmp_path / "user_metrics.py").write_text(
        "import torchmetrics\n\ndef total():\n    return torchmetrics.SumMetric()\n\ndef not_metric():\n    return 3\n"
    )
    plan = build_metric_plan(spec(metrics={"val": ["user_metrics:total"]}), info(), tmp_path)
    assert [r.name for r in plan.val] == ["total"]
    with pytest.raises(SpecError, match=r"metrics.train\[0\]: 'user_metrics:not_metric' returned a int"):
        build_metric_plan(spec(metrics={"train": ["user_metrics:not_metric"]}), info(), tmp_path)


def test_metric_states_resume_exactly_where_their_reductions_allow(tmp_path) -> None:
    (tmp_path / "mean_metric.py").write_text(
        "import torch, torchmetrics\n\nclass Avg(torchmetrics.Metric):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.add_state('v', default=torch.tensor(0.0), dist_reduce_fx='mean')\n"
        "    def update(self, p, t):\n        self.v = p.float().mean()\n"
        "    def compute(self):\n        return self.v\n"
    )
    s = spec(metrics={"train": ["accuracy", "auroc", "mean_metric:Avg"]})
    recipes = build_metric_plan(s, info(3), tmp_path).train
    logits, labels = torch.randn(10, 3, generator=torch.Generator().manual_seed(0)), torch.arange(10) % 3
    whole = MetricSet(recipes, "train/", CPU)
    whole.update(logits, labels)
    first = MetricSet(recipes, "train/", CPU)
    first.update(logits[:4], labels[:4])
    saved = first.state()
    assert set(saved) == {"accuracy", "auroc"}  # a mean-reduced state cannot resume exactly: it restarts
    resumed = MetricSet(recipes, "train/", CPU)
    resumed.load_state(saved)
    resumed.update(logits[4:], labels[4:])
    a, b = whole.compute(), resumed.compute()
    assert a["train/accuracy"] == b["train/accuracy"] and a["train/auroc"] == b["train/auroc"]


def test_a_metric_that_does_not_give_one_number_is_named() -> None:
    s = spec(metrics={"val": [{"name": "f1", "average": "none"}]})
    metrics = MetricSet(build_metric_plan(s, info(3), None).val, "val/", CPU)
    metrics.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(TrainingError, match=r"metrics.val\[0\]: f1 gave \[3\], not one number"):
        metrics.compute()


# --------------------------------------------------------------------------- non-finite losses and gradients


class _OneRank(SingleDevice):
    def __init__(self) -> None:
        super().__init__(resolve_devices(spec(), {}, Inventory([], False)))


def _steps(guard: NonFiniteGuard, sums: RunningSums, steps: list[tuple[float, float]]) -> None:
    for loss, norm in steps:
        sums.add(torch.tensor(loss), 1)
        sums.add_norm(torch.tensor(norm))
        guard.end_step(sums.sums)


def test_the_guard_names_the_first_non_finite_step_and_what_was_not_finite() -> None:
    strategy, sums = _OneRank(), RunningSums(CPU)
    guard = NonFiniteGuard("stop", CPU, step=10, window=4)
    _steps(guard, sums, [(1.0, 1.0), (2.0, math.inf), (math.nan, 1.0)])  # steps 11, 12, 13
    reduced = sums.reduced_sums(strategy)
    assert math.isfinite(reduced[0]) is False and reduced[2] == 3
    with pytest.raises(TrainingError, match=r'"stop": the gradient norm was not finite at step 12 .*clip_grad_norm'):
        guard.check(reduced, strategy, "a test")


def test_the_guard_counts_steps_across_windows() -> None:
    strategy, guard = _OneRank(), NonFiniteGuard("stop", CPU, step=0, window=2)
    first = RunningSums(CPU)
    _steps(guard, first, [(1.0, 0.0), (1.0, 0.0)])  # steps 1, 2: logged
    guard.check(first.reduced_sums(strategy), strategy, "a test")
    guard.new_window()
    second = RunningSums(CPU)
    _steps(guard, second, [(1.0, 0.0), (math.inf, 0.0)])  # steps 3, 4
    with pytest.raises(TrainingError, match=r"the loss was not finite at step 4 "):
        guard.check(second.reduced_sums(strategy), strategy, "a test")


def test_warn_reports_once_and_ignore_checks_nothing(capsys) -> None:
    strategy, sums = _OneRank(), RunningSums(CPU)
    guard = NonFiniteGuard("warn", CPU, step=0, window=3)
    _steps(guard, sums, [(math.inf, 0.0)])
    guard.check(sums.reduced_sums(strategy), strategy, "a test")
    guard.check(sums.reduced_sums(strategy), strategy, "a test")  # the same step again: already reported
    assert capsys.readouterr().err.count("the loss was not finite at step 1") == 1
    ignore = NonFiniteGuard("ignore", CPU, step=0)
    ignore.end_step(sums.sums)
    ignore.check([math.nan, math.nan, 1.0], strategy, "a test")  # checks nothing, raises nothing
    assert capsys.readouterr().err == ""


def test_non_finite_weights_are_never_checkpointed(capsys) -> None:
    strategy, model = _OneRank(), nn.Linear(2, 2)
    assert NonFiniteGuard("stop", CPU, 0).weights_finite(model.parameters(), strategy, 3)
    with torch.no_grad():
        model.weight[0, 0] = math.nan
    with pytest.raises(TrainingError, match="the weights are not finite at step 3"):
        NonFiniteGuard("stop", CPU, 0).weights_finite(model.parameters(), strategy, 3)
    assert not NonFiniteGuard("warn", CPU, 0).weights_finite(model.parameters(), strategy, 3)
    assert "no checkpoint at step 3" in capsys.readouterr().err
    assert NonFiniteGuard("ignore", CPU, 0).weights_finite(model.parameters(), strategy, 3)


# --------------------------------------------------------------------------- BatchNorm meeting one sample


def test_one_sample_batches_follow_the_batch_arithmetic() -> None:
    from runner.training.data import build_datasets

    s = spec(data={"val_fraction": 0.25, "num_samples": 41})  # 31 training samples: batches 8, 8, 8, 7
    loaders = build_loaders(s, build_datasets(s, None), 0, 1)
    assert one_sample_batches(loaders, 1) == []
    assert one_sample_batches(loaders, 1, replicas=4) == [(7, 0, "DataParallel chunk")]  # torch.chunk: 2, 2, 2, 1
    ddp = spec(data={"val_fraction": 0.0, "num_samples": 35})  # batches 8 x 4, then 3: ranks get 2 and 1
    assert one_sample_batches(build_loaders(ddp, build_datasets(ddp, None), 0, 2), 2) == [(3, 1, "micro-batch")]


def test_a_batchnorm_model_that_would_meet_one_sample_is_refused_before_training() -> None:
    from runner.training.data import build_datasets

    s = spec(data={"num_samples": 41, "val_fraction": 0.0, "batch_size": 8})  # 41 = 5 x 8 + 1
    loaders = build_loaders(s, build_datasets(s, None), 0, 1)
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(SpecError) as err:
        check_batchnorm_batches(bn, s, loaders, 1, 1)
    (issue,) = err.value.issues
    assert issue.key == "data.batch_size"
    assert "BatchNorm layers ('1')" in issue.message and "final batch of 1" in issue.message
    assert "data.drop_last = true" in issue.message
    check_batchnorm_batches(nn.Linear(4, 4), s, loaders, 1, 1)  # no BatchNorm: nothing to say
    dropped = spec(data={"num_samples": 41, "val_fraction": 0.0, "batch_size": 8, "drop_last": True})
    check_batchnorm_batches(bn, dropped, build_loaders(dropped, build_datasets(dropped, None), 0, 1), 1, 1)


# --------------------------------------------------------------------------- DataParallel's output contract


def test_dataparallel_outputs_dataclasses_as_dicts_and_weighs_replica_losses() -> None:
    assert as_gatherable(Output(None, torch.ones(1))) == {"loss": None, "logits": torch.ones(1)}
    assert as_gatherable(Pair(1, 2)) == Pair(1, 2)
    losses = [torch.tensor(1.0, requires_grad=True), torch.tensor(4.0, requires_grad=True)]
    combined = combine_replica_losses(losses, [3, 1], CPU)
    assert float(combined.detach()) == pytest.approx((3 * 1.0 + 1 * 4.0) / 4)
    combined.backward()
    assert [float(p.grad) for p in losses] == [0.75, 0.25]
    wrapper = _GatherCheckedDataParallel(nn.Linear(2, 2))
    wrapper._chunk_sizes = [3, 1]
    assert float(wrapper.gather([torch.tensor(1.0), torch.tensor(4.0)], CPU)) == pytest.approx(1.75)
    wrapper.dim = 0  # DataParallel without CUDA sets no dim (and gathers no CPU tensor: scalars only here)
    replicas = [
        {"loss": torch.tensor(2.0), "aux_loss": torch.tensor(1.0)},
        {"loss": torch.tensor(2.0), "aux_loss": torch.tensor(4.0)},
    ]
    gathered = wrapper.gather(replicas, CPU)  # every scalar entry is a chunk mean: weighted like the loss
    assert list(gathered) == ["loss", "aux_loss"] and float(gathered["loss"]) == pytest.approx(2.0)
    assert float(gathered["aux_loss"]) == pytest.approx(1.75)
    assert _chunk_size((torch.zeros(3, 2),), {}, 0) == 3 and _chunk_size((), {"x": torch.zeros(2, 5)}, 1) == 5


# --------------------------------------------------------------------------- data: dict samples, diabetes


def test_diabetes_is_a_real_offline_regression_set() -> None:
    from runner.training.data import build_datasets

    bundle = build_datasets(spec(data={"dataset": "sklearn.diabetes", "val_fraction": 0.2}), None)
    info = bundle.info
    assert (info.input_shape, info.target_shape, info.num_classes) == ((10,), (), 0)
    assert (info.num_train, info.num_val) == (354, 88)
    x, y = bundle.train[0]
    assert x.dtype == y.dtype == torch.float32 and 25 <= float(y) <= 346
    with pytest.raises(SpecError, match=r"data.kwargs: sklearn.diabetes does not take \['scale'\]"):
        build_datasets(spec(data={"dataset": "sklearn.diabetes", "kwargs": {"scale": True}}), None)


def test_dict_samples_need_the_target_key_their_loss_or_metrics_use(tmp_path) -> None:
    from runner.training.batches import check_target
    from runner.training.data import build_datasets

    (tmp_path / "dict_data.py").write_text(
        "import torch\n\ndef make(n=12):\n"
        "    return [{'x': torch.randn(3), 'labels': torch.tensor(i % 2)} for i in range(n)]\n"
    )
    good = spec(data={"dataset": "dict_data:make", "target": "labels"})
    info = build_datasets(good, tmp_path).info
    assert (info.keys, info.input_shape, info.num_classes) == (("x", "labels"), (3,), 2)
    with pytest.raises(SpecError, match=r"data.target: dict_data:make yields dicts with keys \['x', 'labels'\], none"):
        build_datasets(spec(data={"dataset": "dict_data:make", "target": "label"}), tmp_path)
    with pytest.raises(SpecError, match=r'none of them \'label\' \(did you mean "labels"\?\)'):
        build_datasets(spec(data={"dataset": "dict_data:make", "target": "label"}), tmp_path)
    missing = spec(data={"dataset": "dict_data:make"})
    with pytest.raises(SpecError, match=r'data.target: .*set data.target to its key, e.g. data.target = "labels"'):
        check_target(build_datasets(missing, tmp_path).info, missing, needs=True)
    (tmp_path / "dict_data_label.py").write_text(
        "import torch\n\ndef make(n=12):\n    return [{'x': torch.randn(3), 'label': torch.tensor(i % 2)} for i in range(n)]\n"
    )
    singular = spec(data={"dataset": "dict_data_label:make"})
    with pytest.raises(SpecError, match=r'e.g. data.target = "label"'):  # the dataset's own key, not a guess
        check_target(build_datasets(singular, tmp_path).info, singular, needs=True)
    check_target(build_datasets(missing, tmp_path).info, missing, needs=False)  # a model-computed loss, no metrics
    with pytest.raises(SpecError, match=r"data.target: synthetic yields \(x, y\) pairs"):
        build_datasets(spec(data={"target": "labels"}), None)


def test_model_batch_dim_gives_a_sequence_first_model_its_layout_and_counts_the_same() -> None:
    tokens, labels = torch.randint(0, 7, (4, 12)), torch.randint(0, 7, (4, 12))
    first = BatchIO(None, None, model_loss=False, batch_dim=1).prepare((tokens, labels), CPU, CPU)
    assert first.size == 4 and torch.equal(first.inputs, tokens.T) and torch.equal(first.target, labels.T)
    as_dict = BatchIO("y", None, model_loss=False, batch_dim=1).prepare({"x": tokens, "y": labels}, CPU, CPU)
    assert as_dict.size == 4 and torch.equal(as_dict.inputs["x"], tokens.T) and torch.equal(as_dict.target, labels.T)
    flat = torch.log_softmax(torch.randn(12 * 4, 7), dim=1)  # (time * batch, classes), time-major
    nll = build_loss(spec(loss={"name": "nll"}).loss, None)
    io = BatchIO(None, None, model_loss=False, batch_dim=1)
    assert torch.allclose(_mean(nll, flat, first, io).float(), F.nll_loss(flat, labels.T.reshape(-1)))
    from runner.training.sums import count_correct

    assert count_correct(flat, first.target) == (flat.argmax(1) == labels.T.reshape(-1)).sum()
