"""What would run: devices, world size, batches, launch method and tracking target of a spec.

Shared by ``runner plan`` (which prints it) and ``runner exec`` (which acts on it), so the
two can never disagree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Plan:
    """A resolved spec ready to run.

    Attributes:
        loaded: The :class:`runner.loading.LoadedSpec`.
        devices: The :class:`runner.devices.DevicePlan`.
        tracking_uri: Absolute MLflow tracking URI, or ``None`` when tracking is off.
        experiment: MLflow experiment name.
        launch: ``"in-process"``, ``"elastic"`` (runner starts the DDP workers) or
            ``"external"`` (already a worker of torchrun or a scheduler).
    """

    loaded: Any
    devices: Any
    tracking_uri: Optional[str]
    experiment: str
    launch: str

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (printed by ``runner plan --json``, logged as ``spec/plan.json``)."""
        spec = self.loaded.spec
        par = spec.parallel
        out: dict[str, Any] = {
            "spec": str(self.loaded.path),
            "name": spec.name,
            "mode": par.mode,
            "devices": self.devices.describe(),
            "world_size": self.devices.world_size,
            "global_batch_size": spec.data.batch_size,
            "grad_accum_steps": spec.train.grad_accum_steps,
            "launch": self.launch,
            "tracking_uri": self.tracking_uri,
            "experiment": self.experiment,
        }
        if par.mode == "ddp":
            out["rendezvous"] = {
                "backend": "c10d",
                "endpoint": par.rdzv_endpoint or "localhost:<free port>",
                "id": par.rdzv_id,
                "nnodes": par.nnodes,
                "node_rank": par.node_rank,
                "nproc_per_node": self.devices.nproc_per_node,
                "max_restarts": par.max_restarts,
            }
        return out


def launched_externally(env: Mapping[str, str]) -> bool:
    """True when torchrun or a scheduler already started this process as a worker (RANK etc. set)."""
    return all(k in env for k in LAUNCHER_ENV)


def make_plan(loaded: Any, *, env: Optional[Mapping[str, str]] = None, inventory: Any = None) -> Plan:
    """Resolve devices, launch method and tracking target of ``loaded``.

    Args:
        loaded: The :class:`runner.loading.LoadedSpec`.
        env: Environment to resolve against (default ``os.environ``).
        inventory: Device inventory (default: probed without initialising CUDA).

    Returns:
        The :class:`Plan`.

    Raises:
        DeviceError: The spec asks for devices this machine does not have.
        UsageError: Started by torchrun with a world size that differs from the spec's.
    """
    from runner.devices import probe_inventory, resolve_devices
    from runner.errors import UsageError
    from runner.tracking import resolve_tracking_uri

    env = os.environ if env is None else env
    spec = loaded.spec
    inventory = probe_inventory(env) if inventory is None else inventory
    devices = resolve_devices(spec, env, inventory)
    if launched_externally(env):
        launch = "external"
        outside = int(env["WORLD_SIZE"])
        if spec.parallel.mode != "ddp" and outside > 1:
            raise UsageError(
                f"{loaded.path}: started as one of {outside} workers (WORLD_SIZE={outside}) but parallel.mode = "
                f"\"{spec.parallel.mode}\": set mode = \"ddp\" or start runner without torchrun"
            )
        if spec.parallel.mode == "ddp" and outside != devices.world_size:
            raise UsageError(
                f"{loaded.path}: the launcher started WORLD_SIZE={outside} workers but the spec's world size is "
                f"{devices.world_size} (parallel.nnodes x nproc_per_node): make them agree"
            )
    elif spec.parallel.mode == "ddp":
        launch = "elastic"
    else:
        launch = "in-process"
    uri = resolve_tracking_uri(spec) if spec.tracking.enabled else None
    return Plan(loaded, devices, uri, spec.tracking.experiment or spec.name, launch)
