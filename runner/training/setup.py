"""One rank's training in named steps: build, restore, checkpointer, train, finish; the tracker is handed in.

The worker (``runner.launch.worker``) calls the steps in this order on a set-up
strategy, after seeding and after the ranks agreed on the run::

    parts = build_parts(spec, spec_dir, strategy)          # data, model, optimizer, scheduler, loss, precision
    restored = restore(parts, strategy, folder, resume=..., restarted=...)
    checkpointer = Checkpointer(parts, strategy, folder, loaded, run_id=..., writer=..., tracker=...)
    fitted = train(LoopParts(**vars(parts), strategy=strategy, tracker=tracker, ...), spec, restored.state)
    result = finish(fitted, strategy, notes)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runner.errors import mask_secrets
from runner.spec.dump import flatten_spec
from runner.strategies.base import Precision
from runner.strategies.distributed import describe_unused_parameters_error, is_unused_parameters_error
from runner.training import WorkerResult
from runner.training import checkpoint as ckpt
from runner.training.batches import BatchIO, check_target
from runner.training.callbacks import build_callbacks
from runner.training.data import build_datasets, capture_rng_state, restore_rng_state
from runner.training.ema import Ema
from runner.training.loop import LoopParts, TrainingParts, TrainState, fit
from runner.training.losses import BuiltinLoss, build_loss, build_optimizer, build_scheduler, scheduler_interval
from runner.training.metrics import build_metric_plan
from runner.training.models import build_model, with_data
from runner.training.sampling import build_loaders, check_batchnorm_batches
from runner.training.shards import load_checkpoint

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec
    from runner.spec.schema import ExperimentSpec
    from runner.spec.schema_loop import TrainSpec
    from runner.strategies.base import Strategy
    from runner.tracking.trackers import Tracker
    from runner.training.data import DatasetBundle


@dataclass
class Restored:
    """Where :func:`restore` left training: the state, the checkpoint it came from, notes, metrics recorded then."""

    state: TrainState
    resumed_from: str | None = None
    notes: list[str] = field(default_factory=list)
    metrics_recorded: int = 0


def count_total_steps(steps_per_epoch: int, train_spec: TrainSpec) -> int:
    """Optimizer steps of the whole run: ``steps_per_epoch * epochs``, capped by ``max_steps``."""
    total = steps_per_epoch * train_spec.epochs
    return total if train_spec.max_steps is None else min(total, train_spec.max_steps)


def build_parts(
    spec: ExperimentSpec,
    spec_dir: Path,
    strategy: Strategy,
    dtype: str | None = None,
    nudge: bool = False,
    bundle: DatasetBundle | None = None,
) -> TrainingParts:
    """Build data, model, optimizer, scheduler, loss and precision on a set-up strategy.

    ``dtype`` casts the model and every batch (``runner parity``); ``nudge`` moves each initial parameter by one ulp
    (parity's control); ``bundle`` is the datasets when already built. Raises SpecError: Something named in the spec
    does not build, a dict sample lacks the ``data.target`` needed, or BatchNorm would meet a 1-sample training batch.
    """
    bundle = build_datasets(spec, spec_dir) if bundle is None else bundle
    loss, metrics = build_loss(spec.loss, spec_dir), build_metric_plan(spec, bundle.info, spec_dir)
    on_target = any(r.output is None for r in (*metrics.train, *metrics.val))  # output metrics need no target
    check_target(bundle.info, spec, needs=loss.needs_target or metrics.counted_accuracy or on_target)
    if isinstance(loss, BuiltinLoss):
        loss.dataset_classes = bundle.info.num_classes
    cast = getattr(torch, dtype) if dtype is not None else None
    model = _setup_model(spec, spec_dir, bundle, cast, nudge)
    loaders = build_loaders(spec, bundle, strategy.rank, strategy.world_size)
    check_batchnorm_batches(model, spec, loaders, strategy.world_size, strategy.replicas)
    wrapped = strategy.wrap(model, spec.train)
    raw_model = strategy.unwrap(wrapped)
    total_steps = count_total_steps(loaders.steps_per_epoch, spec.train)
    optimizer = build_optimizer(spec.optim, raw_model.named_parameters(), spec_dir)  # the unwrapped model's names
    scheduler = build_scheduler(spec.scheduler, optimizer, total_steps, spec.train.epochs, spec_dir)
    return TrainingParts(
        model=wrapped,
        raw_model=raw_model,
        optimizer=optimizer,
        scheduler=scheduler,
        scheduler_interval=scheduler_interval(spec.scheduler),
        precision=Precision(spec.train.amp, strategy.device),
        loss=loss,
        io=BatchIO(spec.data.target, spec.model.output, spec.loss.name == "model", cast, spec.model.batch_dim),
        metrics=metrics,
        loaders=loaders,
        total_steps=total_steps,
        train_set=bundle.train,
        data=bundle.info,
        scheduler_monitor=spec.scheduler.monitor if spec.scheduler is not None else None,
        early_stopping=spec.early_stopping,
        ema=Ema(raw_model, spec.train.ema_decay) if spec.train.ema_decay is not None else None,
        callbacks=build_callbacks(spec.callbacks, spec_dir, strategy.rank),
    )


def _setup_model(
    spec: ExperimentSpec, spec_dir: Path, bundle: DatasetBundle, cast: torch.dtype | None, nudge: bool
) -> nn.Module:
    """The user's model, initialised identically on every rank (seeded with ``spec.seed``), cast and nudged."""
    torch.manual_seed(spec.seed)
    info = bundle.info
    model = build_model(
        with_data(spec.model, info, bundle.train), spec_dir, input_shape=info.input_shape, num_classes=info.num_classes
    )
    if cast is not None:
        model = model.to(cast)
    if nudge:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.nextafter(param, torch.full_like(param, torch.inf)))
    return model


