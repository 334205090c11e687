"""Rules between fields of a spec, each checked in one place with one wording. Details: docs/design.md, "Module
notes"."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, model_validator

from runner.errors import mask_secrets, show

if TYPE_CHECKING:
    from runner.spec.schema import DataSpec, ExperimentSpec, SweepParam, TrackingSpec
    from runner.spec.schema_loop import OptimSpec, ParamGroupSpec, SchedulerSpec
    from runner.spec.schema_parallel import DevicesSpec, ParallelSpec


ON_CPU = 'accelerator = "cpu"'  # why a CUDA-only setting fails, when the spec alone says so
MOMENTUM_OPTIMIZERS = ("sgd", "rmsprop")  # the torch.optim classes that take ``momentum``, lower-case


def takes_momentum(optimizer: str) -> bool:
    """Whether ``optim.momentum`` applies to the optimizer ``optim.name`` names: sgd, rmsprop, or a factory of the
    user's (whose signature is theirs)."""
    return ":" in optimizer or optimizer.lower() in MOMENTUM_OPTIMIZERS


Problem = tuple[str, str]  # (dotted key, message)


class CrossFieldError(ValueError):
    """Several cross-field problems, each ``(dotted key, message)``; raised inside validation."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(f"{k}: {m}" for k, m in problems))


BARE_TRACKING_URIS = ("databricks", "databricks-uc", "uc")


TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")


def store_uri_problem(uri: str) -> str | None:
    """Why ``uri`` cannot be the tracking store (the message ends in the fix), or ``None``.

    Refused: empty; a file store (MLflow 3 opens one only with ``MLFLOW_ALLOW_FILE_STORE=true``); sqlite without a file;
    a scheme that is no tracking store unless a plugin registers it (``mlflow.tracking_store`` entry points).
    """
    text = uri.strip()
    scheme = urlsplit(text).scheme.lower()
    example = '"sqlite:///mlflow.db"'
    if not text:
        return (
            f"{show(uri)} is empty: remove the key (to use $MLFLOW_TRACKING_URI, else ./mlflow.db), or name a "
            f"store, e.g. {example}"
        )
    if scheme == "sqlite":
        path = text[len("sqlite:") :].lstrip("/").partition("?")[0]
        memory = not path or path.startswith(":memory:")
        if text.startswith("sqlite:///") and not memory:
            return None
        what = "an in-memory database: its runs would vanish when runner ends" if memory else "not a database file"
        path = "mlflow.db" if memory else path
        return (
            f"{show(mask_secrets(text))} is {what}: write three slashes and the path, "
            f'"sqlite:///{path}" (relative to here) or "sqlite:////abs/{path}"'
        )
    plugins = {entry.name.lower() for entry in entry_points(group="mlflow.tracking_store")}  # MLflow store plugins
    if text in BARE_TRACKING_URIS or scheme.partition("+")[0] in TRACKING_SCHEMES or scheme in plugins:
        return None
    if len(scheme) > 1 and scheme != "file":
        return (
            f"{show(mask_secrets(text))}: {scheme}: is not a tracking store (an artifact store, or unknown): name a "
            f"tracking server (http://HOST:PORT) or a database, e.g. {example}"
        )
    return (
        f"{show(text)} is a file store, which MLflow 3 no longer opens: use a database, "
        f"e.g. {example} (`mlflow migrate-filestore` moves existing runs into one), or a tracking server"
    )


def batch_split_problem(batch: int, world_size: int, grad_accum_steps: int) -> str | None:
    """``None`` when the global batch splits into ``world_size x grad_accum_steps`` equal micro-batches, else the
    message (at ``data.batch_size``) with the nearest fix."""
    per_step = world_size * grad_accum_steps
    if batch % per_step == 0:
        return None
    if world_size == 1:
        what = f"grad_accum_steps {grad_accum_steps}"
    else:
        what = f"world size {world_size}"
        if grad_accum_steps > 1:
            what += f" x grad_accum_steps {grad_accum_steps} = {per_step}"
    example = max(per_step, batch - batch % per_step)
    return f"batch_size = {batch} is not divisible by {what}: use a multiple of {per_step}, e.g. {example}"


def nproc_mismatch(nproc: int, ids: list[int] | str, chosen: int) -> str:
    """ddp on CUDA runs one process per chosen GPU; ``nproc_per_node`` says otherwise."""
    return (
        f"nproc_per_node = {nproc} but {chosen} GPU(s) are chosen (devices.ids = {show(ids)}): "
        f"ddp runs one process per GPU; set nproc_per_node = {chosen} or list {nproc} ids"
    )


def output_device_not_chosen(output_device: int, ids: list[int]) -> str:
    """dp gathers on ``output_device``, which must be one of the devices it runs on."""
    return f"output_device = {output_device} is not one of the chosen devices {ids} (devices.ids)"


# ----------------------------------------------------------------------------- table rules


def check_data(data: DataSpec) -> None:
    """Rules inside ``[data]``; ValueError for the first problem, its message starting with the key."""
    if data.val_fraction + data.test_fraction >= 1:
        raise ValueError(
            f"test_fraction = {data.test_fraction} and val_fraction = {data.val_fraction} leave no training sample: "
            "keep their sum below 1"
        )
    if data.persistent_workers and data.num_workers == 0:
        raise ValueError("persistent_workers = true needs num_workers > 0 (set num_workers or drop persistent_workers)")
    if (data.dataset == "imagefolder" or data.dataset.startswith("torchvision.")) and data.root is None:
        raise ValueError(f"dataset {data.dataset!r} reads files: set data.root to the folder that holds them")
    if data.dataset == "synthetic":
        size = data.num_samples * math.prod(data.input_shape) * 4  # float32 samples, made in memory at once
        if size > SYNTHETIC_MAX_BYTES:
            raise ValueError(
                f"num_samples = {data.num_samples} of input_shape {data.input_shape} make {size / 2**30:.3g} GiB of "
                f"float32 samples in memory, over {SYNTHETIC_MAX_BYTES // 2**30} GiB: lower num_samples or input_shape"
            )


SYNTHETIC_MAX_BYTES = 64 * 2**30  # synthetic data is made whole in host memory: past this it is a typo


def check_param_group(group: ParamGroupSpec) -> None:
    """Rules inside one ``[[optim.groups]]``: ``match`` compiles, kwargs do not repeat named keys (ValueError)."""
    try:
        re.compile(group.match)
    except re.error as exc:
        raise ValueError(f"match {group.match!r} is no regular expression: {exc}") from None
    clash = sorted({"lr", "momentum", "weight_decay", "params"} & set(group.kwargs))
    if clash:
        raise ValueError(f"kwargs repeats {', '.join(clash)}: set it as a key of the group itself")


def check_scheduler(scheduler: SchedulerSpec) -> None:
    """Rules inside ``[scheduler]``: a warm-up counts optimizer steps, so the schedule steps per step; a plateau
    schedule steps on ``monitor`` after each evaluation, and only it reads one (ValueError)."""
    plateau = scheduler.name.lower() == "reducelronplateau"
    if plateau and scheduler.monitor is None:
        raise ValueError('monitor is missing: ReduceLROnPlateau steps on a metric, e.g. monitor = "val/loss"')
    if scheduler.monitor is not None and not plateau and ":" not in scheduler.name:
        raise ValueError(f"monitor is read by ReduceLROnPlateau only; {scheduler.name} ignores metrics: remove it")
    if plateau and (scheduler.warmup_steps or scheduler.interval == "step"):
        raise ValueError('interval: ReduceLROnPlateau steps after each evaluation: keep interval = "epoch", no warm-up')
    if scheduler.warmup_steps and scheduler.interval != "step":
        raise ValueError(
            f'warmup_steps = {scheduler.warmup_steps} counts optimizer steps: set interval = "step" (and the '
            "schedule's own sizes in steps), or drop warmup_steps"
        )


def check_devices(devices: DevicesSpec) -> None:
    """Rules inside ``[devices]``: a non-empty list of distinct, non-negative ids (ValueError)."""
    ids = devices.ids
    if not isinstance(ids, list):
        return
    if not ids:
        raise ValueError('ids is empty: list at least one device index, e.g. [0], or use "all"')
    negative = [i for i in ids if i < 0]
    if negative:
        raise ValueError(f"ids {ids} contains negative indices {negative}: device ids count from 0")
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"ids {ids} lists {dupes} more than once: each device may appear once")


def check_parallel(par: ParallelSpec) -> None:
    """Rules inside ``[parallel]``: the endpoint's form, node rank and nodes where they apply (ValueError).

    Another mode's options are inactive, not errors (docs/design.md §10), so ``--set parallel.mode`` alone switches;
    ``nnodes > 1`` without ``rdzv_endpoint`` is a launch rule (:mod:`runner.plan`).
    """
    if par.rdzv_endpoint is not None:
        host, _, port = par.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f'rdzv_endpoint {par.rdzv_endpoint!r} must be host:port, e.g. "10.0.0.1:29500"')
    if "nnodes" not in par.traits.keys:
        return
    if par.node_rank >= par.nnodes:
        raise ValueError(f"node_rank = {par.node_rank} must be < nnodes = {par.nnodes}")


def check_optim(optim: OptimSpec) -> None:
    """Rules inside ``[optim]``: momentum is sgd's, kwargs do not repeat named keys (ValueError)."""
    if not takes_momentum(optim.name) and "momentum" in optim.model_fields_set:
        raise ValueError(
            f"momentum applies to sgd and rmsprop only, not {optim.name!r} (use kwargs.betas for adam and its kin)"
        )
    clash = sorted({"lr", "momentum", "weight_decay"} & set(optim.kwargs))
    if clash:
        raise ValueError(f"kwargs repeats {clash}: set them as optim.{clash[0]} instead")


