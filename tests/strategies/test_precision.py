"""The precision object: autocast and gradient scaling behind one interface, identical to plain PyTorch when off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.strategies.base import Precision

CPU = torch.device("cpu")


def _model_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(1)
    return model, torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _one_step(precision: Precision | None, clip: float | None = None) -> dict[str, torch.Tensor]:
    """One SGD step through ``precision``, or through plain PyTorch calls when it is ``None``."""
    model, x, y = _model_and_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    if precision is None:
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum") / 8
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    else:
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y, reduction="sum") / 8
        precision.backward(loss)
        if clip is not None:
            precision.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        precision.step(optimizer)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("clip", [None, 0.1])
def test_no_amp_is_plain_pytorch_bit_for_bit(clip: float | None) -> None:
    precision = Precision("no", CPU)
    assert precision.dtype is None and not precision.scaling and precision.state_dict() is None
    plain, through = _one_step(None, clip), _one_step(precision, clip)
    for key, value in plain.items():
        assert torch.equal(value, through[key]), key


def test_no_amp_autocast_changes_nothing() -> None:
    model, x, _ = _model_and_batch()
    with Precision("no", CPU).autocast():
        out = model(x)
    assert out.dtype == torch.float32 and torch.equal(out, model(x))


def test_bf16_on_cpu_autocasts_without_scaling() -> None:
    precision = Precision("bf16", CPU)
    assert precision.dtype == torch.bfloat16 and not precision.scaling
    model, x, _ = _model_and_batch()
    with precision.autocast():
        out = model(x)
    assert out.dtype == torch.bfloat16
    assert model(x).dtype == torch.float32  # only inside the context
    before = _model_and_batch()[0].state_dict()
    after = _one_step(precision)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the step happened
    assert precision.state_dict() is None  # checkpoints keep "scaler": None


def test_fp16_scaler_is_disabled_off_cuda() -> None:
    precision = Precision("fp16", CPU)
    assert precision.dtype == torch.float16
    assert not precision.scaling and precision.state_dict() is None
    precision.load_state_dict({"scale": 8.0, "growth_factor": 2.0})  # nothing to restore into
    precision.load_state_dict(None)
    assert precision.state_dict() is None
