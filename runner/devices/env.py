"""The process environment: narrow ``CUDA_VISIBLE_DEVICES`` before CUDA initialises; set variables for a scope."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping

from runner.devices.resolve import DevicePlan
from runner.errors import DeviceError


def cuda_initialized() -> bool:
    """Whether CUDA is initialised in this process (never imports torch to find out)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


def apply_device_env(plan: DevicePlan, environ: MutableMapping[str, str] = os.environ) -> None:
    """Set ``plan.env`` in ``environ`` so this process and its children see only the chosen devices.

    Afterwards the chosen GPUs are ``cuda:0 .. cuda:n-1`` in this process, in ``devices.ids``
    order. CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when it initialises (CUDA C Programming
    Guide, "CUDA Environment Variables"), hence the check below.

    Args:
        plan: The resolved plan.
        environ: Environment to change (default: this process's).

    Raises:
        DeviceError: CUDA is already initialised in this process and the plan
            would change ``CUDA_VISIBLE_DEVICES`` or ``CUDA_DEVICE_ORDER``; CUDA
            keeps its first view, so the run would silently use other cards.
    """
    changes = {k: v for k, v in plan.env.items() if environ.get(k) != v}
    if changes and cuda_initialized():
        now = {k: environ.get(k) for k in changes}
        raise DeviceError(
            f"CUDA is already initialised in this process, so setting {changes} (now {now}) would not take effect "
            f"and the run would use other GPUs than planned; resolve and apply devices before anything touches CUDA"
        )
    environ.update(changes)


def apply_threads(plan: DevicePlan) -> None:
    """Give torch ``plan.threads_per_process`` intra-op threads (and inter-op, where still allowed).

    Called once at the start of each training process, before any work. torch accepts the inter-op
    count only before its first inter-op task, so a process that already ran one (a warm bench
    worker) keeps its count.
    """
    import torch

    torch.set_num_threads(plan.threads_per_process)
    if torch.get_num_interop_threads() != plan.threads_per_process:
        with contextlib.suppress(RuntimeError):  # "cannot set number of interop threads after parallel work"
            torch.set_num_interop_threads(plan.threads_per_process)


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the duration of the ``with`` block, then put the previous values back
    (a variable that was unset is removed again). Child processes started inside the block inherit them."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
