"""The model's side of a step: move a batch to the devices, call forward, pick the prediction and the loss it returned.

The contract (docs/design.md §13, README "Bring your own model"):

* a batch is an ``(x, y)`` pair or a dict of tensors (``data.target`` names the target key);
  every tensor is moved to the strategy's input device, the target also to its output device;
* forward is called as ``model(x)`` or ``model(**inputs)`` (a dict batch without its target key),
  and with ``loss.name = "model"`` as ``model(x, y)`` or ``model(**batch)`` (the target included);
* forward returns a tensor (the prediction), or a dict, dataclass, named tuple, tuple or list out
  of which ``model.output`` picks the prediction (a key, attribute or index); with
  ``loss.name = "model"`` it returns the loss (a scalar tensor) or an object with a ``loss`` entry
  (a key or attribute, as Hugging Face models do).

A mistake that only shows when forward has run raises ``runner.errors.TrainingError``
naming the spec key that fixes it (exit 1, the run FAILED).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runner.errors import TrainingError, UserCodeError, first_line, user_code_error
from runner.training.models import spec_issue

if TYPE_CHECKING:
    from runner.spec.schema import ExperimentSpec
    from runner.training.data import DatasetInfo


# What forward returns: a tensor, or a dict, dataclass or tuple holding the prediction (and a
# model-computed loss); the user's model decides, :class:`BatchIO` finds the parts.
ModelOutput = Any


CollatedBatch = Mapping[str, Any] | Sequence[Any]
"""A batch as the DataLoader collates it: ``(x, y)`` (a tuple or list), or a dict of named fields."""


@dataclass
class Batch:
    """One micro-batch on its devices: forward's ``inputs`` (a tensor, ``(x, y)`` for a model-computed loss, or
    keyword arguments), the ``target`` on the output device (or ``None``), and ``size`` ``B``."""

    inputs: Any
    target: torch.Tensor | None
    size: int


def describe(value: Any) -> str:
    """What forward returned, in words: ``a dict with keys ['loss', 'logits']``, ``a tensor of shape [8, 3]``."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {[str(k) for k in value]}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"a dataclass {type(value).__name__} with fields {[f.name for f in dataclasses.fields(value)]}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


@dataclass
class BatchIO:
    """How batches reach the model and what is taken out of its output (the contract: docs/design.md §13).

    ``output`` picks the prediction (``None``: the output itself); ``model_loss`` hands forward the target and takes its
    loss; ``dtype`` casts a batch's floating tensors (``runner parity``).
    """

    target_key: str | None
    output: str | int | None
    model_loss: bool
    dtype: torch.dtype | None = None
    batch_dim: int = 0

    def prepare(self, batch: Any, device: torch.device, output_device: torch.device) -> Batch:
        """Move a collated batch to the devices: inputs to ``device``, the target to ``output_device``; with
        ``model.batch_dim`` the samples' dimension of each tensor moves there (a sequence-first model's layout)."""
        if isinstance(batch, Mapping):
            moved = {k: _to(v, device, self.dtype) for k, v in batch.items()}
            target = moved.get(self.target_key) if self.target_key is not None else None
            target = target.to(output_device, non_blocking=True) if isinstance(target, torch.Tensor) else None
            inputs = moved if self.model_loss else {k: v for k, v in moved.items() if k != self.target_key}
            size = _length(target if target is not None else moved)
            return Batch(self._laid(inputs), self._laid(target), size)
        x, y = batch
        x_in = _to(x, device, self.dtype)
        if self.dtype is not None and y.is_floating_point():
            y = y.to(self.dtype)
        pair = (x_in, y.to(device, non_blocking=True)) if self.model_loss else x_in
        return Batch(self._laid(pair), self._laid(y.to(output_device, non_blocking=True)), int(y.shape[0]))

    def _laid(self, value: Any) -> Any:
        """``value``'s tensors with the samples' dimension (0, as collated) moved to ``batch_dim``."""
        if isinstance(value, torch.Tensor):
            return value.movedim(0, self.batch_dim) if 0 < self.batch_dim < value.dim() else value
        if isinstance(value, Mapping):
            return {k: self._laid(v) for k, v in value.items()}
        return type(value)(self._laid(v) for v in value) if isinstance(value, (tuple, list)) else value

    def whole(self, batch: Batch) -> Any:
        """The whole batch on its devices, as a loss function's ``batch`` gets it: the dict with its target key, or
        ``(x, y)``."""
        if isinstance(batch.inputs, dict):
            if self.target_key is None or batch.target is None:
                return dict(batch.inputs)
            return {**batch.inputs, self.target_key: batch.target}
        if self.model_loss:
            return batch.inputs[0], batch.target
        return batch.inputs, batch.target

    def forward(self, model: nn.Module, batch: Batch) -> ModelOutput:
        """Call the model on the batch as the contract says; returns what forward returned."""
        if isinstance(batch.inputs, dict):
            return model(**batch.inputs)
        if self.model_loss:
            return model(*batch.inputs)
        return model(batch.inputs)

    def prediction(self, out: ModelOutput) -> torch.Tensor:
        """The prediction in ``out``; TrainingError, saying what forward returned, when ``model.output`` finds no
        tensor."""
        if self.output is None:
            if isinstance(out, torch.Tensor) and not (self.model_loss and out.dim() == 0):
                return out
            example = '"logits"' if isinstance(out, Mapping) or dataclasses.is_dataclass(out) else "0"
            raise TrainingError(
                f"model.output: forward returned {describe(out)}; set model.output to the entry that holds the "
                f"prediction, e.g. model.output = {example} (runner computes the loss and metrics on it)"
            )
        found = _entry(out, self.output)
        if found is _MISSING:
            raise TrainingError(
                f"model.output: forward returned {describe(out)}, which has no entry {self.output!r}: "
                "set model.output to one of its keys, attributes or indices"
            )
        if not isinstance(found, torch.Tensor):
            raise TrainingError(
                f"model.output: entry {self.output!r} of forward's output is {describe(found)}, not a tensor: "
                "point model.output at the prediction"
            )
        return found

    def scalar(self, out: ModelOutput, entry: str, key: str) -> torch.Tensor:
        """The scalar tensor ``entry`` of forward's output, detached; TrainingError (naming ``key``) when there is
        none."""
        found = _entry(out, entry)
        if found is _MISSING or not isinstance(found, torch.Tensor) or found.numel() != 1:
            what = "no such entry" if found is _MISSING else f"its entry {entry!r} is {describe(found)}"
            raise TrainingError(
                f"{key}: output = {entry!r}, but forward returned {describe(out)}, {what}: an output metric names "
                "a scalar tensor in forward's dict, dataclass or named tuple (e.g. an auxiliary loss)"
            )
        return found.detach().float().reshape(())

    def loss_of(self, out: ModelOutput) -> torch.Tensor:
        """The loss a model computed: ``out`` or its ``loss`` entry; TrainingError when it is missing or not a
        scalar."""
        loss = out if isinstance(out, torch.Tensor) else _entry(out, "loss")
        if loss is _MISSING or not isinstance(loss, torch.Tensor):
            raise TrainingError(
                f'loss.name: with loss.name = "model" forward must return the loss (a scalar tensor) or an object '
                f"with a loss entry (a key or attribute), but it returned {describe(out)}: compute the loss in "
                'forward from the targets it is given, or choose a loss by name (e.g. loss.name = "cross_entropy")'
            )
        if loss.numel() != 1:
            raise TrainingError(
                f'loss.name: with loss.name = "model" the loss must be a scalar (the mean over the batch), '
                f"but forward returned a loss of shape {list(loss.shape)}"
            )
        return loss.reshape(())


