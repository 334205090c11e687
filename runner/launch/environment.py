"""The one reader of the launcher's environment: rank, world size, restarts, the run handed down, the Slurm job.

Importing this module imports neither torch nor mlflow.

Details: docs/design.md, "Module notes", runner/launch/environment.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

WORKER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
PROCESS_GROUP_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RUN_ID_VAR = "RUNNER_RUN_ID"
SLURM_PORT_BASE = 15000  # a port from the job id, as Lightning's SLURMEnvironment.main_port derives it

SlurmLayoutKind = Literal["per-node", "per-device", "batch"]


@dataclass(frozen=True)
class SlurmJob:
    """The Slurm job (and job step) this process runs in, as Slurm described it.

    Attributes:
        job_id: ``SLURM_JOB_ID`` (unique per task of a job array).
        ntasks: Tasks of the step (``SLURM_NTASKS``; 1 when unset).
        nnodes: Nodes of the step (``SLURM_NNODES``; 1 when unset).
        procid: This task's rank among the step's tasks (``SLURM_PROCID``).
        localid: This task's rank on its node (``SLURM_LOCALID``).
        nodeid: This node's rank among the step's nodes (``SLURM_NODEID``).
        nodelist: Hosts of the step in Slurm's hostlist syntax (``SLURM_STEP_NODELIST``, else
            ``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST``), e.g. ``gpu[01-04]``.
        tasks_per_node: Tasks on each node, in node order, from ``SLURM_STEP_TASKS_PER_NODE``
            (else ``SLURM_TASKS_PER_NODE``), e.g. ``2(x3),1`` -> ``(2, 2, 2, 1)``.
        restart_count: Times Slurm requeued the job (``SLURM_RESTART_COUNT``; 0 when unset).
        in_step: Whether ``srun`` started this process as a task of a job step
            (``SLURM_STEP_ID`` is set); ``False`` in the batch script itself or an ``salloc`` shell.
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
        """Read Slurm's variables from ``env``; ``None`` outside a Slurm job (no ``SLURM_JOB_ID``).

        Raises:
            ValueError: A variable that must be an integer is not one.
        """
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
        """A port every task computes alike: 15000 + the last four digits of the job id (15000-24999).

        The rule of Lightning's ``SLURMEnvironment.main_port``; two jobs on one node collide only
        when their ids end in the same four digits.
        """
        digits = re.sub(r"\D", "", self.job_id)[-4:]
        return SLURM_PORT_BASE + int(digits or 0)

    def first_host(self, expand: Callable[[str], list[str]] | None = None) -> str:
        """The first host of the step's node list: where rank 0 and the rendezvous run.

        Raises:
            ValueError: The node list is empty or malformed.
        """
        hosts = (expand or expand_nodelist)(self.nodelist)
        if not hosts:
            raise ValueError(f"SLURM_JOB_NODELIST={self.nodelist!r} names no host")
        return hosts[0]

    def layout(self, *, world_size: int, nproc_per_node: int, nnodes: int) -> SlurmLayout:
        """How the tasks of this step become the spec's ranks (docs/design.md §15).

        * not started by ``srun`` (the batch script itself): ``"batch"``, one process that runs
          the spec as it would outside Slurm;
        * one task per node and ``SLURM_NNODES`` equals the spec's ``parallel.nnodes``:
          ``"per-node"``, each task is its node's elastic launcher (the torchrun pattern) with
          nnodes = ``SLURM_NNODES`` and node rank = ``SLURM_NODEID``;
        * else ``SLURM_NTASKS`` equals the spec's world size: ``"per-device"``, each task is one
          worker with RANK = ``SLURM_PROCID``, WORLD_SIZE = ``SLURM_NTASKS``, LOCAL_RANK =
          ``SLURM_LOCALID`` (Lightning's SLURMEnvironment).

        Args:
            world_size: The spec's world size (``parallel.nnodes * nproc_per_node``; 1 for none/dp).
            nproc_per_node: Processes per node the spec asks for.

        Raises:
            ValueError: Neither layout fits; the message names the numbers on both sides.
        """
        if not self.in_step:
            return SlurmLayout("batch", self, nnodes=nnodes, node_rank=0, world_size=world_size)
        tasks, nodes = self.ntasks, self.nnodes
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
    """How one Slurm job step runs the spec (see :meth:`SlurmJob.layout`).

    Attributes:
        kind: ``"per-device"``, ``"per-node"`` or ``"batch"``.
        world_size: Processes in the job's process group.
        rank: This task's global rank (``"per-device"``: ``SLURM_PROCID``; else 0, the launcher's).
    """

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

    def rendezvous_endpoint(self, expand: Callable[[str], list[str]] | None = None) -> str:
        """``first host:port`` of the job: the c10d rendezvous (per-node) or ``MASTER_ADDR:MASTER_PORT`` (per-device).

        Raises:
            ValueError: The node list is empty or malformed.
        """
        return f"{self.job.first_host(expand)}:{self.job.port}"

    def worker_env(self, env: Mapping[str, str], expand: Callable[[str], list[str]] | None = None) -> dict[str, str]:
        """The torchrun variables that make a per-device task a worker of the job's process group.

        ``MASTER_ADDR`` and ``MASTER_PORT`` already in ``env`` are kept (as in Lightning); the
        others come from Slurm.

        Raises:
            ValueError: Not a per-device layout, or the node list is malformed.
        """
        if self.kind != "per-device":
            raise ValueError(f"a {self.kind} Slurm task is not a worker")
        host, _, port = self.rendezvous_endpoint(expand).rpartition(":")
        return {
            "RANK": str(self.job.procid),
            "LOCAL_RANK": str(self.job.localid),
            "WORLD_SIZE": str(self.job.ntasks),
            "LOCAL_WORLD_SIZE": str(self.job.local_tasks),
            "GROUP_RANK": str(self.job.nodeid),
            "MASTER_ADDR": env.get("MASTER_ADDR") or host,
            "MASTER_PORT": env.get("MASTER_PORT") or port,
        }


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
        slurm: The Slurm job this process runs in, or ``None`` outside Slurm.
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
    slurm: SlurmJob | None = None

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> LauncherEnvironment:
        """Read the launcher's variables from ``env`` (default: this process's environment).

        torchrun's variables come first: a worker the elastic agent started inside a Slurm job
        is that agent's worker. Slurm's are read into :attr:`slurm` and become ranks only
        through :meth:`SlurmJob.layout`, which needs the spec.

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
            slurm=SlurmJob.detect(env),
        )

    def as_slurm_worker(self, layout: SlurmLayout, env: Mapping[str, str]) -> LauncherEnvironment:
        """This process as the per-device Slurm task ``layout`` makes it: the worker its torchrun variables describe.

        Raises:
            ValueError: Not a per-device layout, or the node list is malformed.
        """
        merged = {**env, **layout.worker_env(env)}
        return replace(LauncherEnvironment.detect(merged), slurm=self.slurm)

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the process that logs and saves."""
        return self.rank == 0

    @property
    def restarted(self) -> bool:
        """Whether the elastic agent restarted the worker group (the job continues from its checkpoint)."""
        return self.restart_count > 0