def check_tracking(tracking: TrackingSpec) -> None:
    """Rules inside ``[tracking]``: ``uri`` is a database or a server (ValueError)."""
    if tracking.uri is not None and (problem := store_uri_problem(tracking.uri)):
        raise ValueError(f"uri = {problem}")


def check_sweep_param(param: SweepParam) -> None:
    """Rules of one ``[sweep.params."key"]``: values, or a range ``low < high`` (ValueError)."""
    if param.values is not None and _has_non_finite(param.values):
        raise ValueError(f"values {show(param.values)} holds inf or nan: list finite numbers")
    has_range = param.low is not None or param.high is not None
    if (param.values is None) == (not has_range):
        raise ValueError("give either values = [...] or low and high, not both and not neither")
    if has_range:
        if param.low is None or param.high is None or not param.low < param.high:
            raise ValueError(f"a range needs low < high, got low = {param.low}, high = {param.high}")
        if param.distribution == "log_uniform" and param.low <= 0:
            raise ValueError(f"log_uniform needs low > 0, got {param.low}")


# ----------------------------------------------------------------------------- rules across tables


def static_world_size(spec: ExperimentSpec) -> int | None:
    """The world size the spec alone fixes (1 for none and dp; ddp/fsdp's ``nnodes * nproc_per_node`` when known
    without the hardware), or ``None``."""
    par, dev = spec.parallel, spec.devices
    if not par.traits.elastic:
        return 1
    if par.nproc_per_node is not None:
        return par.nnodes * par.nproc_per_node
    if dev.accelerator == "cpu":
        return par.nnodes
    if dev.accelerator == "cuda" and isinstance(dev.ids, list):
        return par.nnodes * len(dev.ids)
    return None


