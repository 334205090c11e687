"""Pydantic models of an experiment spec: the root table and the tables of what is trained and recorded (model,
data, tracking, checkpoints, sweeps, profiling), their keys, types, ranges and meanings.

A spec is checked whole before anything runs, so a mistake costs seconds and names its key. Each table checks the
rules between its own keys (``check``); the root checks those across tables, e.g. that a watched metric is one an
epoch logs (§18). Rules that need the machine (visible GPUs, CUDA) are ``runner.devices.resolve``'s, so
``runner validate`` answers alike on a laptop and a GPU node. Conventions: counts are strict integers (``2.0`` is
rejected); hyperparameters are floats (``lr = 1`` is ``1.0``); booleans are strict; every number is finite, also
inside ``kwargs`` and sweep values; no table takes unknown keys, and each is frozen; ``data.batch_size`` is the
global batch. ``[optim]``, ``[scheduler]``, ``[early_stopping]`` and ``[train]`` are in ``runner.spec.schema_loop``,
``[devices]`` and ``[parallel]`` in ``runner.spec.schema_parallel``, ``[loss]`` and ``[metrics]`` in
``runner.spec.names``; their base is ``runner.spec.rules.SpecTable``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from runner.errors import did_you_mean, show, with_hint
from runner.spec import names
from runner.spec.names import LossSpec, MetricsSpec
from runner.spec.rules import (
    INT32_LIMIT,
    INT64_LIMIT,
    ON_CPU,
    SYNTHETIC_MAX_BYTES,
    UINT32_LIMIT,
    CrossFieldError,
    Problem,
    SpecTable,
    batch_split_problem,
    has_non_finite,
    non_finite,
    nproc_mismatch,
    output_device_not_chosen,
    store_uri_problem,
)
from runner.spec.schema_loop import (
    CallbackSpec,
    EarlyStoppingSpec,
    Goal,
    OptimSpec,
    SchedulerSpec,
    TrainSpec,
    without,
)
from runner.spec.schema_parallel import DevicesSpec, ParallelSpec


class TrackingSpec(SpecTable):
    """``[tracking]``: MLflow."""

    enabled: bool = True
    """Record the run in MLflow."""
    uri: str | None = None
    """Tracking URI: a database (`sqlite:///runs.db`, `postgresql://...`) or a server (`http://host:5000`);
    file stores are not accepted. Default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working
    directory."""
    experiment: str | None = Field(default=None, min_length=1)
    """MLflow experiment name (created if missing). Default: the spec's name."""
    run_name: str | None = Field(default=None, min_length=1)
    """MLflow run name, not empty (remove the key for the default). Default: the spec's name, mode and
    devices, and the values the command line changed, e.g. `digits-mlp ddp-2 lr=0.05`."""
    log_model: bool = False
    """Log the trained model with mlflow.pytorch.log_model at the end (a LoggedModel with an input example, a
    signature and the input normalisation inside)."""
    system_metrics: bool = False
    """Record MLflow system metrics (CPU, memory, GPU)."""
    flush_every_s: float = Field(default=5.0, gt=0, le=3600)
    """Send buffered metrics at least this often (seconds, at most an hour), by MLflow's async logging."""

    def check(self) -> None:
        """Rules inside ``[tracking]``: ``uri`` is a database or a server (ValueError)."""
        if self.uri is not None and (problem := store_uri_problem(self.uri)):
            raise ValueError(f"uri = {problem}")


class CheckpointSpec(SpecTable):
    """``[checkpoint]``: periodic, atomic checkpoints for resume."""

    enabled: bool = True
    """Write checkpoints."""
    dir: str | None = None
    """Folder for checkpoints; a relative path is relative to the file that writes it, or to the current
    directory when given with --set. Default: `checkpoints/<run id>` next to the tracking store."""
    every_n_epochs: int = Field(default=1, ge=1)
    """Checkpoint every N epochs."""
    every_n_steps: int | None = Field(default=None, ge=1)
    """Also checkpoint every N optimizer steps. Default: off."""
    keep_last: int = Field(default=2, ge=1)
    """Keep the newest N checkpoints."""
    monitor: str | None = Field(default=None, min_length=1)
    """Also keep the checkpoints with the best value of this metric, e.g. "val/accuracy" (any metric logged
    per epoch); `runner export --best` and the logged model take the best one. Default: none."""
    goal: Goal = "min"
    """checkpoint.monitor: whether a smaller or larger value is better."""
    keep_best: int = Field(default=1, ge=1, lt=INT64_LIMIT)
    """checkpoint.monitor: the best N checkpoints kept beside keep_last."""
    log_to_mlflow: bool = False
    """Also log the final checkpoint as an MLflow artifact."""
    async_save: bool = False
    """Write step and epoch checkpoints in the background (torch.distributed.checkpoint.async_save) while
    training goes on; the run waits for the last one before it ends."""


