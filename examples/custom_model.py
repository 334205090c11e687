"""A user's own experiment, as README "Bring your own model" describes it (used by experiments/custom_model.toml).

* ``digits``: a dataset factory whose samples are dicts ``{"pixels": (64,) float32, "labels": int64}``
  (the 1797 scikit-learn digits, flattened and standardised);
* ``build``: a model whose ``forward(pixels, labels=None)`` takes the dict batch as keyword arguments
  and returns ``{"loss", "logits"}`` (the loss is the mean over its batch, as Hugging Face models do);
* ``TrueClassProbability``: a custom ``torchmetrics.Metric``, the mean probability the model gives the
  true class. Its states are sums, so it is exact over any number of ranks and resumes exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from torchmetrics import Metric


class DigitDicts(Dataset):
    """The scikit-learn digits as dict samples: ``{"pixels": (64,) float32, "labels": () int64}``."""

    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x = torch.as_tensor(bunch.data, dtype=torch.float32)
        self.pixels = (x - x.mean()) / x.std()
        self.labels = torch.as_tensor(bunch.target, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixels": self.pixels[i], "labels": self.labels[i]}


def digits() -> DigitDicts:
    """Dataset factory (``data.dataset = "examples.custom_model:digits"``); runner holds out validation."""
    return DigitDicts()


class DigitClassifier(nn.Module):
    """An MLP that computes its own loss: ``forward(pixels, labels=None) -> {"loss", "logits"}``.

    Args:
        hidden: Width of the hidden layer.
        num_classes: Output logits.
    """

    def __init__(self, hidden: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        logits = self.net(pixels)
        loss = F.cross_entropy(logits, labels) if labels is not None else None  # the mean over this batch
        return {"loss": loss, "logits": logits}


def build(hidden: int = 64, num_classes: int = 10) -> DigitClassifier:
    """Model factory (``model.name = "examples.custom_model:build"``)."""
    return DigitClassifier(hidden, num_classes)


class TrueClassProbability(Metric):
    """Mean softmax probability of the true class: ``update(logits (B, C), labels (B,))``."""

    full_state_update = False

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        probs = logits.softmax(dim=1).gather(1, labels.long().unsqueeze(1))
        self.total += probs.sum().to(torch.float64)
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        return (self.total / self.count).float()
