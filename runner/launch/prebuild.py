"""Before the MLflow run exists: build every part the spec names, or check its arguments by signature and type.

A wrong value in ``[model]``, ``[data]``, ``[optim]``, ``[scheduler]`` or ``[train]`` must exit 2 with
``FILE:LINE`` and leave no run (docs/design.md §1), not fail after an epoch of training. Rank 0 calls
``check_parts`` before it reports its build, so before the run exists (docs/design.md §6). What is
built, and what only checked:

* dataset: ``sklearn.digits``, ``sklearn.diabetes`` and small ``synthetic`` sets are built (they
  live in memory and take milliseconds); torchvision datasets, ``imagefolder`` and
  ``pkg.module:factory`` datasets, which may read a whole dataset from disk, are only checked: the
  name resolves and ``data.kwargs`` bind to the class or factory signature with the annotated types;
* model: a built-in or torchvision model is built on the ``meta`` device (parameters without storage,
  so the size of the model costs nothing) with the dataset's shape and classes when the dataset was
  built, else its kwargs are checked by signature and type; an error on ``meta`` is confirmed by a build
  on CPU before it is reported; fsdp's ``parallel.fsdp_blocks`` must name module classes of that model. A
  ``pkg.module:factory`` model is user code: it is only checked by
  signature and type, never called here, so a factory runs once per run (a sweep trial's warm worker
  builds it once) and its side effects (a file written, weights read) happen only in the worker.
  ``runner plan`` is the one exception: where it estimates memory, which calls the factory on fake
  tensors anyway, ``known_differences(call_factory=True)`` builds it on ``meta`` to name its random
  layers;
* optimizer: built over one stand-in parameter with the spec's arguments;
* scheduler: built over that optimizer, its kwargs type-checked against the annotations of the
  ``torch.optim.lr_scheduler`` class, then stepped as the run would step it (up to
  ``DRY_RUN_STEPS`` calls), so a value that only fails when the schedule is computed is found;
* the training loaders: built on the built dataset (no batch is read). The loss and the metrics
  are checked by ``runner.training.losses.check_objectives``, which rank 0 calls first.

"Checked by type" is pydantic's strict validation of each kwarg against its annotation
(``TypeAdapter``, worded as spec errors are): a kind TOML can write (number, string, boolean, list,
choice) must match; what TOML cannot write (a tuple, a path, a class) is left to the call.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import SpecError, SpecIssue, did_you_mean, first_line, show, with_hint
from runner.spec.messages import value_problem
from runner.spec.reading import folder_problem
from runner.spec.schema import transform_names
from runner.spec.schema_parallel import MODES, REFERENCE_MODE

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from runner.plan import Plan
    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec
    from runner.training.data import DatasetBundle

DRY_RUN_STEPS = 1000
SMALL_SYNTHETIC = 1 << 24  # numbers (4 bytes each) up to which a synthetic dataset is built here


def check_parts(loaded: LoadedSpec, world_size: int) -> tuple[list[str], DatasetBundle | None]:
    """Build or check every part of ``loaded`` before any run exists; return the mode-difference notes and the
    datasets when they were built. SpecError at ``FILE:LINE`` for a part that does not build or an argument of the
    wrong type."""
    model, bundle = _check(loaded.spec, loaded.path.parent, world_size)
    return difference_notes(model, loaded.spec), bundle


def known_differences(loaded: LoadedSpec, *, call_factory: bool = False) -> list[str]:
    """:func:`difference_notes` of the model built on the ``meta`` device (``runner plan``); none for a model that
    cannot be built here, or a factory model unless ``call_factory`` (the plan's memory estimate calls it anyway:
    before a run, user code is never called)."""
    spec = loaded.spec
    folder = loaded.path.parent
    try:
        bundle = _dataset(spec, folder)
        model = _factory_model(spec, folder, bundle) if call_factory else _model(spec, folder, bundle)
    except Exception:  # the plan reports what it can; check_parts names a part that does not build
        return []
    return difference_notes(model, spec)


def _factory_model(spec: ExperimentSpec, spec_dir: Path, bundle: DatasetBundle | None) -> torch.nn.Module | None:
    """The model on ``meta``, a factory's too, its ``${data.NAME}`` kwargs resolved when the data was built."""
    import torch

    from runner.training.models import build_model, with_data

    if ":" not in spec.model.name:
        return _model(spec, spec_dir, bundle)
    shape: tuple[int, ...] = ()
    model_spec = spec.model
    classes = 0
    if bundle is not None:
        model_spec = with_data(spec.model, bundle.info, bundle.train)
        shape = bundle.info.input_shape
        classes = bundle.info.num_classes
    elif spec.model.kwargs != _written(spec):  # data not built (files, a factory) that its kwargs need
        return None
    with torch.device("meta"):
        return build_model(model_spec, spec_dir, input_shape=shape, num_classes=classes)