def check_experiment(spec: ExperimentSpec) -> None:
    """Rules across tables that the spec alone decides; CrossFieldError with every problem at its key."""
    problems = cuda_only_problems(spec, ON_CPU) if spec.devices.accelerator == "cpu" else []
    problems += _layout_problems(spec) + _non_finite_problems(spec)
    for key in ("compile", "activation_checkpointing"):
        if getattr(spec.train, key) and not spec.parallel.traits.transforms_blocks:
            why = "DataParallel copies the module onto every device at each forward"
            fix = 'use mode = "none", "ddp" or "fsdp", or set it to false'
            problems.append((f"train.{key}", f'{key} cannot apply under mode = "{spec.parallel.mode}" ({why}): {fix}'))
    if spec.sweep is not None and spec.sweep.method != "grid" and spec.sweep.trials is None:
        problems.append(("sweep.trials", f'method = "{spec.sweep.method}" needs a trial budget: set trials = N'))
    if problems:
        raise CrossFieldError(problems)


def cuda_only_problems(spec: ExperimentSpec, why: str) -> list[Problem]:
    """The CUDA-only settings of ``spec`` (dp, nccl, sync_batchnorm, fp16) for a run on CPU, each message ending in
    ``why``."""
    par = spec.parallel
    keys = par.traits.keys  # an inactive key is never a problem (docs/design.md §10)
    problems: list[Problem] = []
    if par.traits.cuda_only:
        fix = 'use mode = "none", or "ddp" (backend gloo runs on CPU)'
        problems.append(("parallel.mode", f'mode = "{par.mode}" needs CUDA GPUs but {why}: {fix}'))
    if "backend" in keys and par.backend == "nccl":
        message = f'backend = "nccl" needs CUDA but {why}: use backend = "gloo" (or "auto")'
        problems.append(("parallel.backend", message))
    if "sync_batchnorm" in keys and par.sync_batchnorm:
        message = f"sync_batchnorm needs CUDA (SyncBatchNorm has no CPU kernel) but {why}: remove it, or run on GPUs"
        problems.append(("parallel.sync_batchnorm", message))
    if spec.train.amp == "fp16":
        problems.append(("train.amp", f'amp = "fp16" needs CUDA but {why}: use amp = "bf16" or "no"'))
    return problems


