"""Metrics of ``[metrics]``: torchmetrics objects per scope, updated on the device, synced across ranks when computed.

Built-in names (torchmetrics classes, arguments passed through, defaults in brackets):
``accuracy`` (``Accuracy``, [average = "micro"]), ``top_k_accuracy`` (``Accuracy`` with
``top_k = k`` [5]), ``f1``, ``precision``, ``recall`` (``F1Score``, ``Precision``, ``Recall``,
[average = "macro"]), ``auroc`` (``AUROC``), ``mae``, ``mse``, ``r2`` (``MeanAbsoluteError``,
``MeanSquaredError``, ``R2Score``). Classification metrics get ``task`` (``"multiclass"``; with
``bce_with_logits`` ``"binary"`` or ``"multilabel"``) and ``num_classes`` / ``num_labels`` from
the data unless the entry sets them. ``"pkg.module:Factory"`` is called with the entry's other
keys and must return a ``torchmetrics.Metric`` whose ``update`` takes ``(prediction, target)``.
``{ output = "aux_loss" }`` logs a scalar of forward's output: its mean over the samples
(``MeanMetric``, each micro-batch weighted by its samples).

Distributed (docs/design.md §13): ``compute()`` gathers every rank's states with torchmetrics'
own sync (sums added, ``cat`` lists gathered without padding), and the eval sampler gives each
validation sample to exactly one rank, so every validation sample counts once. Train metrics
skip torchmetrics' argument checks, which would synchronise a CUDA device on every step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runner.errors import TrainingError, first_line, user_code_error
from runner.spec.names import CLASSIFICATION_LOSSES, logged_name, metric_args, metric_name
from runner.training.models import resolve_factory, spec_issue

if TYPE_CHECKING:
    from torchmetrics import Metric

    from runner.spec.schema import ExperimentSpec
    from runner.training.batches import Batch, BatchIO, ModelOutput
    from runner.training.data import DatasetInfo

_AVERAGE = {"accuracy": "micro", "top_k_accuracy": "micro", "f1": "macro", "precision": "macro", "recall": "macro"}

MetricStates = dict[str, dict[str, dict[str, Any]] | None]
"""Train metric states by window (``"window"``, ``"epoch"``), then metric, then torchmetrics state (tensor or list)."""


@dataclass(frozen=True)
class MetricRecipe:
    """How to make one metric of a scope: its logged name, its spec key, and the forward ``output`` entry it
    averages."""

    name: str
    key: str
    make: Callable[[], Metric]
    output: str | None = None


@dataclass(frozen=True)
class MetricPlan:
    """The metrics of the training batches and of the validation split; ``counted_accuracy`` is the default accuracy,
    counted in the loop's running sums instead of a metric object (no torchmetrics import)."""

    train: tuple[MetricRecipe, ...] = ()
    val: tuple[MetricRecipe, ...] = ()
    counted_accuracy: bool = False


class MetricSet:
    """The metrics of one scope (``train/``, ``train/step_`` or ``val/``) on ``device``, logged under ``prefix``."""

    def __init__(self, recipes: Sequence[MetricRecipe], prefix: str, device: torch.device) -> None:
        self.recipes = tuple(recipes)
        self.prefix = prefix
        self.metrics = [r.make().to(device) for r in self.recipes]

    def __bool__(self) -> bool:
        return bool(self.metrics)

    def add(self, out: ModelOutput, batch: Batch, io: BatchIO) -> None:
        """Add a micro-batch from forward's ``out`` (output metrics take their scalar, weighted by samples);
        TrainingError."""
        if any(r.output is None for r in self.recipes):
            self.update(io.prediction(out), batch.target)
        for recipe, metric in zip(self.recipes, self.metrics, strict=True):
            if recipe.output is not None:
                metric.update(io.scalar(out, recipe.output, recipe.key).to(metric.device), batch.size)

    def update(self, pred: torch.Tensor, target: torch.Tensor | None) -> None:
        """Add ``pred`` (detached) against ``target``; a regression ``(B, 1)`` meets ``(B,)``. TrainingError names
        the metric."""
        if not any(r.output is None for r in self.recipes):
            return
        if target is None:
            raise TrainingError("data.target: metrics need the target: set data.target to the key of the target")
        pred = pred.detach()
        if pred.is_floating_point():
            pred = pred.float()
        if pred.shape != target.shape and pred.numel() == target.numel():
            pred = pred.reshape(target.shape)
        for recipe, metric in zip(self.recipes, self.metrics, strict=True):
            if recipe.output is not None:
                continue
            try:
                metric.update(pred, target)
            except Exception as exc:
                located = user_code_error(exc, recipe.key)  # a custom metric's own bug: its file and line
                if located is not None:
                    raise located from exc
                if not isinstance(exc, (RuntimeError, ValueError, TypeError)):
                    raise
                raise TrainingError(
                    f"{recipe.key}: {recipe.name} could not take a prediction of shape {list(pred.shape)} and a "
                    f"target of shape {list(target.shape)} ({type(exc).__name__}: {first_line(exc)})"
                ) from None

    def compute(self) -> dict[str, float]:
        """Every metric's value over all ranks (a collective), then start afresh; TrainingError for a non-scalar
        value."""
        values: dict[str, float] = {}
        for recipe, metric in zip(self.recipes, self.metrics, strict=True):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method")
                value = metric.compute()
            metric.reset()
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                shown = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise TrainingError(
                    f"{recipe.key}: {recipe.name} gave {shown}, not one number: runner logs one value per metric "
                    '(for per-class values, average = "macro" or "micro")'
                )
            values[self.prefix + recipe.name] = float(value)
        return values

    def state(self) -> dict[str, dict[str, Any]]:
        """The states of metrics that resume exactly (reduced by sum, cat, max or min), summed over ranks, on the
        CPU."""
        from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_min, dim_zero_sum

        exact = (dim_zero_sum, dim_zero_cat, dim_zero_max, dim_zero_min)
        out: dict[str, dict[str, Any]] = {}
        for recipe, metric in zip(self.recipes, self.metrics, strict=True):
            if any(fn not in exact for fn in metric._reductions.values()):  # add_state's dist_reduce_fx, per state
                continue
            with metric.sync_context(should_sync=True, should_unsync=True):
                out[recipe.name] = {k: _to_cpu(getattr(metric, k)) for k in metric._defaults}
        return out

    def load_state(self, states: dict[str, dict[str, Any]]) -> None:
        """Restore :meth:`state` (on one rank only: the states are already summed over ranks)."""
        for recipe, metric in zip(self.recipes, self.metrics, strict=True):
            saved = states.get(recipe.name)
            if saved is None:
                continue
            for key, default in metric._defaults.items():
                value = saved[key]
                if isinstance(default, list):
                    value = [value] if isinstance(value, torch.Tensor) else list(value)
                    setattr(metric, key, [v.to(metric.device) for v in value])
                else:
                    setattr(metric, key, value.to(metric.device))


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return [_to_cpu(v) for v in value]


