"""Per-rank DataLoaders: micro-batches in ``EpochSampler`` order, the validation split across ranks."""

from __future__ import annotations

import math
from collections.abc import Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.data import DataLoader, Dataset

from runner.training.models import spec_issue
from runner.training.sampling import EpochSampler, EvalSampler, global_batch_sizes
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
        spec: The :class:`~runner.spec.schema.ExperimentSpec`.
        bundle: Datasets from :func:`runner.training.data.build_datasets`.
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
