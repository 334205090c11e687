"""Model and dataset names a spec may use, checked without importing torch: built-ins, torchvision, factories.

Built-in names are the tables below. torchvision's builder and dataset names come from
``torchvision_names.json`` beside this module, generated from the installed torchvision by
``python -m runner.training.models`` (a test checks that it matches); when another torchvision
version is installed, a name missing from that list is left to ``runner exec``, which asks torchvision.
A ``pkg.module:factory`` name is checked for a module that can be found where ``runner exec`` looks
(the spec's folder, the working directory, installed packages) without importing it; the attribute is
checked when the module is imported (``runner.training.models.resolve_factory``).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import json
import os
import posixpath
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from runner.errors import did_you_mean, show, with_hint
from runner.spec.rules import SpecTable

BUILTIN_MODELS = ("mlp", "cnn")
BUILTIN_DATASETS = ("sklearn.digits", "sklearn.diabetes", "synthetic", "imagefolder")
NOT_DATASETS = frozenset({"VisionDataset", "DatasetFolder", "ImageFolder", "wrap_dataset_for_transforms_v2"})
_TV_PREFIXES = ("torchvision.models.", "torchvision.")
GENERATED = Path(__file__).with_name("torchvision_names.json")


def torchvision_bare(name: str) -> str | None:
    """``resnet18`` of ``torchvision.resnet18`` or ``torchvision.models.resnet18``; ``None`` for other names."""
    for prefix in _TV_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


@functools.cache
def generated() -> dict[str, Any]:
    """``{"version", "models", "datasets"}`` of :data:`GENERATED`."""
    data: dict[str, Any] = json.loads(GENERATED.read_text(encoding="utf-8"))
    return data


def torchvision_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """torchvision's model builder names and dataset class names, sorted, as generated."""
    return tuple(generated()["models"]), tuple(generated()["datasets"])