class ProfileSpec(SpecTable):
    """``[profile]``: ``torch.profiler`` around a few training steps; its trace and top operators become artifacts."""

    wait: int = Field(default=1, ge=0, lt=INT64_LIMIT)
    """Optimizer steps run before the profiler starts."""
    active: int = Field(default=3, ge=1, lt=INT64_LIMIT)
    """Steps recorded (after one warm-up step)."""
    ranks: list[Annotated[int, Field(ge=0, lt=INT64_LIMIT)]] = Field(default_factory=lambda: [0])
    """Ranks that profile themselves (global ranks, from 0)."""


class SweepParam(SpecTable):
    """One swept key in ``[sweep.params]``: explicit values or a numeric range."""

    values: list[Any] | None = Field(default=None, min_length=1)
    """Explicit values to try."""
    low: float | None = None
    """Lower bound of a sampled range (random and tpe)."""
    high: float | None = None
    """Upper bound of a sampled range (random and tpe)."""
    distribution: Literal["uniform", "log_uniform", "int_uniform"] = "uniform"
    """How a range is sampled."""

    def check(self) -> None:
        """Rules of one ``[sweep.params."key"]``: values, or a range ``low < high`` (ValueError)."""
        if self.values is not None and has_non_finite(self.values):
            raise ValueError(f"values {show(self.values)} holds inf or nan: list finite numbers")
        has_range = self.low is not None or self.high is not None
        if (self.values is None) == (not has_range):
            raise ValueError("give either values = [...] or low and high, not both and not neither")
        if has_range:
            if self.low is None or self.high is None or not self.low < self.high:
                raise ValueError(f"a range needs low < high, got low = {self.low}, high = {self.high}")
            if self.distribution == "log_uniform" and self.low <= 0:
                raise ValueError(f"log_uniform needs low > 0, got {self.low}")


class SweepSpec(SpecTable):
    """``[sweep]``: many trials of one spec, searched by Optuna (see ``runner sweep``, docs/design.md §16)."""

    method: Literal["grid", "random", "tpe"] = "grid"
    """Optuna sampler: grid (GridSampler, every combination), random (RandomSampler) or tpe (TPESampler)."""
    trials: int | None = Field(default=None, ge=1)
    """Trials in total, over every worker (random and tpe: required; grid: at most the grid size). Default:
    the grid size."""
    seed: int = Field(default=0, ge=0, lt=UINT32_LIMIT)
    """Seed of the sampler; 0 <= seed < 2**32 (Optuna's samplers seed NumPy's RandomState)."""
    metric: str = "val/accuracy"
    """Metric that ranks trials."""
    goal: Literal["max", "min"] = "max"
    """Whether a larger or smaller metric is better."""
    pruner: Literal["none", "median", "hyperband"] = "none"
    """Stop poor trials early on the per-epoch metric: none, median (MedianPruner) or hyperband
    (HyperbandPruner)."""
    pruner_startup_trials: int = Field(default=5, ge=0)
    """median only: trials that finish before any is pruned."""
    pruner_warmup_epochs: int = Field(default=0, ge=0)
    """Epochs every trial trains before it may be pruned."""
    storage: str | None = None
    """Optuna storage URL of the study, shared by every worker, e.g. `postgresql+psycopg://user@host/db`.
    Default: sqlite `optuna.db` next to the MLflow store."""
    study: str | None = None
    """Optuna study name; workers with the same name and storage share one sweep. Default: the spec name and a
    hash of the trial spec and the sweep."""
    params: dict[str, SweepParam] = Field(default_factory=dict)
    """Dotted spec key -> values or range, e.g. `"optim.lr" = { values = [0.1, 0.01] }`."""