def restore(parts: TrainingParts, strategy: Strategy, folder: Path, *, resume: bool, restarted: bool) -> Restored:
    """Load the newest valid checkpoint of ``folder`` on ``resume`` or an elastic restart, resharded to this job's
    layout (RNG only at the same world size). Raises CheckpointError: Every checkpoint in ``folder`` is damaged, or
    its model and optimizer do not fit the ones built."""
    if not (resume or restarted):
        return Restored(TrainState())
    state = checkpoint_state(parts, strategy)  # every rank reads the shards its layout needs

    def read(path: Path) -> dict[str, Any]:  # a checkpoint whose shards do not load is passed over, on every rank
        payload = ckpt.read_checkpoint(path)
        load_checkpoint(path, state)
        return payload

    found = ckpt.load_latest(folder, read)
    if found is None:
        return Restored(TrainState(), notes=[f"no checkpoint in {folder}: starting from step 0"] if resume else [])
    payload = found.payload
    strategy.set_checkpoint_state(parts.model, parts.optimizer, state)
    if parts.scheduler is not None and payload["scheduler"] is not None:
        parts.scheduler.load_state_dict(payload["scheduler"])
    parts.precision.load_state_dict(payload["scaler"])
    notes = []
    rng = payload["rng"]
    if len(rng) == strategy.world_size:
        restore_rng_state(rng[strategy.rank])
    else:
        notes.append(f"world size changed ({len(rng)} -> {strategy.world_size}): RNG states not restored")
    notes += [f"skipped {reason}" for _, reason in found.skipped]
    recorded = int(payload.get("tracking", {}).get("metrics_recorded", 0))
    return Restored(TrainState(**payload["state"]), str(found.path), notes, recorded)


def best_checkpoint(spec: ExperimentSpec, folder: Path, strategy: Strategy) -> Path | None:
    """``checkpoint.monitor``'s best checkpoint in ``folder`` as rank 0 finds it, the same on every rank (a
    collective), or ``None`` (no monitor, or no checkpoint recorded its value)."""
    settings = spec.checkpoint
    if not settings.enabled or settings.monitor is None:
        return None
    found = ckpt.ranked(ckpt.list_checkpoints(folder), settings.goal) if strategy.rank == 0 else []
    best: Path | None = strategy.all_gather_object(found[0] if found else None)[0]
    return best