def _installed_differs() -> bool:
    """Whether the installed torchvision is not the version the generated list was made from."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchvision").partition("+")[0] != generated()["version"]
    except PackageNotFoundError:
        return False


def name_problem(name: str, spec_dir: Path | None, *, model: bool) -> str | None:
    """What is wrong with ``model.name`` (``model``) or ``data.dataset``, or ``None``; a factory's module is only
    looked for with ``spec_dir``; a torchvision name passes when the list has it or another version is installed."""
    if name in (BUILTIN_MODELS if model else BUILTIN_DATASETS):
        return None
    if ":" in name:
        return factory_problem(name, spec_dir)
    dataset_bare = name.removeprefix("torchvision.") if name.startswith("torchvision.") else None
    bare = torchvision_bare(name) if model else dataset_bare
    known = torchvision_names()[0 if model else 1]
    if bare is not None and (bare in known or _installed_differs()):
        return None
    return unknown_model(name, known) if model else unknown_dataset(name, known)


def unknown_model(name: str, models: tuple[str, ...]) -> str:
    """The message for an unknown ``model.name``, with the closest names (``models``: torchvision's builders)."""
    choices = list(BUILTIN_MODELS) + [f"torchvision.{n}" for n in models]
    hint = did_you_mean(name, choices, n=3)
    if not hint:  # e.g. "resnet18" or "torchvision.resnet_18": match the bare builder name
        bare = torchvision_bare(name) or name.rpartition(".")[2]
        hint = did_you_mean(bare, {n: f"torchvision.{n}" for n in models}, n=3)
    return (
        with_hint(f"unknown model {name!r}", hint) + f"; use a built-in ({', '.join(BUILTIN_MODELS)}), "
        '"torchvision.<builder>" (a name from torchvision.models.list_models(), e.g. torchvision.resnet18) '
        'or "pkg.module:factory"'
    )


def unknown_dataset(name: str, datasets: tuple[str, ...]) -> str:
    """The message for an unknown ``data.dataset``, with the closest names (``datasets``: torchvision's classes)."""
    choices = list(BUILTIN_DATASETS) + [f"torchvision.{n}" for n in datasets]
    hint = did_you_mean(name, choices, n=3)  # ignoring case, suggesting the real spelling
    if name.lower().startswith("torchvision.") or not hint:  # compare class names, not the shared prefix
        hint = did_you_mean(name.lower().removeprefix("torchvision."), {n: f"torchvision.{n}" for n in datasets}, n=3)
    return (
        with_hint(f"unknown dataset {name!r}", hint) + f'; use {", ".join(BUILTIN_DATASETS)}, "torchvision.<Name>" '
        '(a class of torchvision.datasets, e.g. torchvision.MNIST) or "pkg.module:factory"'
    )


def import_path_problem(target: str) -> str | None:
    """Why ``target`` is not of the form ``pkg.module:attr`` (``attr`` may be dotted), or ``None``."""
    module_name, _, attr = target.partition(":")
    parts = module_name.split(".") + attr.split(".")
    if not module_name or not attr or not all(p.isidentifier() for p in parts):
        return f'{target!r} is not an import path: write "pkg.module:factory"'
    return None


CLOSURE_OPTIMIZERS = ("lbfgs",)  # their step() re-evaluates the loss through a closure, which no runner step passes


def optimizer_name_problem(name: str) -> str | None:
    """Why ``name`` names no optimizer runner can build (checked without torch: a class name's form, an import
    path's form, a closure optimizer), or ``None``; whether torch.optim has the class is checked where torch is."""
    if (malformed := _class_name_problem(name, "torch.optim", "adamw")) is not None:
        return malformed
    if name.lower() in CLOSURE_OPTIMIZERS:
        return (
            f"{name!r} needs a closure that evaluates the loss again in every step (optimizer.step(closure)), "
            "which a runner step does not pass: use another optimizer, or your own loop"
        )
    return None


SCHEDULER_SHORT_NAMES = {  # [scheduler] name -> its torch.optim.lr_scheduler class name
    "step": "StepLR",
    "multistep": "MultiStepLR",
    "exponential": "ExponentialLR",
    "cosine": "CosineAnnealingLR",
    "onecycle": "OneCycleLR",
    "linear": "LinearLR",
}
UNBUILDABLE_SCHEDULERS = {  # lower-case class name -> why TOML cannot describe it
    "lambdalr": "it takes a Python function (lr_lambda)",
    "multiplicativelr": "it takes a Python function (lr_lambda)",
    "sequentiallr": "it takes other schedulers: use scheduler.warmup_steps for a warm-up before one",
    "chainedscheduler": "it takes other schedulers",
}


def scheduler_name_problem(name: str) -> str | None:
    """Why ``name`` names no scheduler runner can build (checked without torch), or ``None``."""
    if (malformed := _class_name_problem(name, "torch.optim.lr_scheduler", "StepLR")) is not None:
        return malformed
    if (why := UNBUILDABLE_SCHEDULERS.get(name.lower())) is not None:
        return f"{name!r} cannot be built from a spec: {why}"
    return None


def _class_name_problem(name: str, module: str, example: str) -> str | None:
    """Why ``name`` is neither of the form of a class name of ``module`` nor an import path, or ``None``."""
    if ":" in name:
        return import_path_problem(name)
    if not name.isidentifier():
        return f'{name!r} is no class name of {module}: write one such as "{example}", or "pkg.module:factory"'
    return None


def find_module(target: str, spec_dir: Path) -> importlib.machinery.ModuleSpec | None:
    """Where the module of ``pkg.module:factory`` is, found without importing it: ``spec_dir`` and the working
    directory first, then installed packages; ``None`` when nowhere."""
    top, *subs = target.partition(":")[0].split(".")
    folders = [str(Path(spec_dir).resolve()), os.getcwd()]
    found = importlib.machinery.PathFinder.find_spec(top, folders)
    if found is None:
        try:
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):  # a module already imported without a spec
            found = None
    for depth in range(len(subs)):
        locations = found.submodule_search_locations if found is not None else None
        if not locations:
            break
        found = importlib.machinery.PathFinder.find_spec(".".join([top, *subs[: depth + 1]]), list(locations))
    return found