TorchSize = Annotated[int, Field(ge=1, lt=INT64_LIMIT)]  # a tensor dimension: torch takes a C int64


class ModelSpec(SpecTable):
    """``[model]``: which network to build."""

    name: str = Field(min_length=1)
    """Model to build: a torchvision builder (`torchvision.resnet18`), a built-in (`mlp`, `cnn`) or an import
    path `pkg.module:factory` returning an nn.Module."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the builder, e.g. `{ num_classes = 10 }`."""
    output: str | int | None = None
    """The prediction in a dict, dataclass or tuple output: a key, attribute or index."""
    batch_dim: int = Field(default=0, ge=0, le=8)
    """Where the samples' dimension is in the tensors forward gets and in the target: 1 for a sequence-first
    model (time, batch, ...), as nn.LSTM without batch_first takes them. Samples are collated on dimension 0,
    then moved there; the loss counts the same samples and tokens either way. Under dp, set parallel.dim
    alike."""

    @field_validator("name")
    @classmethod
    def _known_model(cls, name: str, info: ValidationInfo) -> str:
        return _known(functools.partial(names.name_problem, model=True), name, info)


class TransformSpec(SpecTable):
    """One entry of ``data.transforms``: a transform class and its keyword arguments."""

    name: str = Field(min_length=1)
    """A torchvision.transforms.v2 class (e.g. "RandomHorizontalFlip") or "pkg.module:Transform"."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the class."""


Transforms = list[Annotated[str, Field(min_length=1)] | TransformSpec]


def transform_names(entries: Transforms) -> list[str]:
    """The class names of ``data.transforms`` entries, bare or in a table."""
    return [entry if isinstance(entry, str) else entry.name for entry in entries]