def best_record(spec: ExperimentSpec, path: Path) -> tuple[str, float, int]:
    """``(metric, value, step)`` of the best checkpoint ``path``, as the run records it."""
    assert spec.checkpoint.monitor is not None
    return spec.checkpoint.monitor, ckpt.monitored_value(path) or math.nan, ckpt.checkpoint_step(path)


def describe_best(best: tuple[str, float, int] | None) -> str:
    """The note on the best checkpoint ``(metric, value, step)``, ``""`` without one."""
    note = "best checkpoint: step {2}, {0} = {1:.6g} (the logged model and `runner export --best`)"
    return "" if best is None else note.format(*best)


def load_weights(parts: TrainingParts, strategy: Strategy, path: Path) -> None:
    """Load the model and optimizer of checkpoint ``path`` into ``parts``, resharded to this layout (a collective)."""
    state = checkpoint_state(parts, strategy)
    load_checkpoint(path, state)
    strategy.set_checkpoint_state(parts.model, parts.optimizer, state)


def checkpoint_state(parts: TrainingParts, strategy: Strategy) -> dict[str, Any]:
    """What a checkpoint's shards hold: the strategy's model and optimizer state, and the weights' moving average
    (filled in place on load)."""
    state = strategy.checkpoint_state(parts.model, parts.optimizer)
    if parts.ema is not None:
        state["ema"] = parts.ema.state()
    return state


class Checkpointer:
    """The loop's ``on_checkpoint``: every rank hands in its RNG state, the writer saves, all wait.

    The tracker is flushed first, so a checkpoint's metric count is in MLflow or its spool.
    """

    def __init__(
        self,
        parts: TrainingParts,
        strategy: Strategy,
        folder: Path,
        loaded: LoadedSpec,
        *,
        run_id: str | None,
        writer: bool,
        tracker: Tracker,
    ) -> None:
        self.parts = parts
        self.strategy = strategy
        self.folder = folder
        self.settings = loaded.spec.checkpoint
        self.spec_sha256 = loaded.sha256
        self.run_id = run_id
        self.writer = writer
        self.tracker = tracker
        flat = flatten_spec(loaded.spec)  # the same for every checkpoint of this run
        self.spec_flat = {k: mask_secrets(v) if isinstance(v, str) else v for k, v in flat.items()}
        # checkpoints saved while training goes on, on a group of their own (made here: a collective)
        self.background = self.settings.enabled and self.settings.async_save
        self.group = strategy.save_group() if self.background else None
        self.pending: ckpt.PendingSave | None = None

    def __call__(self, state: TrainState, reason: str) -> None:
        """Save ``state`` (a collective: call on every rank). ``reason`` is ``"step"``, ``"epoch"`` or ``"signal"``;
        a signal's checkpoint is written before the call returns, the others in the background where asked."""
        rng_states = self.strategy.all_gather_object(capture_rng_state())
        if not self.settings.enabled:
            self.strategy.barrier()
            return
        shards = checkpoint_state(self.parts, self.strategy)  # nothing is gathered
        payload = self._payload(state, rng_states)
        self.wait()  # one background save at a time, in step order
        keep = self.settings.keep_last
        barrier = self.strategy.barrier
        background = self.background and reason != "signal"
        best = (self.settings.keep_best if self.settings.monitor else 0, self.settings.goal)
        self.pending = ckpt.save_checkpoint(
            self.folder,
            shards,
            payload,
            state.global_step,
            keep,
            barrier,
            background=background,
            group=self.group,
            keep_best=best,
        )
        self.strategy.barrier()

    def wait(self) -> None:
        """Finish the background save in flight, if any (every rank); CheckpointError names a failed one."""
        pending = self.pending
        self.pending = None
        if pending is not None:
            pending.finish()

    def _payload(self, state: TrainState, rng_states: list[dict[str, Any]]) -> dict[str, Any] | None:
        """What the writing rank saves (``None`` on the others)."""
        if not self.writer:
            return None
        # Metrics up to a checkpoint must be sent (or spooled) before it is written: a resume
        # continues from the checkpoint and only logs again what comes after it.
        self.tracker.flush()
        return ckpt.build_payload(
            scheduler=self.parts.scheduler,
            scaler=self.parts.precision,  # its state_dict() is None without scaling
            state=state,
            rng_states=rng_states,
            spec_flat=self.spec_flat,
            spec_sha256=self.spec_sha256,
            run_id=self.run_id,
            metrics_recorded=self.tracker.recorded(),
            monitored=_monitored(state, self.settings.monitor),
        )


