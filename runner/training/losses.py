"""Losses of ``[loss]``: a torch.nn loss, the model's own loss, or a user's function, each a sum with the count
PyTorch's mean would divide it by.

Every loss here returns the SUM of its losses over one micro-batch and, from the batch alone
(before the forward), the count PyTorch's ``reduction="mean"`` divides by; the loop divides the
step's sums by the global count (docs/design.md §3), so ``none``, ``dp``, ``ddp`` and ``fsdp`` give the
gradient of the same global mean, and the logged loss is what the named loss gives by default:

* built-in losses run with ``reduction="sum"``; an element-wise loss (``mse``, ``l1``, ``smooth_l1``,
  ``bce_with_logits``) counts its values; ``cross_entropy``/``nll`` count their labels (positions of a
  sequence included: a ``(batch * time, classes)`` prediction takes ``(batch, time)`` labels
  flattened, as word_language_model flattens them), or the samples and positions of class
  probabilities. With ``weight`` or ``ignore_index`` in ``loss.kwargs``, or labels per position, the
  count leaves out ``ignore_index`` (-100 by default) and weighs each label by its class weight, as
  torch does; plain labels count each sample, so a classification step needs no collective (a
  plain label of -100 then adds nothing to the sum but counts: give ``ignore_index = -100`` in
  ``loss.kwargs`` to leave such labels out of the count too);
* a model-computed loss (``loss.name = "model"``) and a custom function return the MEAN over
  their micro-batch; runner multiplies it by the micro-batch's sample count and counts its
  samples, so a micro-batch weighs what its samples do. This is exact when the mean is a plain
  mean over samples.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from runner.errors import SpecError, SpecIssue, TrainingError, did_you_mean, first_line, with_hint
from runner.training.metrics import check_metric_names
from runner.training.models import parameter_names, resolve_factory, spec_issue

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from runner.spec.names import LossSpec
    from runner.spec.schema import ExperimentSpec
    from runner.spec.schema_loop import OptimSpec, SchedulerSpec
    from runner.training.batches import Batch, BatchIO, ModelOutput


PER_SAMPLE: dict[str, type[nn.Module]] = {"cross_entropy": nn.CrossEntropyLoss, "nll": nn.NLLLoss}
ELEMENTWISE: dict[str, type[nn.Module]] = {
    "mse": nn.MSELoss,
    "l1": nn.L1Loss,
    "smooth_l1": nn.SmoothL1Loss,
    "bce_with_logits": nn.BCEWithLogitsLoss,
}
_TENSOR_KWARGS = ("weight", "pos_weight")  # TOML lists that torch wants as tensors
# Parameter names that make a loss function called by keyword (with "output" or "batch" among them).
WHOLE = ("output", "batch", "prediction", "target")


def _named_parameters(function: Callable[..., Any]) -> set[str]:
    """The parameter names of ``function`` when they include ``output`` or ``batch``, else the empty set."""
    names = parameter_names(function)
    return names if names & {"output", "batch"} else set()


class Loss:
    """A loss as the loop calls it: ``loss(out, batch, io)`` is the micro-batch's sum and ``count(batch)`` what
    PyTorch's ``reduction="mean"`` divides that sum by. The loop divides the global batch's sum by the global count,
    so the logged loss is the named loss's mean over the global batch in every mode (a token of a sequence model
    counts once, as ``F.cross_entropy`` counts it), and ``exp(loss)`` of a language model is its perplexity."""

    needs_target = True

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, out: ModelOutput, batch: Batch, io: BatchIO) -> torch.Tensor:
        """Sum of the losses of ``batch``: a float32 (or float64) scalar on the output device."""
        raise NotImplementedError

    def count(self, batch: Batch) -> torch.Tensor | float:
        """What a mean divides the sum by: here the samples (a loss given as the mean of its batch is weighted by
        the batch's size); known before the forward, so the loop knows the global count first."""
        return float(batch.size)

    def counts_vary(self, batch: Batch) -> bool:
        """Whether the count of a global batch differs from its samples times one sample's count, so the ranks
        must agree on it by a collective."""
        return False


class BuiltinLoss(Loss):
    """A torch.nn loss with ``reduction="sum"`` on the prediction ``model.output`` selects, counted as its
    ``reduction="mean"`` counts."""

    def __init__(self, name: str, criterion: nn.Module, masked: bool = False) -> None:
        super().__init__(name)
        self.criterion = criterion
        self.elementwise = name in ELEMENTWISE
        self.masked = masked  # loss.kwargs gives weight or ignore_index: labels count by them
        self.dataset_classes = 0  # the data's classes, for the message of a target out of bounds (set by setup)

    def __call__(self, out: ModelOutput, batch: Batch, io: BatchIO) -> torch.Tensor:
        pred = _wide(io.prediction(out))
        target = self._target(batch)
        if not self.elementwise:
            if pred.dim() == 2 and target.dim() > 1 and not target.is_floating_point():
                target = target.reshape(-1)  # a sequence model's (tokens, classes) against (batch, time) labels
            try:
                return self.criterion(pred, target)
            except (IndexError, RuntimeError) as exc:
                raise _out_of_bounds(exc, pred, self.dataset_classes) or exc from None
        if pred.numel() != target.numel():
            raise TrainingError(
                f"loss.name: {self.name} compares the prediction with the target value by value, but forward gave "
                f"{list(pred.shape)} for a target of {list(target.shape)}: make the model return as many values as "
                "the target (for the built-in mlp: model.kwargs.num_classes = 1 for one regression target)"
            )
        return self.criterion(pred, target.to(pred.dtype).reshape(pred.shape))

    def count(self, batch: Batch) -> torch.Tensor | float:
        """PyTorch's mean divisor: every value (element-wise losses); every sample and position of class
        probabilities; every class label, but where :meth:`counts_vary` each label not ``ignore_index``, weighted
        by its class ``weight`` when given."""
        target = self._target(batch)
        if self.elementwise:
            return float(target.numel())
        if target.is_floating_point():
            return float(target.numel() // target.shape[1])
        if not self.counts_vary(batch):
            return float(target.numel())
        kept = target[target != self.criterion.ignore_index]
        weight: torch.Tensor | None = self.criterion.weight  # type: ignore[assignment]  # NLLLoss/CrossEntropyLoss
        return weight.to(kept.device)[kept].sum().double() if weight is not None else float(kept.numel())

    def counts_vary(self, batch: Batch) -> bool:
        """Labels whose count is not fixed by the batch's shape: with class weights, an ``ignore_index`` given, or
        labels per position (a sequence, where padding is usual). Plain labels (one per sample, no weight or
        ignore_index given) count each sample: a step then needs no collective to know the global count."""
        target = self._target(batch)
        if self.elementwise or target.is_floating_point():
            return False
        return self.masked or target.dim() > 1

    @staticmethod
    def _target(batch: Batch) -> torch.Tensor:
        assert batch.target is not None  # build_loss refuses dict batches without data.target
        return batch.target


def _out_of_bounds(exc: Exception, pred: torch.Tensor, classes: int) -> TrainingError | None:
    """torch's ``Target N is out of bounds`` as the spec key that fixes it (``None`` for other errors)."""
    found = re.search(r"Target (-?\d+) is out of bounds", str(exc))
    if found is None:
        return None
    width = pred.shape[1] if pred.dim() > 1 else 1
    data = f"; the dataset has {classes} classes (labels 0..{classes - 1})" if classes > 0 else ""
    fix = f"model.kwargs.num_classes = {classes}" if classes > 0 else "as many outputs as the dataset has classes"
    return TrainingError(
        f"model.kwargs.num_classes: the target holds class {found.group(1)}, but the model gives {width} "
        f"outputs per sample (classes 0..{width - 1}){data}: set {fix} (or the model's output size)"
    )


class ModelLoss(Loss):
    """``loss.name = "model"``: forward returned the mean loss of its batch; weighted by the batch's samples."""

    needs_target = False

    def __call__(self, out: ModelOutput, batch: Batch, io: BatchIO) -> torch.Tensor:
        return _wide(io.loss_of(out)) * batch.size


class FunctionLoss(Loss):
    """``loss.name = "pkg.module:function"`` returning the batch mean: ``function(prediction, target, **kwargs)``, or
    by keyword when it names ``output`` (all forward returned) or ``batch`` (the whole batch on its devices)."""

    def __init__(self, name: str, function: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        super().__init__(name)
        self.function = function
        self.kwargs = kwargs
        self.by_name = _named_parameters(function) & set(WHOLE)
        self.needs_target = not self.by_name or "target" in self.by_name

    def __call__(self, out: ModelOutput, batch: Batch, io: BatchIO) -> torch.Tensor:
        if self.by_name:
            given = {"output": out, "batch": io.whole(batch), "prediction": None, "target": batch.target}
            if "prediction" in self.by_name:
                given["prediction"] = io.prediction(out)
            value = self.function(**{k: given[k] for k in self.by_name}, **self.kwargs)
        else:
            value = self.function(io.prediction(out), batch.target, **self.kwargs)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise TrainingError(
                f"loss.name: {self.name!r} returned {got}; a loss function must return the mean loss over the "
                "samples it got, a scalar tensor (e.g. reduce with .mean())"
            )
        return _wide(value).reshape(()) * batch.size


def _wide(value: torch.Tensor) -> torch.Tensor:
    """``value`` in float32 (autocast's bf16/fp16 widened), or kept in float64."""
    return value if value.dtype == torch.float64 else value.float()


def build_loss(loss_spec: LossSpec, spec_dir: Path | str | None) -> Loss:
    """The :class:`Loss` of ``[loss]``; SpecError for a function that does not import or kwargs it does not take."""
    name = loss_spec.name
    if name == "model":
        return ModelLoss(name)
    kwargs = {
        k: torch.as_tensor(v, dtype=torch.float32) if k in _TENSOR_KWARGS else v for k, v in loss_spec.kwargs.items()
    }
    if name in PER_SAMPLE or name in ELEMENTWISE:
        cls = PER_SAMPLE.get(name) or ELEMENTWISE[name]
        try:
            return BuiltinLoss(
                name, cls(reduction="sum", **kwargs), masked=bool({"weight", "ignore_index"} & set(kwargs))
            )
        except (TypeError, ValueError, RuntimeError) as exc:
            message = f"{name} ({cls.__name__}) rejected {loss_spec.kwargs}: {first_line(exc)}"
            raise spec_issue("loss.kwargs", message) from None
    function = resolve_factory(name, spec_dir, "loss.name")
    by_name = sorted(_named_parameters(function) & set(WHOLE), key=WHOLE.index)
    try:
        if by_name:
            inspect.signature(function).bind(**dict.fromkeys(by_name), **kwargs)
        else:
            inspect.signature(function).bind(None, None, **kwargs)
    except TypeError as exc:
        call = (
            f"function({', '.join(f'{k}=...' for k in by_name)}, **loss.kwargs)"
            if by_name
            else ("function(prediction, target, **loss.kwargs)")
        )
        raise spec_issue(
            "loss.kwargs",
            f"{name!r} cannot be called as {call}: {first_line(exc)}; "
            f"signature: {getattr(function, '__name__', 'function')}{inspect.signature(function)}",
        ) from None
    except ValueError:  # no signature (a builtin or C function): the call will tell
        pass
    return FunctionLoss(name, function, kwargs)


def check_objectives(spec: ExperimentSpec, spec_dir: Path | str | None) -> None:
    """Check before the run exists that ``[loss]`` builds and every ``[metrics]`` factory imports (SpecError)."""
    loss = build_loss(spec.loss, spec_dir)
    if isinstance(loss, BuiltinLoss):
        _probe(loss, spec.loss.kwargs)
    check_metric_names(spec, spec_dir)


def _probe(loss: BuiltinLoss, kwargs: dict[str, Any]) -> None:
    """Call a built-in loss on a 2-sample stand-in: a kwarg checked only in forward is a SpecError before the run."""
    if loss.name in PER_SAMPLE:
        classes = len(kwargs.get("weight") or [0, 0, 0])
        prediction, target = torch.zeros(2, classes), torch.zeros(2, dtype=torch.long)
    else:
        width = len(kwargs.get("pos_weight") or [0])
        prediction, target = torch.zeros(2, width), torch.zeros(2, width)
    if loss.name == "nll":
        prediction = torch.log_softmax(prediction, dim=1)
    try:
        loss.criterion(prediction, target)
    except (TypeError, ValueError, RuntimeError) as exc:
        cls = type(loss.criterion).__name__
        raise spec_issue("loss.kwargs", f"{loss.name} ({cls}) rejected {kwargs}: {first_line(exc)}") from None


_Built = TypeVar("_Built")


def optimizer_class(name: str, spec_dir: Path | str | None = None) -> Callable[..., torch.optim.Optimizer]:
    """The optimizer ``optim.name`` names: a ``torch.optim`` class by name, case-insensitive, or the callable of an
    import path. SpecError at ``optim.name``: no such class (with did-you-mean), or the path does not resolve."""
    return _named_class(name, spec_dir, "optim.name", torch.optim, torch.optim.Optimizer, "optimizer")


def _named_class(
    name: str, spec_dir: Path | str | None, key: str, module: Any, base: type, what: str
) -> Callable[..., Any]:
    """The subclass of ``base`` that ``module`` defines under ``name`` (case-insensitive), or the callable of the
    import path ``name``. SpecError at ``key``: no such ``what`` class (with did-you-mean), or the path does not
    resolve."""
    if ":" in name:
        return resolve_factory(name, spec_dir, key)
    classes = {
        n.lower(): c for n, c in vars(module).items() if isinstance(c, type) and issubclass(c, base) and c is not base
    }
    if name.lower() not in classes:
        shown = sorted(c.__name__ for c in classes.values())
        hint = did_you_mean(name, shown, n=3) or f"{module.__name__} has {', '.join(shown)}"
        raise spec_issue(key, with_hint(f"{name!r} is no {what} class of {module.__name__}", hint))
    return classes[name.lower()]


def build_optimizer(
    optim_spec: OptimSpec,
    named: Iterable[tuple[str, torch.nn.Parameter]],
    spec_dir: Path | str | None = None,
) -> torch.optim.Optimizer:
    """The optimizer of ``[optim]`` over the named parameters ``named`` (``model.named_parameters()``), in the
    parameter groups ``[[optim.groups]]`` asks for (first match wins; the rest form the first group).

    ``momentum`` and ``weight_decay`` are passed where the optimizer takes them or the spec sets them. Raises
    SpecError: An unknown optimizer, an argument it does not take, or a group that selects no parameter."""
    cls = optimizer_class(optim_spec.name, spec_dir)
    takes = parameter_names(cls)
    chosen = optim_spec.model_fields_set
    kwargs: dict[str, Any] = {"lr": optim_spec.lr}
    for key in ("weight_decay", "momentum"):
        if key in chosen or key in takes:
            kwargs[key] = getattr(optim_spec, key)
    kwargs.update(_toml_kwargs(optim_spec.kwargs))
    return _construct(cls, "optim.kwargs", param_groups(optim_spec, list(named)), **kwargs)


def param_groups(optim_spec: OptimSpec, named: list[tuple[str, torch.nn.Parameter]]) -> list[dict[str, Any]]:
    """torch's parameter groups: the parameters no ``[[optim.groups]]`` matches first, then one group per entry."""
    groups = [{"params": list[torch.nn.Parameter](), **_group_options(g)} for g in optim_spec.groups]
    rest: list[torch.nn.Parameter] = []
    patterns = [re.compile(g.match) for g in optim_spec.groups]
    for name, param in named:
        index = next((i for i, pattern in enumerate(patterns) if pattern.search(name)), None)
        (rest if index is None else groups[index]["params"]).append(param)
    for i, group in enumerate(groups):
        if not group["params"]:
            some = ", ".join(name for name, _ in named[:6])
            message = f"match {optim_spec.groups[i].match!r} selects no parameter (the model's names: {some}, ...)"
            raise spec_issue(f"optim.groups[{i}].match", message)
    return [{"params": rest}, *groups] if rest else groups


def _group_options(group: Any) -> dict[str, Any]:
    """The options one ``[[optim.groups]]`` entry sets, as torch takes them."""
    options = {
        key: getattr(group, key) for key in ("lr", "weight_decay", "momentum") if getattr(group, key) is not None
    }
    return {**options, **_toml_kwargs(group.kwargs)}


def _toml_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """TOML arrays as tuples, as torch's options (``betas``) are written."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}


def scheduler_class(name: str, spec_dir: Path | str | None = None) -> Callable[..., LRScheduler]:
    """The scheduler ``scheduler.name`` names: a short name, a ``torch.optim.lr_scheduler`` class by name
    (case-insensitive), or the callable of an import path. SpecError at ``scheduler.name`` otherwise."""
    from torch.optim import lr_scheduler

    from runner.spec.names import SCHEDULER_SHORT_NAMES

    wanted = SCHEDULER_SHORT_NAMES.get(name, name)
    return _named_class(wanted, spec_dir, "scheduler.name", lr_scheduler, lr_scheduler.LRScheduler, "scheduler")


def build_scheduler(
    scheduler_spec: SchedulerSpec | None,
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    epochs: int,
    spec_dir: Path | str | None = None,
) -> LRScheduler | None:
    """The LR scheduler of ``[scheduler]``, or ``None``; after ``warmup_steps`` of linear warm-up when asked
    (``SequentialLR``).

    ``CosineAnnealingLR``'s ``T_max`` defaults to the run's scheduler calls after the warm-up; ``OneCycleLR``'s
    ``max_lr`` to the optimizer's lr and ``total_steps`` to the run's steps. SpecError for an unknown scheduler or an
    argument it does not take or lacks.
    """
    if scheduler_spec is None:
        return None
    cls = scheduler_class(scheduler_spec.name, spec_dir)
    kwargs = dict(scheduler_spec.kwargs)
    warmup = scheduler_spec.warmup_steps
    calls = total_steps if scheduler_spec.interval == "step" else epochs
    if cls is torch.optim.lr_scheduler.CosineAnnealingLR:
        kwargs.setdefault("T_max", max(1, calls - warmup))
    if cls is torch.optim.lr_scheduler.OneCycleLR:
        kwargs.setdefault("max_lr", optimizer.param_groups[0]["lr"])
        kwargs.setdefault("total_steps", max(1, total_steps))
    main = _construct(cls, "scheduler.kwargs", optimizer, **kwargs)
    if isinstance(main, torch.optim.lr_scheduler.ReduceLROnPlateau) != (scheduler_spec.monitor is not None):
        problem = f"{scheduler_spec.name} returned {type(main).__name__}: monitor is read by ReduceLROnPlateau only"
        fix = "set it to the metric it steps on" if scheduler_spec.monitor is None else "remove it"
        raise SpecError(SpecIssue(None, None, "scheduler.monitor", f"{problem}; {fix}"))
    if not warmup:
        return main
    ramp = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / (warmup + 1), total_iters=warmup)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [ramp, main], milestones=[warmup])


def scheduler_interval(scheduler_spec: SchedulerSpec | None) -> str:
    """``"step"`` or ``"epoch"``: when the scheduler steps (``OneCycleLR`` always per step)."""
    if scheduler_spec is None:
        return "epoch"
    one_cycle = scheduler_spec.name.lower() in ("onecycle", "onecyclelr")
    return "step" if one_cycle else scheduler_spec.interval


def _construct(cls: Callable[..., _Built], key: str, first: object, **kwargs: Any) -> _Built:  # kwargs: TOML values
    try:
        return cls(first, **kwargs)
    except TypeError as exc:
        sig = inspect.signature(cls.__init__)
        raise SpecError(SpecIssue(None, None, key, f"{first_line(exc)}; {cls.__name__} takes {sig}")) from None
    except ValueError as exc:
        raise SpecError(SpecIssue(None, None, key, f"{cls.__name__}: {first_line(exc)}")) from None
