"""Per-rank DataLoaders: micro-batches in ``EpochSampler`` order, the validation split across ranks; batch checks."""

from __future__ import annotations

import math
from collections.abc import Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from runner.training.models import spec_issue
from runner.training.sampling import EpochSampler, EvalSampler, global_batch_sizes, micro_batch_sizes
from runner.training.seeding import loader_generator, worker_init_fn

if TYPE_CHECKING:
    from runner.spec.schema import ExperimentSpec
    from runner.training.data import DatasetBundle


@dataclass
class Loaders:
    """A rank's training and validation DataLoaders and the step layout of an epoch.

    Attributes:
        train: Training DataLoader; its batches are micro-batches of ``micro_batch`` samples.
        val: Validation DataLoader over this rank's share (``EvalSampler``), or ``None``.
        train_sampler: The :class:`~runner.training.sampling.EpochSampler` of ``train``; call its
            ``set_epoch`` (and ``set_start_batch`` when resuming) before every epoch.
        micro_batch: ``batch_size // (world_size * grad_accum_steps)``.
        steps_per_epoch: Optimizer steps per epoch (``len(global_batch_sizes)``).
        global_batch_sizes: Samples of every optimizer step of an epoch, all ranks together.
    """

    train: DataLoader
    val: DataLoader | None
    train_sampler: EpochSampler
    micro_batch: int
    steps_per_epoch: int
    global_batch_sizes: list[int]


def build_loaders(spec: ExperimentSpec, bundle: DatasetBundle, rank: int, world_size: int) -> Loaders:
    """Build this rank's DataLoaders.

    The training loader yields micro-batches of ``batch_size // (world_size * grad_accum_steps)``
    samples in :class:`~runner.training.sampling.EpochSampler` order: each group of micro-batches that makes
    one optimizer step is this rank's share of one global batch (see :mod:`runner.training.sampling`).
    The validation loader gives this rank every ``world_size``-th sample, in batches of
    ``ceil(eval_batch_size / world_size)``. ``data.batch_size`` is a multiple of ``world_size x
    grad_accum_steps``: the schema and device resolution check that once, before any process starts.

    Args:
        rank: Global rank of this process (0 for ``none``/``dp``).
        world_size: Number of processes (1 for ``none``/``dp``).

    Returns:
        The :class:`Loaders`.

    Raises:
        SpecError: (``data.batch_size``) an epoch would have no step (fewer training samples
            than one global batch with ``drop_last``, or than the world size).
    """
    data = spec.data
    micro = data.batch_size // (world_size * spec.train.grad_accum_steps)
    num_train = _size(bundle.train)
    sizes = global_batch_sizes(num_train, data.batch_size, data.drop_last, world_size)
    if not sizes:
        raise spec_issue(
            "data.batch_size",
            f"batch_size = {data.batch_size} leaves no training step: there are only {num_train} training samples"
            + (" and drop_last = true" if data.drop_last else f" for world size {world_size}")
            + "; use a smaller batch_size",
        )
    workers: dict[str, Any] = dict(
        num_workers=data.num_workers,
        pin_memory=data.pin_memory and torch.cuda.is_available(),
        persistent_workers=data.persistent_workers and data.num_workers > 0,
        worker_init_fn=worker_init_fn,
    )
    generator = loader_generator(spec.seed, rank)
    sampler = EpochSampler(
        num_train, world_size, rank, spec.seed, data.shuffle, data.batch_size, data.drop_last, generator=generator
    )
    train = DataLoader(bundle.train, batch_size=micro, sampler=sampler, drop_last=False, generator=generator, **workers)
    val = None
    if bundle.val is not None and _size(bundle.val) > 0:
        eval_batch = math.ceil((data.eval_batch_size or data.batch_size) / world_size)
        val = DataLoader(
            bundle.val,
            batch_size=eval_batch,
            sampler=EvalSampler(_size(bundle.val), world_size, rank),
            drop_last=False,
            generator=loader_generator(spec.seed, rank),
            **workers,
        )
    return Loaders(train, val, sampler, micro, len(sizes), sizes)


def _size(dataset: Dataset) -> int:
    """``len(dataset)``: runner's datasets are map-style and sized (``Dataset`` does not declare ``__len__``)."""
    return len(cast(Sized, dataset))


def one_sample_batches(loaders: Loaders, world_size: int, replicas: int = 1) -> list[tuple[int, int, str]]:
    """Where a training batch of one sample would reach the model, from the batch arithmetic alone.

    Args:
        loaders: The step layout (``global_batch_sizes``, ``micro_batch``).
        replicas: DataParallel replicas (1 without dp); a micro-batch is cut as ``torch.chunk`` cuts it.

    Returns:
        ``(global batch size, rank, "micro-batch" | "DataParallel chunk")`` for each such case.
    """
    found = []
    for size in sorted(set(loaders.global_batch_sizes)):
        for rank in range(world_size):
            for micro in micro_batch_sizes(size, world_size, rank, loaders.micro_batch):
                chunk = math.ceil(micro / replicas)
                chunks = [min(chunk, micro - start) for start in range(0, micro, chunk)]
                if micro == 1:
                    found.append((size, rank, "micro-batch"))
                elif 1 in chunks:
                    found.append((size, rank, "DataParallel chunk"))
    return found


def check_batchnorm_batches(
    model: nn.Module, spec: ExperimentSpec, loaders: Loaders, world_size: int, replicas: int
) -> None:
    """Refuse, before training, a model with BatchNorm layers that would meet a training batch of one sample.

    PyTorch's batch norm cannot normalise one value per channel in training mode ("Expected more
    than 1 value per channel when training"), which would end the run at the last batch of an epoch.

    Raises:
        SpecError: (``data.batch_size``) naming the batch size, world size and rank, and the fix.
    """
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    cases = one_sample_batches(loaders, world_size, replicas) if norms else []
    if not cases:
        return
    size, rank, where = cases[0]
    data, accum = spec.data, spec.train.grad_accum_steps
    layout = [f"world size {world_size} (rank {rank})" if world_size > 1 else ""]
    layout += [
        f"{replicas} DataParallel replicas" if replicas > 1 else "",
        f"grad_accum_steps {accum}" if accum > 1 else "",
    ]
    raise spec_issue(
        "data.batch_size",
        f"the model has BatchNorm layers ({norms[0]!r}), which cannot train on one sample, but batch_size = "
        f"{data.batch_size} over {_size(loaders.train.dataset)} training samples leaves a final batch of {size} "
        f"samples and, with {', '.join(p for p in layout if p) or 'one device'}, a {where} of 1 sample: "
        "set data.drop_last = true (that batch is skipped), or choose another batch_size",
    )