def build_metric_plan(spec: ExperimentSpec, info: DatasetInfo, spec_dir: Path | str | None) -> MetricPlan:
    """Turn ``[metrics]`` into recipes, each tried once so bad arguments fail before training.

    Without ``[metrics]``, a classification loss on integer labels gets the counted ``accuracy``. Raises SpecError: A
    factory that does not import or returns no ``torchmetrics.Metric``, rejected arguments, or a classification metric
    without a class count."""
    if spec.metrics is None:
        if spec.loss.name in CLASSIFICATION_LOSSES and info.num_classes > 0:
            return MetricPlan(counted_accuracy=True)
        return MetricPlan()
    train = [_recipe(e, f"metrics.train[{i}]", spec, info, spec_dir, True) for i, e in enumerate(spec.metrics.train)]
    val = [_recipe(e, f"metrics.val[{i}]", spec, info, spec_dir, False) for i, e in enumerate(spec.metrics.val)]
    return MetricPlan(tuple(train), tuple(val))


def check_metric_names(spec: ExperimentSpec, spec_dir: Path | str | None) -> None:
    """Check before the run exists that every ``pkg.module:Factory`` of ``[metrics]`` imports (SpecError at its
    entry)."""
    if spec.metrics is None:
        return
    for scope, entries in (("train", spec.metrics.train), ("val", spec.metrics.val)):
        for i, entry in enumerate(entries):
            if ":" in metric_name(entry):
                resolve_factory(metric_name(entry), spec_dir, f"metrics.{scope}[{i}]")


def _recipe(
    entry: str | dict[str, Any],
    key: str,
    spec: ExperimentSpec,
    info: DatasetInfo,
    spec_dir: Path | str | None,
    train: bool,
) -> MetricRecipe:
    name, args = metric_name(entry), metric_args(entry)
    output = entry.get("output") if isinstance(entry, dict) else None
    if isinstance(output, str):
        from torchmetrics import MeanMetric

        return MetricRecipe(logged_name(entry), key, MeanMetric, output)
    if ":" in name:
        factory = resolve_factory(name, spec_dir, key)

        def make() -> Metric:
            return factory(**args)

    else:
        make = _builtin(name, args, key, spec.loss.name, info, train)
    recipe = MetricRecipe(logged_name(entry), key, make)
    _try(recipe, name)
    return recipe


def _builtin(
    name: str, args: dict[str, Any], key: str, loss: str, info: DatasetInfo, train: bool
) -> Callable[[], Metric]:
    import torchmetrics as tm

    regression = {"mae": tm.MeanAbsoluteError, "mse": tm.MeanSquaredError, "r2": tm.R2Score}
    if name in regression:
        return lambda: regression[name](**args)
    classes: dict[str, Any] = {"accuracy": tm.Accuracy, "top_k_accuracy": tm.Accuracy, "f1": tm.F1Score}
    classes |= {"precision": tm.Precision, "recall": tm.Recall, "auroc": tm.AUROC}
    kwargs = dict(args)
    if name == "top_k_accuracy":
        kwargs["top_k"] = kwargs.pop("k", 5)
    binary = info.target_shape in ((), (1,))
    kwargs.setdefault("task", "multiclass" if loss != "bce_with_logits" else "binary" if binary else "multilabel")
    if name in _AVERAGE:
        kwargs.setdefault("average", _AVERAGE[name])
    if kwargs["task"] == "multiclass" and "num_classes" not in kwargs:
        if info.num_classes <= 0:
            raise spec_issue(key, f"{name} needs the number of classes, which the data does not tell: add num_classes")
        kwargs["num_classes"] = info.num_classes
    if kwargs["task"] == "multilabel" and "num_labels" not in kwargs:
        kwargs["num_labels"] = info.target_shape[-1] if info.target_shape else 1
    if train:
        kwargs.setdefault("validate_args", False)  # its checks read tensors on the host: a CUDA sync per step
    return lambda: classes[name](**kwargs)


def _try(recipe: MetricRecipe, name: str) -> None:
    """Make the metric once, so that arguments torchmetrics rejects are a spec error before training."""
    from torchmetrics import Metric

    try:
        made = recipe.make()
    except (TypeError, ValueError) as exc:
        raise spec_issue(recipe.key, f"{name} rejected its arguments: {first_line(exc)}") from None
    if not isinstance(made, Metric):
        raise spec_issue(recipe.key, f"{name!r} returned a {type(made).__name__}, not a torchmetrics.Metric")
