"""The ``[devices]`` and ``[parallel]`` tables: which devices, and how the model is replicated over them (static rules:
:mod:`runner.spec.rules`; what needs the machine: :mod:`runner.devices.resolve`).

They are apart from the other tables because a parallel mode is the one line a user switches: the mode table
(:data:`MODES`) says what each mode is, so that spec, devices, plan and launch ask a mode's traits, never its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from runner.spec.rules import SpecTable

ParallelMode = Literal["none", "dp", "ddp", "fsdp"]
Accelerator = Literal["auto", "cuda", "cpu"]

_ELASTIC_KEYS = (
    "backend",
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "rdzv_id",
    "max_restarts",
    "timeout_s",
    "hang_grace_s",
    "sync_batchnorm",
)


@dataclass(frozen=True)
class ModeTraits:
    """What the spec, device resolution and the launcher know of a mode, without torch (its strategy holds the rest).

    ``launch``: ``"in-process"`` or ``"elastic"``; ``keys``: the ``[parallel]`` keys that apply (the others are
    inactive); ``replicas``: one process drives every GPU; ``transforms_blocks``: compile and activation checkpointing
    apply; ``shards_state``: parameters, gradients and optimizer state are sharded over the ranks.
    """

    launch: Literal["in-process", "elastic"]
    keys: tuple[str, ...] = ()
    replicas: bool = False
    cuda_only: bool = False
    transforms_blocks: bool = True
    shards_state: bool = False

    @property
    def elastic(self) -> bool:
        """One process per device."""
        return self.launch == "elastic"


MODES: dict[str, ModeTraits] = {
    "none": ModeTraits("in-process"),
    "dp": ModeTraits("in-process", ("output_device", "dim"), replicas=True, cuda_only=True, transforms_blocks=False),
    "ddp": ModeTraits("elastic", (*_ELASTIC_KEYS, "find_unused_parameters", "static_graph", "gradient_as_bucket_view")),
    "fsdp": ModeTraits("elastic", (*_ELASTIC_KEYS, "fsdp_blocks", "reshard_after_forward"), shards_state=True),
}


REFERENCE_MODE = "none"
"""The mode every other is compared with (one process, one device): bench's efficiency and parity's losses."""


def modes_with(key: str) -> list[str]:
    """The modes that ``[parallel]`` key ``key`` applies to, in :data:`MODES` order."""
    return [mode for mode, traits in MODES.items() if key in traits.keys]


class DevicesSpec(SpecTable):
    """``[devices]``: which accelerator and which of the visible devices."""

    accelerator: Accelerator = "auto"
    """`cuda`, `cpu`, or `auto` (CUDA when a GPU is visible, else CPU)."""
    ids: list[int] | Literal["all"] = "all"
    """Indices into the GPUs visible when runner starts (after any inherited CUDA_VISIBLE_DEVICES), or `all`.
    mode = none runs on the first of them (a note says so). Inactive when the run is on CPU."""
    threads_per_process: int = Field(default=0, ge=0)
    """CPU threads (torch intra-op and inter-op) of each training process; 0 = OMP_NUM_THREADS when set, else
    the usable cores (CPU affinity; under Slurm its CPUs per task) / training processes on the node."""

    peak_tflops: float | None = Field(default=None, gt=0)
    """Peak dense TFLOP/s of one device at the run's precision, for the run's MFU metrics; replaces runner's
    table of known GPUs (docs/design.md §10). Default: the table's figure, else no MFU (CPUs, unknown GPUs)."""

    def check(self) -> None:
        """Rules inside ``[devices]``: a non-empty list of distinct, non-negative ids (ValueError)."""
        ids = self.ids
        if not isinstance(ids, list):
            return
        if not ids:
            raise ValueError('ids is empty: list at least one device index, e.g. [0], or use "all"')
        negative = [i for i in ids if i < 0]
        if negative:
            raise ValueError(f"ids {ids} contains negative indices {negative}: device ids count from 0")
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"ids {ids} lists {dupes} more than once: each device may appear once")


class ParallelSpec(SpecTable):
    """``[parallel]``: how the model is replicated; another mode's options are inactive, not errors (docs/design.md
    §10)."""

    mode: ParallelMode = "none"
    """`none` (one device), `dp` (torch.nn.DataParallel, one process), `ddp` (DistributedDataParallel, one
    process per device) or `fsdp` (fully_shard: parameters, gradients and optimizer state sharded over one
    process per device)."""
    # --- dp
    output_device: int | None = Field(default=None, ge=0)
    """dp only: device id (from devices.ids) that gathers outputs. Default: first id."""
    dim: int = Field(default=0, ge=0)
    """dp only: batch dimension the input is scattered along."""
    # --- ddp
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """ddp and fsdp: process-group backend; auto = nccl on CUDA, gloo on CPU."""
    nproc_per_node: int | None = Field(default=None, ge=1)
    """ddp and fsdp: worker processes per node. Default: number of device ids on CUDA, 1 on CPU."""
    nnodes: int = Field(default=1, ge=1)
    """ddp and fsdp: number of nodes."""
    node_rank: int = Field(default=0, ge=0)
    """ddp and fsdp: rank of this node, 0 .. nnodes-1."""
    rdzv_endpoint: str | None = None
    """ddp and fsdp: c10d rendezvous `host:port`; required when nnodes > 1. Default: a free local port."""
    rdzv_id: str = Field(default="runner", min_length=1)
    """ddp and fsdp: rendezvous (job) id shared by all nodes."""
    max_restarts: int = Field(default=0, ge=0)
    """ddp and fsdp: elastic restarts of failed workers."""
    timeout_s: float = Field(default=1800.0, gt=0, le=7 * 24 * 3600)
    """ddp and fsdp: process-group timeout in seconds (at most a week); a hung collective fails then."""
    hang_grace_s: float = Field(default=10.0, gt=0, le=3600)
    """ddp and fsdp: seconds a rank may make no progress after SIGTERM or SIGINT (writing a checkpoint
    excepted) before it counts as hung and ends itself, instead of torch's 30 s wait."""
    find_unused_parameters: bool = False
    """ddp only: allow parameters that get no gradient in a step."""
    static_graph: bool = False
    """ddp only: the set of used parameters never changes."""
    gradient_as_bucket_view: bool = False
    """ddp only: gradients are views into the all-reduce buckets (saves memory)."""
    sync_batchnorm: bool = False
    """ddp and fsdp, CUDA only: convert BatchNorm layers to SyncBatchNorm."""
    # --- fsdp
    fsdp_blocks: list[str] | None = None
    """fsdp only: class names of the modules sharded as one unit each (e.g. ["TransformerBlock"]), before the
    root. Default: each direct child of the model that has parameters."""
    reshard_after_forward: bool = True
    """fsdp only: free the gathered parameters after forward and gather them again for backward (less memory,
    more communication)."""

    def check(self) -> None:
        """Rules inside ``[parallel]``: the endpoint's form, node rank and nodes where they apply (ValueError).

        Another mode's options are inactive, not errors (docs/design.md §10), so ``--set parallel.mode`` alone switches;
        ``nnodes > 1`` without ``rdzv_endpoint`` is a launch rule (:mod:`runner.plan`).
        """
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError(f'rdzv_endpoint {self.rdzv_endpoint!r} must be host:port, e.g. "10.0.0.1:29500"')
        if "nnodes" not in self.traits.keys:
            return
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank = {self.node_rank} must be < nnodes = {self.nnodes}")

    @property
    def traits(self) -> ModeTraits:
        """What :attr:`mode` is: how it launches, which keys apply (:data:`MODES`)."""
        return MODES[self.mode]