def layer_kinds(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """``(batch-statistics layers, random layers)`` of ``model`` by class name: BatchNorm but SyncBatchNorm; dropout,
    ``RReLU``, ``StochasticDepth`` with ``p > 0``."""
    from torch import nn

    batch, random = set(), set()
    random_kinds = (nn.modules.dropout._DropoutNd, nn.RReLU)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm):
            batch.add(type(m).__name__)
        elif (isinstance(m, random_kinds) or type(m).__name__ == "StochasticDepth") and getattr(m, "p", 1.0) > 0:
            random.add(type(m).__name__)
    return sorted(batch), sorted(random)


def difference_notes(model: torch.nn.Module | None, spec: ExperimentSpec, modes: Sequence[str] = ()) -> list[str]:
    """Why runs of ``spec`` under ``modes`` (default: its own) will not match ``none`` step by step (docs/design.md
    §3), for the plan's notes and parity's causes: BatchNorm or random layers of ``model``. Under ``none`` itself,
    random layers are named too: its runs will differ from a multi-process mode's."""
    if model is None:
        return []
    batch, random = layer_kinds(model)
    random += [f"data.transforms {n}" for n in transform_names(spec.data.transforms) if _RANDOM_TRANSFORM.search(n)]
    modes = [m for m in modes or [spec.parallel.mode] if m != REFERENCE_MODE]
    if not modes:
        return [random_note(random)] if random else []
    notes, mode = [], ", ".join(modes)
    syncs = all("sync_batchnorm" in MODES[m].keys for m in modes)
    if batch and not (syncs and spec.parallel.sync_batchnorm and spec.devices.accelerator != "cpu"):
        fix = (
            "set parallel.sync_batchnorm = true (CUDA) for batch statistics over the global batch"
            if syncs
            else "mode none, or ddp with parallel.sync_batchnorm = true, normalises over the global batch"
        )
        notes.append(
            f"{', '.join(batch)} without parallel.sync_batchnorm: under {mode} each device normalises its own share "
            f"of the batch, so results differ from mode none; {fix}"
        )
    if random:
        notes.append(random_note(random, mode))
    return notes


_RANDOM_TRANSFORM = re.compile(r"Random|Augment|AugMix|Jitter|:")  # torchvision's random ones, and a user's


def random_note(layers: list[str], mode: str | None = None) -> str:
    """The note on random layers (dropout): ``mode``'s ranks draw their own numbers, or, under none (``mode``
    ``None``), a multi-process mode's will; how to compare the modes all the same."""
    where = f"under {mode} each rank (dp: each device) draws" if mode else "under dp, ddp or fsdp each rank draws"
    return (
        f"{', '.join(layers)}: {where} its own random numbers, so results differ from mode none by chance, not on "
        "average: compare the modes over a few seeds, or without dropout and random transforms (runner parity "
        "proves the rest agrees)"
    )


def check_checkpoint_folder(plan: Plan) -> None:
    """Check the plan's checkpoint folder can be written before the run exists: SpecError at ``checkpoint.dir``, or
    TrackingError first when the default folder is beside an unwritable sqlite store."""
    from runner.tracking.uri import check_reachable, sqlite_path

    settings = plan.loaded.spec.checkpoint
    tracking_uri = plan.tracking_uri
    if not settings.enabled:
        return
    folder = plan.checkpoint_root
    problem = folder_problem(folder)
    if problem is None:
        return
    if not settings.dir and tracking_uri is not None and sqlite_path(tracking_uri) is not None:
        check_reachable(tracking_uri)  # a store folder that cannot be written is the cause: name it
    if settings.dir:
        message = f"dir = {show(settings.dir)} cannot hold checkpoints: {problem}; choose a writable folder"
    else:
        message = f"the default checkpoint folder {folder} cannot be written: {problem}; set checkpoint.dir"
    raise SpecError(SpecIssue(None, None, "checkpoint.dir", message))


