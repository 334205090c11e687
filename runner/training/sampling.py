"""Which sample indices each rank reads, per epoch and per optimizer step (pure torch, no collectives).

The layout that makes ``none``, ``dp`` and ``ddp`` runs of one spec agree step by step:

* Every epoch has ONE permutation of ``range(num_samples)``, drawn exactly like
  ``torch.utils.data.DistributedSampler`` draws it: ``torch.randperm(N)`` with a
  ``torch.Generator`` seeded ``seed + epoch`` (or ``range(N)`` without shuffling).
* Global batch ``k`` (one optimizer step, ``B = data.batch_size`` samples) is positions
  ``[k*B, k*B + size_k)`` of that permutation; ``size_k`` comes from
  ``global_batch_sizes``.
* Rank ``r`` of ``W`` takes positions ``r::W`` of the (truncated) permutation. Since ``B``
  is a multiple of ``W``, rank ``r``'s share of global batch ``k`` is positions
  ``k*B + r, k*B + r + W, ...``: ``B / W`` consecutive entries of the rank's stream
  (``rank_batch_size(size_k, W, r)`` for a short final batch).
* With ``grad_accum_steps = A`` the DataLoader's batch size is the micro-batch
  ``m = B / (W * A)``. Cutting the rank's stream into consecutive chunks of ``m`` gives
  exactly ``A`` micro-batches per full step, whose union over ranks and micro-steps is the
  global batch of a ``W = 1, A = 1`` run. A short final step holds the rank's
  ``rank_batch_size(size_k, W, r)`` samples cut into ``m``-sized chunks
  (``micro_batch_sizes``), so it can have fewer than ``A`` micro-batches and ranks
  may differ by one sample (and by one micro-batch): the loop must group micro-batches by
  these sizes, not by counting to ``A``.

Resuming mid-epoch: ``EpochSampler.set_start_batch`` skips the first ``k`` global
batches of the epoch (this rank's share of them), so the remaining steps read exactly
what an uninterrupted run reads.

Final incomplete global batch rule: it is kept (split ``r::W`` over ranks) unless
``drop_last``, but it is dropped whenever it holds fewer than ``W`` samples, so that every
rank has at least one sample in every step and all ranks run the same number of steps.
No index is ever padded or repeated, unlike ``DistributedSampler``.

An in-memory dataset gives each batch in one indexing rather than sample by sample: the same tensors, 0.4 ms
against 1.6 ms for 256 samples of 784 floats, a tenth of ``benchmarks/overhead.py``'s step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from runner.training.data import dataset_len, derive_seed, loader_generator, worker_init_fn
from runner.training.models import spec_issue
from runner.training.sources import TensorPairDataset

if TYPE_CHECKING:
    from runner.spec.schema import ExperimentSpec
    from runner.training.data import DatasetBundle


def global_batch_sizes(num_samples: int, global_batch: int, drop_last: bool, world_size: int) -> list[int]:
    """Sizes of every global batch ``B`` of one epoch: ``[B] * (N // B)`` plus ``N % B`` when kept (never below ``W``).
    Like every function here, it takes the validated spec's sizes (docs/design.md §1) and checks none again."""
    sizes = [global_batch] * (num_samples // global_batch)
    rest = num_samples % global_batch
    if rest and not drop_last and rest >= world_size:
        sizes.append(rest)
    return sizes


def rank_batch_size(global_size: int, world_size: int, rank: int) -> int:
    """How many samples of a global batch rank ``rank`` gets: positions ``rank::world_size``, so sizes differ by one at
    most. The loop divides a rank's summed loss by ``global_size / world_size`` so DDP's average is the exact global
    mean."""
    return len(range(rank, global_size, world_size))


def micro_batch_sizes(global_size: int, world_size: int, rank: int, micro_batch: int) -> list[int]:
    """Sizes of the micro-batches this rank loads for one step: ``grad_accum_steps`` x ``micro_batch`` when full,
    else the rank's share cut into ``micro_batch`` chunks."""
    n = rank_batch_size(global_size, world_size, rank)
    return [min(micro_batch, n - start) for start in range(0, n, micro_batch)]


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's order of sample indices (seed ``seed + epoch``), identical to ``DistributedSampler``'s."""
    if not shuffle:
        return list(range(num_samples))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


class EpochSampler(Sampler[int]):
    """Training sampler: one seeded permutation per epoch, rank ``r`` reads positions ``r::W``.

    ``DistributedSampler``'s permutation without padding or duplicates, cut to the epoch's global batches
    (the module docstring). :meth:`set_epoch` before every epoch also reseeds ``generator`` (the DataLoader's)
    from (seed, rank, epoch), so a resumed run reproduces worker seeds."""

    def __init__(
        self,
        num_samples: int,
        world_size: int,
        rank: int,
        seed: int,
        shuffle: bool,
        global_batch: int,
        drop_last: bool,
        *,
        generator: torch.Generator | None = None,
    ):
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.generator = generator
        self.epoch = 0
        self.start_batch = 0
        self.batch_sizes = global_batch_sizes(num_samples, global_batch, drop_last, world_size)
        self.total_size = sum(self.batch_sizes)
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` and reseed the attached DataLoader generator, if any."""
        self.epoch = epoch
        if self.generator is not None:
            self.generator.manual_seed(derive_seed(self.seed, self.rank, epoch))

    def set_start_batch(self, batch: int) -> None:
        """Start the next iteration at global batch ``batch`` (0: the whole epoch)."""
        self.start_batch = batch

    def indices(self) -> list[int]:
        """Return this rank's sample indices for the current epoch (from the start batch), in loading order."""
        perm = epoch_permutation(self.num_samples, self.seed, self.epoch, self.shuffle)
        start = sum(self.batch_sizes[: self.start_batch])  # a multiple of world_size
        return perm[start + self.rank : self.total_size : self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        start = sum(self.batch_sizes[: self.start_batch])
        return len(range(start + self.rank, self.total_size, self.world_size))


class EvalSampler(Sampler[int]):
    """Evaluation sampler: rank ``r`` reads ``r::W`` in order, every sample once; sum metrics across ranks."""

    def __init__(self, num_samples: int, world_size: int, rank: int):
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_samples, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))


@dataclass
class Loaders:
    """A rank's DataLoaders and an epoch's step layout; ``train_sampler.set_epoch`` before every epoch."""

    train: DataLoader
    val: DataLoader | None
    train_sampler: EpochSampler
    micro_batch: int
    steps_per_epoch: int
    global_batch_sizes: list[int]
    test: DataLoader | None = None


def build_loaders(spec: ExperimentSpec, bundle: DatasetBundle, rank: int, world_size: int) -> Loaders:
    """Build this rank's DataLoaders (the module docstring).

    Training: micro-batches of ``batch_size // (world_size * grad_accum_steps)`` in :class:`EpochSampler` order.
    Validation and test: every ``world_size``-th sample, batches of ``ceil(eval_batch_size / world_size)``. Raises
    SpecError:
    (``data.batch_size``) an epoch would have no step."""
    data = spec.data
    micro = data.batch_size // (world_size * spec.train.grad_accum_steps)
    num_train = dataset_len(bundle.train)
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
    train = _loader(bundle.train, micro, sampler, generator=generator, **workers)
    eval_batch = math.ceil((data.eval_batch_size or data.batch_size) / world_size)

    def evaluated(part: Dataset | None) -> DataLoader | None:  # validation and test: every sample once
        if part is None or dataset_len(part) == 0:
            return None
        order = EvalSampler(dataset_len(part), world_size, rank)
        return _loader(part, eval_batch, order, generator=loader_generator(spec.seed, rank), **workers)

    return Loaders(train, evaluated(bundle.val), sampler, micro, len(sizes), sizes, evaluated(bundle.test))


def _loader(dataset: Dataset, batch: int, sampler: Sampler[int], **options: Any) -> DataLoader:
    """Batches in ``sampler`` order; an in-memory dataset gives a batch in one indexing (module note)."""
    if isinstance(dataset, TensorPairDataset):
        return DataLoader(dataset, batch_size=None, sampler=BatchSampler(sampler, batch, drop_last=False), **options)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=False, **options)


def one_sample_batches(loaders: Loaders, world_size: int, replicas: int = 1) -> list[tuple[int, int, str]]:
    """``(global batch size, rank, "micro-batch" | "DataParallel chunk")`` wherever a training batch of one sample
    would reach the model, from the batch arithmetic alone."""
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
    """Refuse a model with BatchNorm that would meet a training batch of one sample ("Expected more than 1 value per
    channel"); raises SpecError at ``data.batch_size`` with the fix."""
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    cases = one_sample_batches(loaders, world_size, replicas) if norms else []
    if not cases:
        return
    size, rank, where = cases[0]
    data = spec.data
    accum = spec.train.grad_accum_steps
    layout = [f"world size {world_size} (rank {rank})" if world_size > 1 else ""]
    layout += [
        f"{replicas} DataParallel replicas" if replicas > 1 else "",
        f"grad_accum_steps {accum}" if accum > 1 else "",
    ]
    raise spec_issue(
        "data.batch_size",
        f"the model has BatchNorm layers ({norms[0]!r}), which cannot train on one sample, but batch_size = "
        f"{data.batch_size} over {dataset_len(loaders.train.dataset)} training samples leaves a final batch of {size} "
        f"samples and, with {', '.join(p for p in layout if p) or 'one device'}, a {where} of 1 sample: "
        "set data.drop_last = true (that batch is skipped), or choose another batch_size",
    )