_MISSING = object()


def check_target(info: DatasetInfo, spec: ExperimentSpec, *, needs: bool) -> None:
    """Dict samples need ``data.target`` when the loss or the metrics need a target; SpecError naming their keys."""
    if info.keys and spec.data.target is None and needs:
        likely = [k for k in info.keys if k.lower() in _TARGET_NAMES] or [info.keys[-1]]
        raise spec_issue(
            "data.target",
            f"{info.name} yields dicts with keys {list(info.keys)}, and loss.name = {spec.loss.name!r} or the "
            f'metrics need the target: set data.target to its key, e.g. data.target = "{likely[0]}"',
        )


_TARGET_NAMES = ("label", "labels", "target", "targets", "y", "class", "classes")


def _entry(out: Any, key: str | int) -> Any:
    """``out[key]`` of a mapping or sequence, or ``getattr(out, key)``; ``_MISSING`` when there is none."""
    if isinstance(out, Mapping):
        return out.get(key, _MISSING) if isinstance(key, str) else _MISSING
    if isinstance(key, int):
        if isinstance(out, (tuple, list)) and -len(out) <= key < len(out):
            return out[key]
        return _MISSING
    return getattr(out, key, _MISSING) if not isinstance(out, torch.Tensor) else _MISSING


def _to(value: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            return value.to(device, dtype, non_blocking=True)
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device, dtype) for v in value)
    return value


def _length(value: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    if isinstance(value, Mapping):
        for item in value.values():
            if isinstance(item, torch.Tensor):
                return _length(item)
    raise TrainingError("data.dataset: a dict batch holds no tensor, so its number of samples is unknown")


_SHAPE_CAUSES = (  # torch's words for a batch the model does not fit -> the key that decides it, and the fix
    (
        re.compile(r"to have (\d+) channels, but got (\d+) channels"),
        "data.num_channels",
        "the model takes {0} channels but the batch has {1}: set data.num_channels = {0} (image datasets)",
    ),
    (
        re.compile(r"shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)"),
        "data.image_size",
        "a layer takes {2} features but gets {1}: data.image_size and data.num_channels set the images' size",
    ),
    (
        re.compile(r"Expected input batch_size \((\d+)\) to match target batch_size \((\d+)\)"),
        "model.name",
        "the output has {0} rows for {1} targets: forward changed the batch dimension (a view or reshape of the "
        "batch, or a layout that is not batch-first)",
    ),
)


def shape_error(exc: Exception, batch: Batch) -> UserCodeError | None:
    """``exc`` of a first forward or loss, when its shapes point at the data: an error naming the data key, the
    shapes and the fix, then the user's file and line where the traceback passes through their code."""
    for pattern, key, fix in _SHAPE_CAUSES:
        if (match := pattern.search(str(exc))) is None:
            continue
        inputs = batch.inputs if isinstance(batch.inputs, Mapping) else {"input": batch.inputs}
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in inputs.items() if isinstance(v, torch.Tensor))
        located = user_code_error(exc, key)
        cause = f"\n{located}" if located is not None else f" ({type(exc).__name__}: {first_line(exc)})"
        return UserCodeError(f"{key}: {fix.format(*match.groups())}; the batch holds {shapes}{cause}")
    return None
