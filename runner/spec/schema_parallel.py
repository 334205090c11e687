"""The ``[devices]`` and ``[parallel]`` tables: which devices, and how the model is replicated over them.

Their static rules are :func:`runner.spec.rules.check_devices` and :func:`runner.spec.rules.check_parallel`;
what needs the machine (visible GPUs, CUDA) is checked by :mod:`runner.devices.resolve`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from runner.spec import rules
from runner.spec.table import SpecTable

ParallelMode = Literal["none", "dp", "ddp"]
Accelerator = Literal["auto", "cuda", "cpu"]


class DevicesSpec(SpecTable):
    """``[devices]``: which accelerator and which of the visible devices."""

    accelerator: Accelerator = Field(
        default="auto",
        description="`cuda`, `cpu`, or `auto` (CUDA when a GPU is visible, else CPU). Default: auto.",
    )
    ids: list[int] | Literal["all"] = Field(
        default="all",
        description=(
            "Indices into the GPUs visible when runner starts (after any inherited CUDA_VISIBLE_DEVICES), "
            "or `all`. mode = none runs on the first of them (a note says so). Inactive when the run is on "
            "CPU. Default: all."
        ),
    )
    threads_per_process: int = Field(
        default=0,
        ge=0,
        description=(
            "CPU threads (torch intra-op and inter-op) of each training process; 0 = OMP_NUM_THREADS when set, "
            "else the usable cores (CPU affinity; under Slurm its CPUs per task) / training processes on the node. "
            "Default: 0."
        ),
    )

    rule = rules.check_devices


class ParallelSpec(SpecTable):
    """``[parallel]``: how the model is replicated. Options of another mode are inactive, not errors.

    Changing ``mode`` alone switches a spec between none, dp and ddp (docs/design.md §10): dp's and
    ddp's options stay in the file, are shown as inactive by ``runner plan`` and are not logged.
    """

    mode: ParallelMode = Field(
        default="none",
        description=(
            "`none` (one device), `dp` (torch.nn.DataParallel, one process) or "
            "`ddp` (DistributedDataParallel, one process per device). Default: none."
        ),
    )
    # --- dp
    output_device: int | None = Field(
        default=None, ge=0, description="dp only: device id (from devices.ids) that gathers outputs. Default: first id."
    )
    dim: int = Field(default=0, ge=0, description="dp only: batch dimension the input is scattered along. Default: 0.")
    # --- ddp
    backend: Literal["auto", "nccl", "gloo"] = Field(
        default="auto", description="ddp only: process-group backend; auto = nccl on CUDA, gloo on CPU. Default: auto."
    )
    nproc_per_node: int | None = Field(
        default=None,
        ge=1,
        description="ddp only: worker processes per node. Default: number of device ids on CUDA, 1 on CPU.",
    )
    nnodes: int = Field(default=1, ge=1, description="ddp only: number of nodes. Default: 1.")
    node_rank: int = Field(default=0, ge=0, description="ddp only: rank of this node, 0 .. nnodes-1. Default: 0.")
    rdzv_endpoint: str | None = Field(
        default=None,
        description="ddp only: c10d rendezvous `host:port`; required when nnodes > 1. Default: a free local port.",
    )
    rdzv_id: str = Field(
        default="runner",
        min_length=1,
        description="ddp only: rendezvous (job) id shared by all nodes. Default: runner.",
    )
    max_restarts: int = Field(default=0, ge=0, description="ddp only: elastic restarts of failed workers. Default: 0.")
    timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="ddp only: process-group timeout in seconds; a hung collective fails after it. Default: 1800.",
    )
    hang_grace_s: float = Field(
        default=10.0,
        gt=0,
        description=(
            "ddp only: seconds a rank may make no progress after SIGTERM or SIGINT (writing a checkpoint "
            "excepted) before it counts as hung and ends itself, instead of torch's 30 s wait. Default: 10."
        ),
    )
    find_unused_parameters: bool = Field(
        default=False, description="ddp only: allow parameters that get no gradient in a step. Default: false."
    )
    static_graph: bool = Field(
        default=False, description="ddp only: the set of used parameters never changes. Default: false."
    )
    gradient_as_bucket_view: bool = Field(
        default=False,
        description="ddp only: gradients are views into the all-reduce buckets (saves memory). Default: false.",
    )
    sync_batchnorm: bool = Field(
        default=False, description="ddp only, CUDA only: convert BatchNorm layers to SyncBatchNorm. Default: false."
    )

    rule = rules.check_parallel
