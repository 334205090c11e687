"""The validation split and the fingerprints of a run's data: split indices, split SHA-256, dataset digests.

The split is drawn with ``data.split_seed``, never with ``seed`` (docs/design.md §11), so runs that
differ only in ``seed`` train and score on the same samples; ``runner.data.val_split_sha256`` (the
SHA-256 of the sorted validation indices, or of the sorted validation file list) shows it in MLflow.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from runner.training.models import spec_issue

if TYPE_CHECKING:
    from runner.spec.schema_data import DataSpec


def split_indices(num_samples: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split ``range(num_samples)`` into sorted train and validation indices.

    ``floor(num_samples * val_fraction)`` samples (at least one when ``val_fraction > 0``) are
    the first entries of ``torch.randperm(num_samples)`` under ``torch.Generator().manual_seed(seed)``.

    Args:
        num_samples: Samples to split.
        val_fraction: Fraction held out, in ``[0, 1)``.
        seed: Seed of the permutation (``data.split_seed``, not ``seed``).

    Returns:
        ``(train_indices, val_indices)``, each sorted; ``val_indices`` is empty for fraction 0.

    Raises:
        SpecError: (``data.val_fraction``) if no training sample would be left.
    """
    n_val = int(num_samples * val_fraction)
    if val_fraction > 0 and n_val == 0:
        n_val = 1
    if num_samples - n_val < 1:
        raise spec_issue(
            "data.val_fraction", f"val_fraction = {val_fraction} leaves no training sample out of {num_samples}"
        )
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def sha256_of_members(members: Sequence[int] | Sequence[str]) -> str:
    """Hex SHA-256 of sorted indices (comma-joined decimals) or sorted file paths (one a line)."""
    items = sorted(members)
    sep = "," if items and isinstance(items[0], int) else "\n"
    return hashlib.sha256(sep.join(str(m) for m in items).encode("utf-8")).hexdigest()


def file_list(ds: Dataset) -> list[str] | None:
    """The files of an ImageFolder-like dataset (``samples`` of ``(path, class)``), relative to its root."""
    samples = getattr(ds, "samples", None)
    if not isinstance(samples, list) or not samples or not isinstance(samples[0], tuple):
        return None
    root = str(getattr(ds, "root", ""))
    return [os.path.relpath(str(path), root) if root else str(path) for path, *_ in samples]


def data_settings(data: DataSpec) -> str:
    """What fixes the samples of ``[data]`` besides the split: the dataset and its options (JSON)."""
    keys: tuple[str, ...] = ("dataset", "root", "kwargs", "image_size", "num_channels")
    if data.dataset == "synthetic":
        keys += ("num_samples", "input_shape", "num_classes", "split_seed")
    return json.dumps({k: getattr(data, k) for k in keys}, sort_keys=True, default=str)


def part_digest(settings: str, part: str, members: Sequence[int] | Sequence[str] | None, size: int) -> str:
    """A 12-digit digest of one part (``train``/``val``): the settings, the part and its members (or its size)."""
    body = sha256_of_members(members) if members is not None else f"size={size}"
    return hashlib.sha256(f"{settings}|{part}|{body}".encode()).hexdigest()[:12]
