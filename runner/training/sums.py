"""Running sums of loss, correct predictions and samples: kept on the device, reduced over ranks on demand."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from runner.strategies.base import Strategy


class RunningSums:
    """Running sums ``[loss sum, correct, samples]`` kept on the device (float64); reduced over ranks on demand.

    Args:
        device: Where the sums live (the strategy's ``output_device``).
        start: ``[loss sum, correct, samples, has_correct]`` restored from a checkpoint (rank 0 only).
    """

    def __init__(self, device: torch.device, start: list[float] | None = None):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.has_correct = False
        if start is not None:  # rank-reduced sums restored from a checkpoint, held by rank 0 only
            self.sums += torch.tensor(start[:3], dtype=torch.float64, device=device)
            self.has_correct = bool(start[3]) if len(start) > 3 else False

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor | None, count: int) -> None:
        """Add one micro-batch: its summed loss (scalar), correct predictions (scalar) and sample count."""
        self.sums[0] += loss_sum.to(torch.float64)
        if correct is not None:
            self.sums[1] += correct
            self.has_correct = True
        self.sums[2] += count

    def reduced_sums(self, strategy: Strategy) -> list[float]:
        """``[loss sum, correct, samples, has_correct]`` summed over ranks (a collective)."""
        return [*strategy.all_reduce_sum(self.sums.clone()).tolist(), 1.0 if self.has_correct else 0.0]

    def reduce(self, strategy: Strategy) -> tuple[float, float | None]:
        """``(mean loss, accuracy or None)`` over all ranks (a collective); ``(nan, None)`` without samples."""
        loss, correct, count = strategy.all_reduce_sum(self.sums.clone()).tolist()
        if count == 0:
            return math.nan, None
        return loss / count, (correct / count if self.has_correct else None)


def correct_count(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Correct predictions in a batch (a scalar tensor): ``argmax`` of the logits ``(B, C)`` against ``y (B,)``.

    ``out`` is the model output: the logits, or a tuple/list whose first item they are.
    """
    logits = out[0] if isinstance(out, (tuple, list)) else out
    return (logits.argmax(dim=1) == y).sum()