def parse_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> tuple[int, ...]:
    """Expand Slurm's compressed tasks-per-node list: ``"2(x3),1"`` -> ``(2, 2, 2, 1)``; ``""`` -> ``()``.

    Raises:
        ValueError: ``text`` is not in that syntax.
    """
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            raise ValueError(f"{name}={text!r} is not a Slurm tasks-per-node list such as 2(x3),1")
        out += [int(match.group(1))] * int(match.group(2) or 1)
    return tuple(out)


def expand_nodelist(text: str, scontrol: str | None = "auto") -> list[str]:
    """The hosts of a Slurm hostlist, in order: ``scontrol show hostnames`` where it works, else :func:`parse_nodelist`.

    Args:
        text: A hostlist such as ``gpu[01-03,07],login1``.
        scontrol: Path of ``scontrol``; ``"auto"`` looks it up on ``PATH``; ``None`` always parses.

    Raises:
        ValueError: ``text`` is malformed (as the parser reads it).
    """
    tool = shutil.which("scontrol") if scontrol == "auto" else scontrol
    if tool and text.strip():
        try:
            done = subprocess.run(
                [tool, "show", "hostnames", text], capture_output=True, text=True, timeout=10, check=False
            )
            hosts = done.stdout.split()
            if done.returncode == 0 and hosts and not done.stderr.strip():
                return hosts
        except (OSError, subprocess.SubprocessError):
            pass
    return parse_nodelist(text)


def parse_nodelist(text: str) -> list[str]:
    """Expand Slurm's hostlist syntax without Slurm: ``a[1-2]-b[01,03],c`` -> ``a1-b01 a1-b03 a2-b01 a2-b03 c``.

    Items are separated by commas outside brackets; each bracket holds numbers and ranges
    ``LOW-HIGH`` (zero padding kept from ``LOW``); several brackets in one item expand left to
    right, the last one fastest, as ``scontrol show hostnames`` does.

    Raises:
        ValueError: Unbalanced brackets, an empty item, or a range that is not ``LOW-HIGH`` with ``LOW <= HIGH``.
    """
    hosts: list[str] = []
    for item in _split_top_level(text):
        names = [""]
        for literal, inner in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
            names = [name + literal for name in names]
            if inner:
                names = [name + number for name in names for number in _expand_ranges(inner, text)]
        hosts += names
    return hosts


def _split_top_level(text: str) -> list[str]:
    """The items of a hostlist: split at commas (and spaces) outside brackets."""
    items, depth, current = [], 0, ""
    for char in text.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"node list {text!r}: nested or unbalanced brackets")
        if char in ", " and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ValueError(f"node list {text!r}: unbalanced brackets")
    items.append(current)
    return [i for i in items if i]


def _expand_ranges(inner: str, text: str) -> list[str]:
    numbers: list[str] = []
    for part in inner.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match is None or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise ValueError(f"node list {text!r}: {part!r} is not a number or a range LOW-HIGH")
        low, high = match.group(1), match.group(2) or match.group(1)
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


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
