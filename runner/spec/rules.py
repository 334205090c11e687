"""What the spec's rules share: the base of every table (``SpecTable``, which runs the table's ``check`` once its keys
are valid), the limits of numbers torch takes, and the wording of each rule that may be checked in two places.

A rule is checked statically when the spec alone decides it (a table's ``check`` in ``runner.spec.schema*``), on
the machine otherwise (``runner.devices.resolve.resolve_devices``: how many GPUs are visible, whether
``accelerator = "auto"`` found CUDA), never both for one spec. Both word it with the same function here
(``batch_split_problem``, ``nproc_mismatch``, ``output_device_not_chosen``, ``store_uri_problem``), so one rule
reads the same whether ``runner validate`` or ``runner plan`` finds it.

Every message starts with the key it is about (``batch_size = 10 is not divisible ...``) and is reported at that key:
``FILE:LINE: data.batch_size: batch_size = 10 is not ...``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, model_validator

from runner.errors import mask_secrets, show

ON_CPU = 'accelerator = "cpu"'  # why a CUDA-only setting fails, when the spec alone says so
MOMENTUM_OPTIMIZERS = ("sgd", "rmsprop")  # the torch.optim classes that take ``momentum``, lower-case


def takes_momentum(optimizer: str) -> bool:
    """Whether ``optim.momentum`` applies to the optimizer ``optim.name`` names: sgd, rmsprop, or a factory of the
    user's (whose signature is theirs)."""
    return ":" in optimizer or optimizer.lower() in MOMENTUM_OPTIMIZERS


Problem = tuple[str, str]  # (dotted key, message)


class CrossFieldError(ValueError):
    """Several cross-field problems, each ``(dotted key, message)``; raised inside validation."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(f"{k}: {m}" for k, m in problems))


BARE_TRACKING_URIS = ("databricks", "databricks-uc", "uc")


TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")


def store_uri_problem(uri: str) -> str | None:
    """Why ``uri`` cannot be the tracking store (the message ends in the fix), or ``None``.

    Refused: empty; a file store (MLflow 3 opens one only with ``MLFLOW_ALLOW_FILE_STORE=true``); sqlite without a file;
    a scheme that is no tracking store unless a plugin registers it (``mlflow.tracking_store`` entry points).
    """
    text = uri.strip()
    scheme = urlsplit(text).scheme.lower()
    example = '"sqlite:///mlflow.db"'
    if not text:
        return (
            f"{show(uri)} is empty: remove the key (to use $MLFLOW_TRACKING_URI, else ./mlflow.db), or name a "
            f"store, e.g. {example}"
        )
    if scheme == "sqlite":
        path = text[len("sqlite:") :].lstrip("/").partition("?")[0]
        memory = not path or path.startswith(":memory:")
        if text.startswith("sqlite:///") and not memory:
            return None
        what = "an in-memory database: its runs would vanish when runner ends" if memory else "not a database file"
        path = "mlflow.db" if memory else path
        return (
            f"{show(mask_secrets(text))} is {what}: write three slashes and the path, "
            f'"sqlite:///{path}" (relative to here) or "sqlite:////abs/{path}"'
        )
    plugins = {entry.name.lower() for entry in entry_points(group="mlflow.tracking_store")}  # MLflow store plugins
    if text in BARE_TRACKING_URIS or scheme.partition("+")[0] in TRACKING_SCHEMES or scheme in plugins:
        return None
    if len(scheme) > 1 and scheme != "file":
        return (
            f"{show(mask_secrets(text))}: {scheme}: is not a tracking store (an artifact store, or unknown): name a "
            f"tracking server (http://HOST:PORT) or a database, e.g. {example}"
        )
    return (
        f"{show(text)} is a file store, which MLflow 3 no longer opens: use a database, "
        f"e.g. {example} (`mlflow migrate-filestore` moves existing runs into one), or a tracking server"
    )


def batch_split_problem(batch: int, world_size: int, grad_accum_steps: int) -> str | None:
    """``None`` when the global batch splits into ``world_size x grad_accum_steps`` equal micro-batches, else the
    message (at ``data.batch_size``) with the nearest fix."""
    per_step = world_size * grad_accum_steps
    if batch % per_step == 0:
        return None
    if world_size == 1:
        what = f"grad_accum_steps {grad_accum_steps}"
    else:
        what = f"world size {world_size}"
        if grad_accum_steps > 1:
            what += f" x grad_accum_steps {grad_accum_steps} = {per_step}"
    example = max(per_step, batch - batch % per_step)
    return f"batch_size = {batch} is not divisible by {what}: use a multiple of {per_step}, e.g. {example}"


def nproc_mismatch(nproc: int, ids: list[int] | str, chosen: int) -> str:
    """ddp on CUDA runs one process per chosen GPU; ``nproc_per_node`` says otherwise."""
    return (
        f"nproc_per_node = {nproc} but {chosen} GPU(s) are chosen (devices.ids = {show(ids)}): "
        f"ddp runs one process per GPU; set nproc_per_node = {chosen} or list {nproc} ids"
    )


def output_device_not_chosen(output_device: int, ids: list[int]) -> str:
    """dp gathers on ``output_device``, which must be one of the devices it runs on."""
    return f"output_device = {output_device} is not one of the chosen devices {ids} (devices.ids)"


# ----------------------------------------------------------------------------- table rules


SYNTHETIC_MAX_BYTES = 64 * 2**30  # synthetic data is made whole in host memory: past this it is a typo


def non_finite(key: str, value: Any) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every value under ``key`` that is or holds a non-finite float."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from non_finite(f"{key}.{k}", v)
    elif has_non_finite(value):
        yield key, value


def has_non_finite(value: Any) -> bool:
    """Whether ``value`` is, or a list or dict inside it holds, an ``inf`` or ``nan`` float."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, dict)):
        return any(has_non_finite(v) for v in (value.values() if isinstance(value, dict) else value))
    return False


INT64_LIMIT = 2**63
"""Exclusive upper bound of a seed or size passed to torch as a C ``int64`` (``seed + epoch`` stays below ``2**64``)."""
INT32_LIMIT = 2**31
"""Exclusive upper bound of a batch size: torch's samplers and kernels index a batch with a C ``int``."""
UINT32_LIMIT = 2**32
"""Exclusive upper bound of a seed passed to ``numpy.random.RandomState`` (Optuna's samplers)."""


class SpecTable(BaseModel):
    """Base of every spec table: strict, finite, no unknown keys, frozen; ``rule`` runs once its keys are valid.

    A key's description is the docstring beside it (pydantic's ``use_attribute_docstrings``): the JSON Schema, the
    key reference and the messages read it with its line breaks as spaces."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        validate_default=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
    )

    @model_validator(mode="after")
    def _check_rules(self) -> SpecTable:
        self.check()
        return self

    def check(self) -> None:
        """The rules between this table's keys, run once each key is valid: ValueError (CrossFieldError for several)
        naming the key. A table with such rules overrides it; this one has none."""