def factory_problem(target: str, spec_dir: Path | None) -> str | None:
    """Why ``pkg.module:factory`` cannot be imported, found without importing (``spec_dir`` and the working directory
    first, then installed packages); ``None`` when it can."""
    problem = import_path_problem(target)
    if problem is not None or spec_dir is None:
        return problem
    if find_module(target, spec_dir) is not None:
        return None
    import pkgutil

    module_name = target.partition(":")[0]
    top = module_name.split(".")[0]
    folders = [str(Path(spec_dir).resolve()), os.getcwd()]
    nearby = [m.name for m in pkgutil.iter_modules(folders)]
    return (
        with_hint(
            f"cannot import module {module_name!r} of {target!r}: not found in the spec folder {folders[0]}, "
            f"working directory {folders[1]} or installed packages",
            did_you_mean(top, nearby),
        )
        + f" (check the spelling, or put {top} next to the spec file)"
    )


BUILTIN_LOSSES = ("cross_entropy", "mse", "l1", "smooth_l1", "bce_with_logits", "nll", "model")
BUILTIN_METRICS = ("accuracy", "top_k_accuracy", "f1", "precision", "recall", "auroc", "mae", "mse", "r2")
CLASSIFICATION_LOSSES = ("cross_entropy", "nll")  # without [metrics]: train/accuracy and val/accuracy
RESERVED_METRICS = ("loss", "epoch_loss")  # runner's own train/loss, train/epoch_loss, val/loss
LOG_AS = "log_as"  # entry key that names the logged metric; every other key is an argument
OUTPUT = "output"  # entry key naming a scalar of forward's output to log (e.g. an auxiliary loss)
MOVED = {  # keys that moved to [loss], with the hint an old spec gets
    ("train", "loss"): 'the loss moved to its own table: write [loss] name = "..."',
    ("train", "label_smoothing"): "moved to [loss]: write kwargs = { label_smoothing = ... } there",
}
_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_MLFLOW_NAME = re.compile(r"^[/\w.\- ]*$")  # MLflow's metric key characters (its portable set: no colon)
_MLFLOW_MAX = 250


def _check_name(name: str, builtins: tuple[str, ...], what: str, path_form: str) -> str:
    if name in builtins or _PATH.match(name):  # pkg.module:attr
        return name
    expected = f"a built-in {what} ({', '.join(builtins)}) or {show(path_form)}"
    hint = did_you_mean(name, builtins)
    if ":" in name:
        hint = hint or f'an import path is written "pkg.module:{path_form.rpartition(":")[2]}"'
    raise ValueError(with_hint(f"got {show(name)}; expected {expected}", hint))


class LossSpec(SpecTable):
    """``[loss]``: the loss the optimizer minimises (docs/design.md §3, §13)."""

    name: str = Field(default="cross_entropy", min_length=1)
    """Loss: cross_entropy, mse, l1, smooth_l1, bce_with_logits, nll (torch.nn losses), `model` (forward gets
    the targets and returns the loss, or an object with a `loss` entry) or `pkg.module:function` (gets
    `(prediction, target)`, returns the mean over its samples)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the loss, e.g. `{ label_smoothing = 0.1 }` or `{ pos_weight = [2.0] }` (lists
    become tensors); runner chooses the reduction."""

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        return _check_name(name, BUILTIN_LOSSES, "loss", "pkg.module:function")

    @model_validator(mode="after")
    def _kwargs_fit(self) -> LossSpec:
        if "reduction" in self.kwargs:
            raise ValueError(
                "kwargs sets reduction: runner reduces every loss itself (a sample-weighted mean, "
                "docs/design.md §3); remove it"
            )
        if self.name == "model" and self.kwargs:
            raise ValueError('kwargs are not used with name = "model" (the model computes its loss): remove them')
        return self


def metric_name(entry: str | dict[str, Any]) -> str:
    """The ``name`` of a ``[metrics]`` entry: the entry itself, or its ``name`` key."""
    return entry if isinstance(entry, str) else str(entry.get("name", ""))


def metric_args(entry: str | dict[str, Any]) -> dict[str, Any]:
    """The arguments of a ``[metrics]`` entry: every key but ``name``, ``log_as`` and ``output``."""
    return {} if isinstance(entry, str) else {k: v for k, v in entry.items() if k not in ("name", LOG_AS, OUTPUT)}