def _layout_problems(spec: ExperimentSpec) -> list[Problem]:
    """Device ids, processes and the batch split where the spec alone fixes them (``grad_accum_steps`` always)."""
    dev, par = spec.devices, spec.parallel
    ids = dev.ids if isinstance(dev.ids, list) else None
    problems: list[Problem] = []
    active = par.traits.keys
    chosen = ids is not None and par.output_device in ids
    if "output_device" in active and par.output_device is not None and ids is not None and not chosen:
        problems.append(("parallel.output_device", output_device_not_chosen(par.output_device, ids)))
    nproc = par.nproc_per_node if "nproc_per_node" in active and dev.accelerator == "cuda" else None
    if nproc is not None and ids is not None and nproc != len(ids):
        problems.append(("parallel.nproc_per_node", nproc_mismatch(nproc, ids, len(ids))))
    world = static_world_size(spec)
    known = world if world is not None else 1  # the machine's world size is checked by device resolution
    if problem := batch_split_problem(spec.data.batch_size, known, spec.train.grad_accum_steps):
        problems.append(("data.batch_size", problem))
    return problems


def _non_finite_problems(spec: ExperimentSpec) -> list[Problem]:
    """``inf`` or ``nan`` inside kwargs (typed keys and sweep values reject them on their own)."""
    free: list[tuple[str, Any]] = [
        ("model.kwargs", spec.model.kwargs),
        ("data.kwargs", spec.data.kwargs),
        ("optim.kwargs", spec.optim.kwargs),
        ("loss.kwargs", spec.loss.kwargs),
    ]
    if spec.scheduler is not None:
        free.append(("scheduler.kwargs", spec.scheduler.kwargs))
    if spec.metrics is not None:
        free += [("metrics.train", spec.metrics.train), ("metrics.val", spec.metrics.val)]
    message = "got {}; expected finite numbers (inf and nan are not accepted in a spec)"
    return [(key, message.format(show(value))) for prefix, tree in free for key, value in _non_finite(prefix, tree)]


def _non_finite(key: str, value: Any) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every value under ``key`` that is or holds a non-finite float."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _non_finite(f"{key}.{k}", v)
    elif _has_non_finite(value):
        yield key, value


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, dict)):
        return any(_has_non_finite(v) for v in (value.values() if isinstance(value, dict) else value))
    return False


INT64_LIMIT = 2**63
"""Exclusive upper bound of a seed or size passed to torch as a C ``int64`` (``seed + epoch`` stays below ``2**64``)."""
INT32_LIMIT = 2**31
"""Exclusive upper bound of a batch size: torch's samplers and kernels index a batch with a C ``int``."""
UINT32_LIMIT = 2**32
"""Exclusive upper bound of a seed passed to ``numpy.random.RandomState`` (Optuna's samplers)."""


class SpecTable(BaseModel):
    """Base of every spec table: strict, finite, no unknown keys, frozen; ``rule`` runs once its keys are valid.

    A key's description is the docstring beside it (pydantic's ``use_attribute_docstrings``): the JSON Schema, the
    key reference and the messages read it with its line breaks as spaces."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        validate_default=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
    )
    rule: ClassVar[Callable[[Any], None] | None] = None  # a runner.spec.rules check_* of this table

    @model_validator(mode="after")
    def _check_rule(self) -> SpecTable:
        rule = type(self).rule
        if rule is not None:
            rule(self)
        return self
