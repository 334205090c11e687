"""Mixed precision behind one object: ``torch.autocast`` for the forward pass, ``torch.amp.GradScaler`` for fp16.

The loop calls the same methods whatever ``train.amp`` says: with ``amp = "no"`` the
context is a null context and the scaler is disabled, so ``backward`` is
``loss.backward()`` and ``step`` is ``optimizer.step()`` exactly (nanoGPT's
``GradScaler(enabled=...)``; Lightning Fabric's ``plugins/precision/amp.py``). Source for
the recipe (scale, backward, unscale before clipping, step, update): PyTorch's
"Automatic Mixed Precision" docs, ``torch.amp``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch

AmpMode = Literal["no", "bf16", "fp16"]
_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast and gradient scaling for one device, as ``train.amp`` asks.

    * ``"no"``: full precision; every method is the plain PyTorch call.
    * ``"bf16"``: the forward pass and the loss run under ``torch.autocast(dtype=torch.bfloat16)``;
      bfloat16 has float32's range, so no scaling.
    * ``"fp16"``: autocast to ``torch.float16`` and a ``GradScaler`` against underflow of
      small gradients. The scaler is enabled on CUDA only (the schema and device resolution
      refuse fp16 elsewhere; off CUDA it stays disabled).

    Args:
        amp: ``train.amp``.
        device: Where the forward pass runs (``strategy.device``); its type is the autocast device type.

    Attributes:
        dtype: The autocast dtype, or ``None`` without autocast.
        scaling: Whether gradients are scaled (fp16 on CUDA).
    """

    def __init__(self, amp: AmpMode, device: torch.device) -> None:
        self.amp = amp
        self.device_type = device.type
        self.dtype: torch.dtype | None = _DTYPES.get(amp)
        self.scaling = amp == "fp16" and device.type == "cuda"
        self._scaler = torch.amp.GradScaler(device.type, enabled=self.scaling)

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The context to run forward and loss in: ``torch.autocast`` with :attr:`dtype`, else a null context."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (a scalar), scaled first when :attr:`scaling`."""
        self._scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place (before clipping).

        A no-op without scaling. At most once per optimizer step.
        """
        self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Take the optimizer step and update the scale.

        With scaling, the step is skipped when the gradients hold ``inf``/``NaN`` and the
        scale shrinks; without, this is ``optimizer.step()``.
        """
        self._scaler.step(optimizer)
        self._scaler.update()

    def state_dict(self) -> dict[str, Any] | None:
        """The scaler's state for a checkpoint, or ``None`` without scaling."""
        return self._scaler.state_dict() if self.scaling else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output; ``None`` (a checkpoint without scaling) changes nothing."""
        if state is not None and self.scaling:
            self._scaler.load_state_dict(state)