def _monitored(state: TrainState, monitor: str | None) -> float | None:
    """``monitor``'s value when the epoch that logged it ended at this checkpoint's step, else ``None``."""
    if monitor is None or state.evaluated is None or state.evaluated_at != state.global_step:
        return None
    return state.evaluated.get(monitor)


@contextlib.contextmanager
def profiled(loop: LoopParts, spec: ExperimentSpec, folder: Path) -> Iterator[LoopParts]:
    """``loop`` under ``torch.profiler`` when ``[profile]`` names this rank, else untouched.

    After ``profile.wait`` steps, one warm-up and ``profile.active`` recorded steps, the rank writes
    ``profile/rank<N>.trace.json`` and ``rank<N>.ops.txt``, uploaded as the run's artifacts.
    """
    profile = spec.profile
    if profile is None or loop.strategy.rank not in profile.ranks:
        yield loop
        return
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as torch_profile

    out = folder / "profile"
    rank = loop.strategy.rank
    out.mkdir(parents=True, exist_ok=True)

    def ready(prof: torch_profile) -> None:
        prof.export_chrome_trace(str(out / f"rank{rank}.trace.json"))
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        (out / f"rank{rank}.ops.txt").write_text(table + "\n", encoding="utf-8")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if loop.strategy.device.type == "cuda" else [])
    steps = schedule(wait=profile.wait, warmup=1, active=profile.active, repeat=1)
    with torch_profile(activities=activities, schedule=steps, on_trace_ready=ready, record_shapes=True) as prof:
        yield dataclasses.replace(loop, after_step=prof.step)


def profile_notes(spec: ExperimentSpec, rank: int, folder: Path) -> list[str]:
    """A note when ``[profile]`` asked this rank to record and it recorded nothing: the job ended before
    ``wait`` steps, the warm-up step and ``active`` steps had run."""
    profile = spec.profile
    if profile is None or rank not in profile.ranks or (folder / "profile" / f"rank{rank}.trace.json").exists():
        return []
    return [
        f"[profile] recorded nothing on rank {rank}: the job ended before wait = {profile.wait} steps, one warm-up "
        f"step and active = {profile.active} steps had run; lower profile.wait"
    ]


def train(loop: LoopParts, spec: ExperimentSpec, state: TrainState) -> WorkerResult:
    """Run :func:`fit`; DDP's unused-parameter error becomes a TrainingError naming them. Raises Interrupted on a
    stop."""
    try:
        return fit(loop, spec.train, state, spec.checkpoint if spec.checkpoint.enabled else None)
    except RuntimeError as exc:
        if is_unused_parameters_error(exc):
            raise describe_unused_parameters_error(exc, loop.model) from None
        raise


def describe_settings(settings: dict[str, str]) -> str:
    """The settings deterministic mode switched on, ``"setting=value, ..."`` (for a note and a tag)."""
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def finish(fitted: WorkerResult, strategy: Strategy, notes: list[str]) -> WorkerResult:
    """:func:`fit`'s result with the notes and this rank's peak memory."""
    return dataclasses.replace(
        fitted,
        notes=notes,
        peak_memory_bytes=peak_memory_bytes(strategy.device),
        device=str(strategy.device),
        device_peaks=device_peaks(strategy.device, strategy.traits.replicas),
    )


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak of ``device``, else this process's peak resident set size (bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes() or 0


def device_peaks(device: torch.device, replicas: bool) -> list[int]:
    """CUDA allocator peak of each GPU this process drove: every visible one for dp (``replicas``), else ``device``."""
    if device.type != "cuda":
        return []
    ids = range(torch.cuda.device_count()) if replicas else [device.index or 0]
    return [int(torch.cuda.max_memory_allocated(i)) for i in ids]


def peak_rss_bytes() -> int | None:
    """Peak resident set of this process image (``VmHWM``, which starts afresh at ``exec``), bytes; ``None`` off
    Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