def logged_name(entry: str | dict[str, Any]) -> str:
    """The name an entry is logged under: ``log_as``, else the ``output`` name, a built-in's, or the factory's
    attribute."""
    if isinstance(entry, dict) and isinstance(entry.get(LOG_AS), str):
        return str(entry[LOG_AS])
    if isinstance(entry, dict) and isinstance(entry.get(OUTPUT), str):
        return str(entry[OUTPUT])
    return metric_name(entry).rpartition(":")[2].rpartition(".")[2]


def mlflow_name_problem(name: str) -> str | None:
    """Why MLflow would reject the metric key ``name`` (``_validate_metric_name``'s rules, colons refused), or
    ``None``."""
    if not _MLFLOW_NAME.match(name):
        return "MLflow metric names may only hold letters, digits, _, -, ., spaces and /"
    if len(name) > _MLFLOW_MAX:
        return f"MLflow metric names have at most {_MLFLOW_MAX} characters"
    norm = posixpath.normpath(name)
    if norm != name or norm.startswith(("..", "/")):
        return f"MLflow treats metric names as paths and {name!r} is not a plain one (it reads as {norm!r})"
    return None


def _check_entry(entry: str | dict[str, Any]) -> str | dict[str, Any]:
    name = entry if isinstance(entry, str) else entry.get("name")
    if isinstance(entry, dict) and OUTPUT in entry:
        _check_output_entry(entry)
    elif not isinstance(name, str) or not name:
        raise ValueError(
            f'got {show(entry)}; expected a metric name, a table with name = "..." and its arguments, '
            'or { output = "..." } (a scalar of forward\'s output)'
        )
    else:
        _check_name(name, BUILTIN_METRICS, "metric", "pkg.module:Factory")
    if isinstance(entry, dict) and LOG_AS in entry and not isinstance(entry[LOG_AS], str):
        raise ValueError(f"got log_as = {show(entry[LOG_AS])}; expected the name to log the metric under (a string)")
    logged = logged_name(entry)
    problem = mlflow_name_problem(f"val/{logged}")
    if problem:
        raise ValueError(f'{show(logged)} cannot be a metric name: {problem}; set log_as = "..." to rename it')
    if logged in RESERVED_METRICS:
        raise ValueError(
            f'{show(logged)} is runner\'s own loss metric: set log_as = "..." to log it under another name'
        )
    return entry


def _check_output_entry(entry: dict[str, Any]) -> None:
    """``{ output = "aux_loss" }`` (and ``log_as``): a scalar of forward's output, logged as its mean."""
    if not isinstance(entry[OUTPUT], str) or not entry[OUTPUT]:
        raise ValueError(
            f"got output = {show(entry[OUTPUT])}; expected the key or attribute of a scalar in forward's output"
        )
    extra = sorted(set(entry) - {OUTPUT, LOG_AS})
    if extra:
        raise ValueError(
            f'got {show(entry)}; an output metric takes output = "..." and log_as only: remove {", ".join(extra)}'
        )


MetricEntry = Annotated[str | dict[str, Any], AfterValidator(_check_entry)]


class MetricsSpec(SpecTable):
    """``[metrics]``: torchmetrics metrics computed on the training and validation batches (docs/design.md §13)."""

    train: list[MetricEntry] = Field(default_factory=list)
    """Metrics of the training batches, logged as `train/<name>` per epoch and `train/step_<name>` every
    log_every_n_steps: built-in names (accuracy, top_k_accuracy, f1, precision, recall, auroc, mae, mse, r2),
    tables with arguments (`{ name = "top_k_accuracy", k = 5 }`, `log_as` renames), `pkg.module:Factory`
    returning a torchmetrics.Metric, or `{ output = "aux_loss" }`: a scalar of forward's output, logged as its
    mean over the samples."""
    val: list[MetricEntry] = Field(default_factory=list)
    """Metrics of the validation split, logged as `val/<name>`; entries as for `train`."""

    @field_validator("train", "val")
    @classmethod
    def _distinct(cls, entries: list[str | dict[str, Any]], info: ValidationInfo) -> list[str | dict[str, Any]]:
        seen: set[str] = set()
        for entry in entries:
            logged = logged_name(entry)
            names = {logged, f"step_{logged}"} if info.field_name == "train" else {logged}
            if names & seen:
                raise ValueError(f'{show(logged)} is logged twice: give one of the entries log_as = "..."')
            seen |= names
        return entries
