"""Test and example factories: `factories:build_model`, `factories:build_dataset` and `factories:build_split`."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build_model(in_features: int = 64, num_classes: int = 10, hidden: int = 16) -> nn.Module:
    """Return a two-layer MLP mapping ``(N, *shape)`` with ``in_features`` elements to ``(N, num_classes)``."""
    return nn.Sequential(nn.Flatten(1), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


def build_dataset(num_samples: int = 100, num_features: int = 8, num_classes: int = 3, seed: int = 0) -> TensorDataset:
    """Return a seeded, learnable TensorDataset: x ``(num_features,)`` float32, y int64 in ``[0, num_classes)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, num_features, generator=g)
    y = (x @ torch.randn(num_features, num_classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def build_split(num_train: int = 40, num_val: int = 10) -> tuple[TensorDataset, TensorDataset]:
    """Return an explicit ``(train, val)`` pair of 8-feature, 3-class datasets."""
    return build_dataset(num_train, seed=1), build_dataset(num_val, seed=2)


def not_a_model() -> str:
    """Return something that is not an nn.Module (for error tests)."""
    return "not a module"


NOT_CALLABLE = 42
