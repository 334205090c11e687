"""Seeding and random-number-generator state: Python, NumPy, torch CPU/CUDA and DataLoader workers.

How ranks and workers differ:

* :func:`seed_everything` seeds Python, NumPy and torch (CPU and every CUDA device) with
  ``seed`` itself on EVERY rank, so that a model built right after it is initialised
  identically everywhere (DDP also broadcasts rank 0's weights, but ``none`` vs ``ddp``
  comparisons rely on the same init).
* Data randomness differs per rank and per worker: each rank's DataLoader gets
  :func:`loader_generator` ``(seed, rank, epoch)``, from which PyTorch derives the worker
  base seed; worker ``w`` then runs with torch seed ``base + w`` and :func:`worker_init_fn`
  seeds Python and NumPy from it, as in https://pytorch.org/docs/stable/notes/randomness.html.
  Reseeding the generator per epoch (``EpochSampler.set_epoch`` does it) makes worker seeds
  a function of (seed, rank, epoch) only, so a resumed run reproduces them; with
  ``persistent_workers`` the workers keep the seeds of the epoch they were started in.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

CUBLAS_WORKSPACE_CONFIG = ":4096:8"


@dataclass(frozen=True)
class SeedInfo:
    """What :func:`seed_everything` used.

    Attributes:
        seed: Seed given to Python, NumPy and torch (same on every rank).
        rank: The rank it was called on.
        worker_base_seed: Seed of this rank's DataLoader generator for epoch 0.
        deterministic_settings: Setting -> value it set (empty unless ``deterministic``).
    """

    seed: int
    rank: int
    worker_base_seed: int
    deterministic_settings: dict[str, str] = field(default_factory=dict)


def derive_seed(*parts: int) -> int:
    """Return a well-mixed 63-bit seed from integers (``numpy.random.SeedSequence``).

    Args:
        *parts: Non-negative integers, e.g. ``(seed, rank, epoch)``.

    Returns:
        An int in ``[0, 2**63)``, a pure function of ``parts``.
    """
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0]
    return int(state) & ((1 << 63) - 1)


def loader_generator(seed: int, rank: int, epoch: int = 0) -> torch.Generator:
    """Return the ``torch.Generator`` for a rank's DataLoader (it seeds the workers).

    Args:
        epoch: Epoch; reseed with a new epoch each epoch for resumable worker seeds.

    Returns:
        A CPU generator seeded with ``derive_seed(seed, rank, epoch)``.
    """
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, rank, epoch))
    return g


def worker_init_fn(worker_id: int) -> None:
    """Seed Python and NumPy in a DataLoader worker from its torch seed.

    PyTorch seeds each worker's torch RNG with ``base_seed + worker_id`` (``base_seed`` drawn
    from the loader's generator); this carries it over to ``random`` and ``numpy.random`` so
    augmentations using them differ per worker and per rank and are reproducible.

    Args:
        worker_id: Worker index (unused; the torch seed already includes it).
    """
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def seed_everything(seed: int, rank: int = 0, deterministic: bool = False) -> SeedInfo:
    """Seed Python, NumPy, torch CPU and all CUDA devices; optionally force determinism.

    CUDA is seeded lazily (``torch.cuda.manual_seed_all`` queues the seed until CUDA
    initialises) and only when CUDA is available, so calling this never initialises CUDA.

    Args:
        seed: The seed, identical on every rank (model init must match across ranks).
        rank: Global rank; only used for the worker base seed.
        deterministic: Turn on ``torch.use_deterministic_algorithms``, cuDNN determinism,
            ``cudnn.benchmark = False`` and ``CUBLAS_WORKSPACE_CONFIG``. ``False`` turns
            deterministic algorithms off again (the process-wide default).

    Returns:
        A :class:`SeedInfo` with what was used and set.

    Raises:
        ValueError: If ``seed`` is negative.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    settings: dict[str, str] = {}
    if deterministic:
        if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
        settings["env.CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
        torch.use_deterministic_algorithms(True)
        settings["torch.use_deterministic_algorithms"] = "True"
        torch.backends.cudnn.deterministic = True
        settings["torch.backends.cudnn.deterministic"] = "True"
        torch.backends.cudnn.benchmark = False
        settings["torch.backends.cudnn.benchmark"] = "False"
    elif torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)
    return SeedInfo(
        seed=seed,
        rank=rank,
        worker_base_seed=derive_seed(seed, rank, 0),
        deterministic_settings=settings,
    )


def capture_rng_state() -> dict[str, Any]:
    """Return every RNG state needed to continue a run exactly (for checkpoints).

    Returns:
        ``{"python": list, "numpy": dict, "torch": uint8 tensor, "cuda": [uint8 tensor per
        device]}``; only plain types and tensors, so ``torch.load(weights_only=True)`` reads it.
        ``cuda`` is empty when CUDA is unavailable.
    """
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    cuda: list[torch.Tensor] = []
    if torch.cuda.is_available():
        cuda = [t.clone() for t in torch.cuda.get_rng_state_all()]
    return {
        "python": [version, list(internal), gauss],
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state().clone(),
        "cuda": cuda,
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`capture_rng_state`.

    CUDA states are restored for the devices that are visible now (states of devices that
    are not, e.g. when resuming a GPU run on CPU, are skipped).

    Args:
        state: The dict returned by :func:`capture_rng_state` (possibly after save/load).
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    key = npst["key"]
    key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    np.random.set_state(
        {
            "bit_generator": npst["bit_generator"],
            "state": {"key": key.astype(np.uint32), "pos": npst["pos"]},
            "has_gauss": npst["has_gauss"],
            "gauss": npst["gauss"],
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda = list(state.get("cuda") or [])
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)
