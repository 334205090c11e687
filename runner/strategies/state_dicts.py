"""Unwrap models from DataParallel / DDP / ``torch.compile`` and move state dicts between parallel modes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from runner.errors import TrainingError

_WRAPPERS = (DataParallel, DistributedDataParallel)
_PREFIXES = ("module.", "_orig_mod.")  # DataParallel / DDP, torch.compile
_MAX_KEYS_SHOWN = 20


class StateDictMismatchError(TrainingError):
    """A state dict does not fit a module; ``missing`` and ``unexpected`` list the keys."""

    def __init__(self, message: str, missing: list[str], unexpected: list[str]):
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected


def unwrap(module: nn.Module) -> nn.Module:
    """Return the user's model inside DataParallel / DDP / ``torch.compile`` wrappers.

    Args:
        module: A model, wrapped or not.

    Returns:
        The innermost module (the same object when ``module`` is not wrapped).
    """
    while True:
        if isinstance(module, _WRAPPERS):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        else:
            return module


def unwrapped_state_dict(module: nn.Module) -> dict[str, Any]:
    """Return the state dict of the model inside any wrapper: keys carry no ``module.`` prefix.

    Args:
        module: A model, wrapped or not.

    Returns:
        ``unwrap(module).state_dict()`` (tensors stay on their devices).
    """
    return unwrap(module).state_dict()


def _strip_uniform_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(state_dict)
    changed = True
    while changed and out:
        changed = False
        for prefix in _PREFIXES:
            if all(k.startswith(prefix) for k in out):
                out = {k[len(prefix) :]: v for k, v in out.items()}
                changed = True
    return out


def key_list(keys: list[str]) -> str:
    """``"a, b, c (+N more)"`` for at most 20 keys; ``"none"`` for no keys."""
    shown = ", ".join(keys[:_MAX_KEYS_SHOWN])
    more = f" (+{len(keys) - _MAX_KEYS_SHOWN} more)" if len(keys) > _MAX_KEYS_SHOWN else ""
    return f"{shown}{more}" if keys else "none"


def fitted_state_dict(target: nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` without a ``module.``/``_orig_mod.`` prefix shared by all keys; keys checked against ``target``.

    Raises:
        StateDictMismatchError: Keys are missing or unexpected (both are listed).
    """
    sd = _strip_uniform_prefixes(state_dict)
    expected = list(target.state_dict().keys())
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in set(expected)]
    if missing or unexpected:
        raise StateDictMismatchError(
            f"state dict does not fit {type(target).__name__}: missing keys: {key_list(missing)}; "
            f"unexpected keys: {key_list(unexpected)} (was it saved from another model or model.kwargs?)",
            missing,
            unexpected,
        )
    return sd


def load_state_dict_flexible(module: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Load a state dict saved from any mode into a model in any mode, strictly.

    A ``module.`` (DataParallel / DDP) or ``_orig_mod.`` (``torch.compile``)
    prefix shared by every key is stripped; the model is unwrapped likewise.

    Args:
        module: Target model, wrapped or not.
        state_dict: Parameters and buffers, e.g. from :func:`unwrapped_state_dict`.

    Raises:
        StateDictMismatchError: Keys are missing or unexpected (both are listed),
            or a tensor's shape differs.
    """
    target = unwrap(module)
    sd = fitted_state_dict(target, state_dict)
    try:
        target.load_state_dict(sd, strict=True)
    except RuntimeError as exc:
        raise StateDictMismatchError(f"state dict does not fit {type(target).__name__}: {exc}", [], []) from exc