class DataSpec(SpecTable):
    """``[data]``: dataset, split and loader settings. ``batch_size`` is global."""

    dataset: str = Field(min_length=1)
    """Dataset: `sklearn.digits` or `sklearn.diabetes` (shipped with scikit-learn), `torchvision.<Name>` (e.g.
    `torchvision.MNIST`, read from `root`), `imagefolder` (`root`/train and `root`/val), `synthetic` (seeded
    random tensors) or `pkg.module:factory` (samples `(x, y)` or dicts of tensors)."""
    root: str | None = None
    """Folder holding the data for torchvision and imagefolder datasets; a relative path is relative to the
    file that writes it, or to the current directory when given with --set."""
    download: bool = False
    """Let torchvision download missing files into `root`; without it runs never touch the network."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the dataset builder or factory."""
    target: str | None = Field(default=None, min_length=1)
    """Dict samples: the target key, e.g. "labels"."""
    image_size: int | None = Field(default=None, ge=1, lt=INT64_LIMIT)
    """Resize images to `image_size` x `image_size` pixels (e.g. 32 for ResNet on digits). Default: native
    size."""
    num_channels: int | None = Field(default=None, ge=1, lt=INT64_LIMIT)
    """Repeat grayscale images to this many channels (3 for ImageNet-style models), or make RGB images
    grayscale with 1. Default: native."""
    batch_size: int = Field(ge=1, lt=INT32_LIMIT)
    """GLOBAL batch size: samples per optimizer step across all devices and processes. dp scatters it; ddp
    loads batch_size / world_size per rank (must divide)."""
    eval_batch_size: int | None = Field(default=None, ge=1, lt=INT32_LIMIT)
    """Global batch size for evaluation. Default: `batch_size`."""
    val_fraction: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Fraction of the training set held out for validation (drawn with `split_seed`); 0 disables."""
    test_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Fraction of the training set held out as the test split (drawn with `split_seed` after the validation
    samples, so these stay the same); the final model is scored on it at the end (`test/*`). For datasets
    split by val_fraction; imagefolder reads `root`/test, a factory may return (train, val, test)."""
    transforms: Transforms = Field(default_factory=list)
    """Transforms of each training sample, in order: torchvision.transforms.v2 names or tables, e.g.
    ["RandomHorizontalFlip", { name = "Normalize", kwargs = { mean = [0.5], std = [0.5] } }]; they see the
    sample as the dataset gives it (images as float tensors in [0, 1], after image_size and num_channels)."""
    eval_transforms: Transforms = Field(default_factory=list)
    """Transforms of each validation and test sample (e.g. the same Normalize, no augmentation)."""
    split_seed: int = Field(default=0, ge=0, lt=INT64_LIMIT)
    """Seeds the validation split (and the samples of `synthetic`), apart from `seed`: runs that change `seed`
    score on the same validation samples; 0 <= split_seed < 2**63 (a torch.Generator seed)."""
    shuffle: bool = True
    """Reshuffle training samples every epoch."""
    drop_last: bool = False
    """Drop the last incomplete training batch of each epoch."""
    num_workers: int = Field(default=0, ge=0, le=256)
    """DataLoader worker processes per rank (at most 256)."""
    pin_memory: bool = False
    """Pin host memory for faster host-to-GPU copies."""
    persistent_workers: bool = False
    """Keep DataLoader workers alive between epochs (needs num_workers > 0)."""
    num_samples: int = Field(default=1024, ge=1, lt=INT64_LIMIT)
    """`synthetic` only: number of samples."""
    input_shape: list[TorchSize] = Field(default_factory=lambda: [64], min_length=1)
    """`synthetic` only: shape of one sample, e.g. [3, 32, 32]."""
    num_classes: int = Field(default=10, ge=2, lt=INT64_LIMIT)
    """`synthetic` only: number of classes."""

    def check(self) -> None:
        """Rules inside ``[data]``; ValueError for the first problem, its message starting with the key."""
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError(
                f"test_fraction = {self.test_fraction} and val_fraction = {self.val_fraction} leave no training "
                "sample: keep their sum below 1"
            )
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError(
                "persistent_workers = true needs num_workers > 0 (set num_workers or drop persistent_workers)"
            )
        if (self.dataset == "imagefolder" or self.dataset.startswith("torchvision.")) and self.root is None:
            raise ValueError(f"dataset {self.dataset!r} reads files: set data.root to the folder that holds them")
        if self.dataset == "synthetic":
            size = self.num_samples * math.prod(self.input_shape) * 4  # float32 samples, made in memory at once
            if size > SYNTHETIC_MAX_BYTES:
                raise ValueError(
                    f"num_samples = {self.num_samples} of input_shape {self.input_shape} make {size / 2**30:.3g} "
                    f"GiB of float32 samples in memory, over {SYNTHETIC_MAX_BYTES // 2**30} GiB: lower num_samples or "
                    "input_shape"
                )

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, name: str, info: ValidationInfo) -> str:
        return _known(functools.partial(names.name_problem, model=False), name, info)


def _known(problem_of: Callable[[str, Path | None], str | None], name: str, info: ValidationInfo) -> str:
    """Check a model or dataset name when a file is validated (``context`` has its ``spec_dir``); else when built."""
    if not isinstance(info.context, dict) or "spec_dir" not in info.context:
        return name
    return without(problem_of(name, info.context["spec_dir"]), name)


