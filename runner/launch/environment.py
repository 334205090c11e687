"""The one reader of the launcher's environment: rank, world size, restarts, the run handed down.

A process learns its place in a job from variables its launcher sets. torch's elastic
launcher and ``torchrun`` set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT``
(see PyTorch's "torchrun (Elastic Launch)" docs, section *Environment Variables*). The
driver of ``runner exec`` adds ``RUNNER_RUN_ID`` for workers it starts. Nothing else in
runner reads these variables: every module asks a :class:`LauncherEnvironment`.

Importing this module imports neither torch nor mlflow.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

WORKER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
PROCESS_GROUP_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RUN_ID_VAR = "RUNNER_RUN_ID"


@dataclass(frozen=True)
class LauncherEnvironment:
    """Where this process stands in its job, as its launcher described it.

    Attributes:
        external: Whether a launcher (torchrun, the elastic agent, a scheduler) started this
            process as one worker of a job: ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are set.
        rank: Global rank, ``0 .. world_size - 1`` (0 when not launched).
        local_rank: Rank on this node (0 when not launched).
        world_size: Processes in the job (1 when not launched).
        local_world_size: Processes on this node (``None`` when the launcher did not say).
        restart_count: Elastic restarts of the worker group so far (``TORCHELASTIC_RESTART_COUNT``).
        master_addr: Rendezvous host of the process group (``MASTER_ADDR``), or ``None``.
        master_port: Rendezvous port of the process group (``MASTER_PORT``), or ``None``.
        run_id: MLflow run id the driver handed to its workers (``RUNNER_RUN_ID``), or ``None``.
        missing: Process-group variables that are not set (empty when all are).
    """

    external: bool
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = None
    restart_count: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    run_id: str | None = None
    missing: tuple[str, ...] = ()

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> LauncherEnvironment:
        """Read the launcher's variables from ``env`` (default: this process's environment).

        Args:
            env: The environment to read.

        Returns:
            The :class:`LauncherEnvironment`; unset variables take the single-process defaults.

        Raises:
            ValueError: A variable that must be an integer is not one.
        """
        env = os.environ if env is None else env
        return cls(
            external=all(k in env for k in WORKER_VARS),
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=_int(env, "WORLD_SIZE", 1),
            local_world_size=_opt_int(env, "LOCAL_WORLD_SIZE"),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=_opt_int(env, "MASTER_PORT"),
            run_id=env.get(RUN_ID_VAR) or None,
            missing=tuple(k for k in PROCESS_GROUP_VARS if k not in env),
        )

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the process that logs and saves."""
        return self.rank == 0

    @property
    def restarted(self) -> bool:
        """Whether the elastic agent restarted the worker group (the job continues from its checkpoint)."""
        return self.restart_count > 0


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = _opt_int(env, key)
    return default if value is None else value


def _opt_int(env: Mapping[str, str], key: str) -> int | None:
    text = env.get(key)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not an integer (it is set by the process launcher)") from None