def _check(
    spec: ExperimentSpec, spec_dir: Path, world_size: int
) -> tuple[torch.nn.Module | None, DatasetBundle | None]:
    """The checks of :func:`check_parts`; returns the model built on ``meta`` and the datasets, where built."""
    from runner.training.models import check_model_name
    from runner.training.sampling import build_loaders

    check_model_name(spec.model.name, spec_dir)
    if spec.train.compile:
        _compile_backend(spec.train.compile_backend)
    bundle = _dataset(spec, spec_dir)
    steps_per_epoch = None
    if bundle is not None:
        steps_per_epoch = build_loaders(spec, bundle, 0, world_size).steps_per_epoch
    model = _unless_unbuildable_here(_model, spec, spec_dir, bundle)
    _unless_unbuildable_here(_optimizer_and_scheduler, spec, spec_dir, steps_per_epoch, model)
    return model, bundle


def _compile_backend(name: str) -> None:
    """``train.compile_backend`` names a backend torch.compile knows (``torch._dynamo.list_backends``)."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        message = with_hint(f"{name!r} is no torch.compile backend", did_you_mean(name, known))
        raise SpecError(SpecIssue(None, None, "train.compile_backend", f"{message}; known: {', '.join(known)}"))


def _unless_unbuildable_here(step: Callable[..., Any], *args: Any) -> Any:
    """Run one check; an error but SpecError means stand-ins cannot build the part: the worker builds and reports it."""
    try:
        return step(*args)
    except SpecError:
        raise
    except Exception:  # not a verdict on the spec
        return None


def _dataset(spec: ExperimentSpec, spec_dir: Path) -> DatasetBundle | None:
    """The built dataset when it is cheap to build, else ``None`` after checking its name and kwargs."""
    from runner.training.data import build_datasets
    from runner.training.sources import IN_MEMORY, dataset_source

    data = spec.data
    size = data.num_samples
    for dim in data.input_shape:
        size *= dim
    if data.dataset in IN_MEMORY and (data.dataset != "synthetic" or size <= SMALL_SYNTHETIC):
        return build_datasets(spec, spec_dir)
    if data.dataset in IN_MEMORY:
        return None
    source = dataset_source(data.dataset, spec_dir)
    if source is not None:
        args = () if ":" in data.dataset else (str(spec_dir),)  # torchvision classes take root first
        check_call(source, args, data.kwargs, "data.kwargs")
    return None


def _model(spec: ExperimentSpec, spec_dir: Path, bundle: DatasetBundle | None) -> torch.nn.Module | None:
    """The model on ``meta`` (an error confirmed on CPU), or ``None`` when only its kwargs were checked."""
    import torch

    from runner.training.models import build_cnn, build_mlp, build_model, resolve_factory, with_data

    name = spec.model.name
    written = _written(spec)
    if ":" in name:  # user code: checked, never called here (it may have side effects or load weights)
        check_call(resolve_factory(name, spec_dir, "model.name"), (), written, "model.kwargs")
        return None
    if bundle is None:  # no shape or classes to build with: check the kwargs the user wrote
        builtins: dict[str, Callable[..., Any]] = {"mlp": build_mlp, "cnn": build_cnn}
        builder = builtins.get(name)
        if builder is not None:
            check_call(builder, (), written, "model.kwargs")
        return None
    shape = bundle.info.input_shape
    classes = bundle.info.num_classes
    model_spec = with_data(spec.model, bundle.info, bundle.train)
    try:
        with torch.device("meta"):
            model = build_model(model_spec, spec_dir, input_shape=shape, num_classes=classes)
    except SpecError:
        model = build_model(model_spec, spec_dir, input_shape=shape, num_classes=classes)  # raises when real
    if "fsdp_blocks" in spec.parallel.traits.keys:
        from runner.strategies.base import find_blocks

        find_blocks(model, spec.parallel.fsdp_blocks)
    return model


def _written(spec: ExperimentSpec) -> dict[str, Any]:
    """``model.kwargs`` but the ``${data.NAME}`` values, known once the data is built."""
    from runner.training.models import DATA_REF

    return {k: v for k, v in spec.model.kwargs.items() if not (isinstance(v, str) and DATA_REF.match(v))}


def _optimizer_and_scheduler(
    spec: ExperimentSpec, spec_dir: Path, steps_per_epoch: int | None, model: torch.nn.Module | None
) -> None:
    """Match the parameter groups against the model's names (when it was built here), build the optimizer over a
    stand-in parameter, then the scheduler, and step it as the run would."""
    import torch

    from runner.training.losses import (
        build_optimizer,
        build_scheduler,
        param_groups,
        scheduler_class,
        scheduler_interval,
    )
    from runner.training.setup import count_total_steps
    from runner.training.sums import lr_problem

    if model is not None:
        param_groups(spec.optim, list(model.named_parameters()))
    alone = spec.optim.model_copy(update={"groups": []})
    optimizer = build_optimizer(alone, [("stand_in", torch.nn.Parameter(torch.zeros(1)))], spec_dir)
    if spec.scheduler is None:
        return
    check_call(scheduler_class(spec.scheduler.name, spec_dir), (optimizer,), spec.scheduler.kwargs, "scheduler.kwargs")
    total = count_total_steps(steps_per_epoch, spec.train) if steps_per_epoch is not None else None
    stand_in = total or spec.train.max_steps or DRY_RUN_STEPS  # the data not built here: the run's length unknown
    scheduler = build_scheduler(spec.scheduler, optimizer, stand_in, spec.train.epochs, spec_dir)
    assert scheduler is not None  # spec.scheduler is set
    per_step = scheduler_interval(spec.scheduler) == "step"
    calls = (total if per_step else spec.train.epochs) if total is not None else min(2, stand_in)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": nothing is trained here
        try:
            for _ in range(min(calls, DRY_RUN_STEPS)):
                optimizer.step()
                if spec.scheduler.monitor is None:
                    scheduler.step()
                else:  # a plateau schedule steps on the monitored value
                    scheduler.step(1.0)  # type: ignore[arg-type]
                if (problem := lr_problem(optimizer)) is not None:
                    raise ValueError(problem)
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            name = type(scheduler).__name__
            message = f"{name} fails when stepped: {type(exc).__name__}: {first_line(exc)}"
            raise SpecError(SpecIssue(None, None, "scheduler.kwargs", message)) from None


# ----------------------------------------------------------------------------- arguments by signature and type


def check_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], key: str) -> None:
    """Check that ``fn(*args, **kwargs)`` binds and each kwarg has its annotated type (plain types, ``Literal``,
    unions, sequences and mappings of them), without calling it; SpecError at ``key.<name>`` for each that does not."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: the call decides
        return
    title = f"{getattr(fn, '__name__', 'factory')}{_plain(sig)}"
    try:
        sig.bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise SpecError(SpecIssue(None, None, key, f"{first_line(exc)}; signature: {title}")) from None
    hints = _hints(fn)
    issues = [
        SpecIssue(None, None, f"{key}.{name}", f"{problem} (signature: {title})")
        for name, value in kwargs.items()
        if name in hints and (problem := value_problem(value, hints[name]))
    ]
    if issues:
        raise SpecError(issues)


