"""The one reader of the launcher's environment: rank, world size, restarts, the run handed down, the Slurm job. Imports
neither torch nor mlflow.

A process learns its place in a job from variables its launcher sets. torch's elastic
launcher and ``torchrun`` set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT``
(see PyTorch's "torchrun (Elastic Launch)" docs, section *Environment Variables*). The
driver of ``runner exec`` adds ``RUNNER_RUN_ID`` for workers it starts. Slurm's ``srun``
sets ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
``SLURM_NNODES``, ``SLURM_JOB_NODELIST`` and ``SLURM_JOB_ID`` for every task of a job step
(Slurm's ``srun`` man page, *Output Environment Variables*); ``SlurmJob`` reads them
and ``SlurmJob.layout`` decides how the tasks of a step become ranks (docs/design.md §15).
Nothing else in runner reads these variables: every module asks a ``LauncherEnvironment``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

WORKER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
PROCESS_GROUP_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RUN_ID_VAR = "RUNNER_RUN_ID"
SLURM_PORT_BASE = 15000  # a port from the job id, as Lightning's SLURMEnvironment.main_port derives it

SlurmLayoutKind = Literal["per-node", "per-device", "batch"]


@dataclass(frozen=True)
class SlurmJob:
    """The Slurm job (and step) this process runs in, from Slurm's ``SLURM_*`` variables.

    ``nodelist`` is the step's hostlist (``gpu[01-04]``); ``tasks_per_node`` is expanded (``2(x3),1`` -> ``(2, 2, 2,
    1)``); ``in_step`` says ``srun`` started this process (``SLURM_STEP_ID`` is set).
    """

    job_id: str
    ntasks: int = 1
    nnodes: int = 1
    procid: int = 0
    localid: int = 0
    nodeid: int = 0
    nodelist: str = ""
    tasks_per_node: tuple[int, ...] = ()
    restart_count: int = 0
    in_step: bool = False

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> SlurmJob | None:
        """Read Slurm's variables from ``env``; ``None`` outside a job. Raises ValueError for a non-integer."""
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
        return cls(
            job_id=job_id,
            ntasks=_int(env, "SLURM_NTASKS", 1),
            nnodes=_int(env, "SLURM_NNODES", 1),
            procid=_int(env, "SLURM_PROCID", 0),
            localid=_int(env, "SLURM_LOCALID", 0),
            nodeid=_int(env, "SLURM_NODEID", 0),
            nodelist=nodelist,
            tasks_per_node=parse_tasks_per_node(per_node, "SLURM_STEP_TASKS_PER_NODE"),
            restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
            in_step="SLURM_STEP_ID" in env or "SLURM_STEPID" in env,
        )

    @property
    def local_tasks(self) -> int:
        """Tasks of the step on this node (from ``tasks_per_node``, else ``ntasks / nnodes``)."""
        if 0 <= self.nodeid < len(self.tasks_per_node):
            return self.tasks_per_node[self.nodeid]
        return max(1, self.ntasks // max(1, self.nnodes))

    @property
    def port(self) -> int:
        """15000 + the job id's last four digits, alike on every task (Lightning's ``SLURMEnvironment.main_port``)."""
        digits = re.sub(r"\D", "", self.job_id)[-4:]
        return SLURM_PORT_BASE + int(digits or 0)

    @property
    def first_host(self) -> str:
        """The step's first host, where rank 0 and the rendezvous run: the hostlist's first item, each bracket at its
        first number (``gpu[07-09,12],login1`` -> ``gpu07``, as ``scontrol show hostnames`` lists it first); ValueError
        for a malformed list."""
        text = self.nodelist.strip()
        item = re.match(r"(?:[^,\s\[\]]|\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\])+(?=$|[,\s])", text)
        if item is None:
            raise ValueError(f"SLURM_JOB_NODELIST={text!r} is not a Slurm hostlist such as gpu[01-04],login1")
        return re.sub(r"\[(\d+)[^\]]*\]", r"\1", item.group())

    def layout(self, *, world_size: int, nproc_per_node: int, nnodes: int) -> SlurmLayout:
        """How this step's tasks become the spec's ranks: ``"batch"``, ``"per-node"`` or ``"per-device"``
        (docs/design.md §15). Raises ValueError, with both sides' numbers, when none fits."""
        if not self.in_step:
            return SlurmLayout("batch", self, nnodes=nnodes, node_rank=0, world_size=world_size)
        tasks = self.ntasks
        nodes = self.nnodes
        if tasks == nodes == nnodes:
            return SlurmLayout("per-node", self, nnodes=nodes, node_rank=self.nodeid, world_size=world_size)
        if tasks == world_size:
            return SlurmLayout(
                "per-device", self, nnodes=nodes, node_rank=self.nodeid, world_size=tasks, rank=self.procid
            )
        raise ValueError(
            f"the Slurm step has SLURM_NTASKS={tasks} task(s) on SLURM_NNODES={nodes} node(s): that is neither one "
            f"task per device (the spec's world size is {world_size} = parallel.nnodes {nnodes} x {nproc_per_node} "
            f"process(es) per node) nor one task per node (parallel.nnodes = {nnodes}); start it with "
            f"`srun --ntasks={world_size}` (one task per device) or `srun --nodes={nnodes} --ntasks-per-node=1` "
            f"(one task per node), or change the spec"
        )


@dataclass(frozen=True)
class SlurmLayout:
    """How one Slurm job step runs the spec (:meth:`SlurmJob.layout`); ``rank`` is this task's global rank."""

    kind: SlurmLayoutKind
    job: SlurmJob
    nnodes: int
    node_rank: int
    world_size: int
    rank: int = 0

    @property
    def owns_run(self) -> bool:
        """Whether this task creates and ends the job's one MLflow run (rank 0's task, node 0's launcher)."""
        return self.rank == 0 if self.kind == "per-device" else self.node_rank == 0

    def rendezvous_endpoint(self) -> str:
        """``first host:port`` of the job (ValueError for a malformed node list)."""
        return f"{self.job.first_host}:{self.job.port}"


@dataclass(frozen=True)
class LauncherEnvironment:
    """Where this process stands in its job, as its launcher described it (single-process defaults when not launched).

    ``external``: a launcher set ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; ``run_id`` is the run the driver handed
    down (``RUNNER_RUN_ID``); ``missing`` lists unset process-group variables.
    """

    external: bool
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    restart_count: int = 0
    run_id: str | None = None
    missing: tuple[str, ...] = ()
    slurm: SlurmJob | None = None

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> LauncherEnvironment:
        """Read the launcher's variables from ``env``; torchrun's first, Slurm's into :attr:`slurm`.

        Raises ValueError for a variable that must be an integer and is not.
        """
        env = os.environ if env is None else env
        return cls(
            external=all(k in env for k in WORKER_VARS),
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=_int(env, "WORLD_SIZE", 1),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            run_id=env.get(RUN_ID_VAR) or None,
            missing=tuple(k for k in PROCESS_GROUP_VARS if k not in env),
            slurm=SlurmJob.detect(env),
        )

    def as_slurm_worker(self, layout: SlurmLayout) -> LauncherEnvironment:
        """This process as the worker torchrun would start for the per-device task of ``layout`` (ValueError for
        another kind): its rank, local rank and world size are the task's; ``runner.launch.session`` sets them."""
        if layout.kind != "per-device":
            raise ValueError(f"a {layout.kind} Slurm task is not a worker")
        job = layout.job
        return replace(self, external=True, rank=job.procid, local_rank=job.localid, world_size=job.ntasks, missing=())

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the process that logs and saves."""
        return self.rank == 0

    @property
    def restarted(self) -> bool:
        """Whether the elastic agent restarted the worker group (the job continues from its checkpoint)."""
        return self.restart_count > 0


def parse_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> tuple[int, ...]:
    """Expand ``"2(x3),1"`` -> ``(2, 2, 2, 1)`` (``""`` -> ``()``); ValueError for other syntax."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            raise ValueError(f"{name}={text!r} is not a Slurm tasks-per-node list such as 2(x3),1")
        out += [int(match.group(1))] * int(match.group(2) or 1)
    return tuple(out)


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    text = env.get(key)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not an integer (it is set by the process launcher)") from None