class ExperimentSpec(SpecTable):
    """A whole experiment spec: the root of the TOML file."""

    name: str = Field(min_length=1)
    """Experiment name; also the default MLflow experiment."""
    description: str = ""
    """Free text, recorded as the MLflow run description."""
    seed: int = Field(default=0, ge=0, lt=INT64_LIMIT)
    """Seeds Python, NumPy, torch (CPU and CUDA) and DataLoader workers; 0 <= seed < 2**63 (torch.manual_seed
    takes 64 bits, and epoch e shuffles with seed + e)."""
    deterministic: bool = False
    """Use PyTorch's deterministic algorithms (and the settings they need)."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Extra MLflow tags for the run; MLflow tags are strings, so `--set tags.a=1` records "1"."""
    model: ModelSpec
    """The network to build."""
    data: DataSpec
    """Dataset, split and loaders; batch_size is global."""
    devices: DevicesSpec = Field(default_factory=DevicesSpec)
    """Accelerator and device ids."""
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    """Parallel mode (none, dp, ddp, fsdp) and its options."""
    optim: OptimSpec
    """The optimizer."""
    scheduler: SchedulerSpec | None = None
    """Optional learning-rate schedule."""
    early_stopping: EarlyStoppingSpec | None = None
    """End training when a metric stops improving. Default: off."""
    loss: LossSpec = Field(default_factory=LossSpec)
    """The loss minimised."""
    metrics: MetricsSpec | None = None
    """torchmetrics; default: accuracy when classifying."""
    train: TrainSpec = Field(default_factory=TrainSpec)
    """The training loop."""
    callbacks: list[CallbackSpec] = Field(default_factory=list)
    """Your objects whose hooks training calls; rank 0 only unless they ask."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """MLflow tracking."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpoints for resume."""
    sweep: SweepSpec | None = None
    """Trials for `runner sweep`; ignored by `runner exec`."""
    profile: ProfileSpec | None = None
    """Profile a few steps with torch.profiler: a Chrome trace (chrome://tracing, Perfetto) and the top
    operators, logged as artifacts `profile/rank<N>.trace.json` and `profile/rank<N>.ops.txt`. Default: off."""

    def check(self) -> None:
        """Rules across tables that the spec alone decides; CrossFieldError with every problem at its key."""
        problems = cuda_only_problems(self, ON_CPU) if self.devices.accelerator == "cpu" else []
        problems += _layout_problems(self) + _non_finite_problems(self)
        for key in ("compile", "activation_checkpointing"):
            if getattr(self.train, key) and not self.parallel.traits.transforms_blocks:
                why = "DataParallel copies the module onto every device at each forward"
                fix = 'use mode = "none", "ddp" or "fsdp", or set it to false'
                problems.append(
                    (f"train.{key}", f'{key} cannot apply under mode = "{self.parallel.mode}" ({why}): {fix}')
                )
        if self.sweep is not None and self.sweep.method != "grid" and self.sweep.trials is None:
            problems.append(("sweep.trials", f'method = "{self.sweep.method}" needs a trial budget: set trials = N'))
        if problems:
            raise CrossFieldError(problems)

    @model_validator(mode="after")
    def _monitored(self) -> ExperimentSpec:
        if problems := monitor_problems(self):
            raise CrossFieldError(problems)
        return self

    @property
    def experiment_name(self) -> str:
        return self.tracking.experiment or self.name


MONITORS = ("scheduler.monitor", "early_stopping.metric", "checkpoint.monitor")  # keys that name a watched metric
VAL_SPLITS = ("sklearn.", "synthetic", "torchvision.")  # their validation split is data.val_fraction's


def epoch_metrics(spec: ExperimentSpec) -> list[str]:
    """The metrics logged at the end of an epoch, which a monitor may watch: the two losses, and accuracy (the
    default of a classification loss) or the ``[metrics]`` entries."""
    logged = ["train/epoch_loss", "val/loss"]
    if spec.metrics is None:
        return logged + (["train/accuracy", "val/accuracy"] if spec.loss.name in names.CLASSIFICATION_LOSSES else [])
    logged += [f"train/{names.logged_name(entry)}" for entry in spec.metrics.train]
    return logged + [f"val/{names.logged_name(entry)}" for entry in spec.metrics.val]


def monitor_problems(spec: ExperimentSpec) -> list[tuple[str, str]]:
    """``(key, message)`` for each watched metric (:data:`MONITORS`) that no epoch logs, or that needs a validation
    split the spec turned off."""
    known, problems = epoch_metrics(spec), []
    for key in MONITORS:
        table, field = key.split(".")
        name = getattr(getattr(spec, table), field, None) if getattr(spec, table) is not None else None
        if name is None:
            continue
        if name not in known:
            message = f"{show(name)} is not logged at the end of an epoch; expected one of {', '.join(known)}"
            problems.append((key, with_hint(message, did_you_mean(name, known))))
        elif name.startswith("val/") and spec.data.val_fraction == 0 and spec.data.dataset.startswith(VAL_SPLITS):
            message = f"{show(name)} needs a validation split, but data.val_fraction = 0: set it above 0"
            problems.append((key, message))
    return problems


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
    return [(key, message.format(show(value))) for prefix, tree in free for key, value in non_finite(prefix, tree)]