def _plain(sig: inspect.Signature) -> str:
    """``(optimizer: Optimizer, step_size: int, gamma: float = 0.1)``: annotations as written, unquoted."""
    parts = []
    for name, p in sig.parameters.items():
        if name == "self":
            continue
        text = {"VAR_POSITIONAL": f"*{name}", "VAR_KEYWORD": f"**{name}"}.get(p.kind.name, name)
        if p.annotation is not p.empty:
            ann = p.annotation
            text += f": {ann if isinstance(ann, str) else getattr(ann, '__name__', ann)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        parts.append(text)
    return "(" + ", ".join(parts) + ")"


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """Parameter annotations of ``fn`` (``__init__``'s for a class); unresolvable ones are left out."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    with contextlib.suppress(Exception):  # one name is missing (e.g. imported under TYPE_CHECKING): one by one
        return typing.get_type_hints(target)
    namespace = {**vars(typing), "Iterable": Iterable, "Sequence": Sequence, "Mapping": Mapping}
    namespace.update(getattr(target, "__globals__", {}))
    hints = {}
    for name, ann in getattr(target, "__annotations__", {}).items():
        try:
            hints[name] = eval(ann, namespace) if isinstance(ann, str) else ann  # an annotation, in its module's names
        except Exception:
            continue
    return hints
