"""List the GPUs visible when runner starts (nvidia-smi and CUDA_VISIBLE_DEVICES), without initialising CUDA.

Numbering: ``index`` counts the GPUs visible when runner starts (the user's view,
honouring an inherited ``CUDA_VISIBLE_DEVICES``). ``entry`` is the
``CUDA_VISIBLE_DEVICES`` item that selects a device as inherited (an integer or a
``GPU-``/``MIG-`` UUID); ``physical_index`` is nvidia-smi's index (PCI bus order,
which CUDA follows once ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"
ORDER_VAR = "CUDA_DEVICE_ORDER"
DEFAULT_ORDER = "PCI_BUS_ID"
NVIDIA_SMI_QUERY = ("--query-gpu=index,name,uuid,memory.total", "--format=csv,noheader,nounits")


@dataclass(frozen=True)
class GpuInfo:
    """One GPU visible when runner starts.

    Attributes:
        index: Visible index, the number ``devices.ids`` refers to (0-based).
        name: Device name, e.g. ``NVIDIA A100-SXM4-80GB``.
        uuid: ``GPU-...`` UUID, or ``None`` when unknown.
        total_memory_bytes: Device memory in bytes, or ``None`` when unknown.
        entry: The ``CUDA_VISIBLE_DEVICES`` item that selects this device, as
            inherited (``"3"`` or ``"GPU-5a1c..."``); ``None`` means ``str(index)``.
        physical_index: nvidia-smi's index (PCI bus order), or ``None`` when unknown.
    """

    index: int
    name: str
    uuid: str | None = None
    total_memory_bytes: int | None = None
    entry: str | None = None
    physical_index: int | None = None

    @property
    def visible_entry(self) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` item that selects this device."""
        return self.entry if self.entry is not None else str(self.index)

    def label(self) -> str:
        """Return ``"2 -> NVIDIA A100 (CUDA_VISIBLE_DEVICES entry 5)"`` for messages."""
        where = f"CUDA_VISIBLE_DEVICES entry {self.visible_entry}"
        if self.physical_index is not None and str(self.physical_index) != self.visible_entry:
            where += f", nvidia-smi index {self.physical_index}"
        return f"{self.index} -> {self.name} ({where})"


@dataclass(frozen=True)
class Inventory:
    """The GPUs visible when runner starts.

    Attributes:
        gpus: Visible GPUs in visible order; ``gpus[i].index == i``.
        cuda_available: Whether torch is built with CUDA and at least one GPU is visible.
        inherited_visible: ``CUDA_VISIBLE_DEVICES`` as inherited (``None`` when unset).
        source: How the GPUs were found, e.g. ``"nvidia-smi"`` or why none were.
        notes: Things worth telling the user (ignored entries, device order).
    """

    gpus: list[GpuInfo] = field(default_factory=list)
    cuda_available: bool = False
    inherited_visible: str | None = None
    source: str = "none"
    notes: list[str] = field(default_factory=list)


SmiRunner = Callable[[], str | None]


def _run_nvidia_smi() -> str | None:
    """Return nvidia-smi's CSV output, or ``None`` when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _parse_smi(text: str) -> list[tuple[int, str, str | None, int | None]]:
    """Parse ``index, name, uuid, memory.total [MiB]`` rows."""
    rows = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        index, name, uuid, mem = int(parts[0]), ",".join(parts[1:-2]), parts[-2], parts[-1]
        mem_bytes = int(float(mem.split()[0]) * 2**20) if mem and mem[0].isdigit() else None
        rows.append((index, name, uuid if uuid.startswith(("GPU-", "MIG-")) else None, mem_bytes))
    return rows


def _map_visible(
    value: str | None, rows: list[tuple[int, str, str | None, int | None]]
) -> tuple[list[GpuInfo], list[str]]:
    """Apply CUDA's ``CUDA_VISIBLE_DEVICES`` rules to nvidia-smi rows.

    CUDA's rules (mirrored by ``torch.cuda._parse_visible_devices``): unset means
    all; an item that matches no device ends the list (so ``""`` and ``-1`` mean
    none); a repeated item hides every device; ``GPU-`` items match a unique
    UUID prefix.
    """
    if value is None:
        return [GpuInfo(pos, name, uuid, mem, str(idx), idx) for pos, (idx, name, uuid, mem) in enumerate(rows)], []
    notes: list[str] = []
    by_index = {r[0]: r for r in rows}
    chosen: list[tuple[str, tuple[int, str, str | None, int | None] | None]] = []
    for raw in value.split(","):
        item = raw.strip()
        if item.startswith("MIG-"):
            chosen.append((item, None))
            continue
        if item.startswith("GPU-"):
            matches = [r for r in rows if r[2] is not None and r[2].startswith(item)]
            if len(matches) != 1:
                why = "matches no GPU" if not matches else "matches several GPUs"
                notes.append(f"{VISIBLE_VAR} item {item!r} {why}; CUDA ignores it and every item after it")
                break
            chosen.append((item, matches[0]))
            continue
        digits = item.lstrip("+")
        if not digits.isdigit() or int(digits) not in by_index:
            if item not in ("", "-1"):
                notes.append(
                    f"{VISIBLE_VAR} item {item!r} is not a GPU index on this machine; "
                    "CUDA ignores it and every item after it"
                )
            break
        chosen.append((item, by_index[int(digits)]))
    keys = [row[0] if row is not None else item for item, row in chosen]
    if len(set(keys)) != len(keys):
        notes.append(f"{VISIBLE_VAR}={value!r} names a device twice; CUDA then shows no device at all")
        return [], notes
    gpus = []
    for pos, (item, row) in enumerate(chosen):
        if row is None:
            gpus.append(GpuInfo(pos, "MIG instance", item, None, item, None))
        else:
            gpus.append(GpuInfo(pos, row[1], row[2], row[3], item, row[0]))
    return gpus, notes


def _torch_has_cuda() -> bool:
    """Whether the installed torch is built with CUDA (imports torch; never initialises CUDA)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.version.cuda) and torch.backends.cuda.is_built()


def probe_inventory(env: Mapping[str, str] = os.environ, run_smi: SmiRunner = _run_nvidia_smi) -> Inventory:
    """List the GPUs visible to runner without initialising CUDA in this process.

    Reads ``nvidia-smi --query-gpu=index,name,uuid,memory.total`` and applies an
    inherited ``CUDA_VISIBLE_DEVICES`` (integer or ``GPU-`` UUID items, comma
    separated; empty or ``-1`` means none). Without nvidia-smi no GPU is reported.
    The environment is only read: :func:`runner.devices.resolve.resolve_devices` puts
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (unless the user chose an order) into the plan's
    ``env`` so that CUDA's numbering matches nvidia-smi's.

    Args:
        env: Environment to read ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` from.
        run_smi: Returns nvidia-smi's CSV output or ``None``; replaceable in tests.

    Returns:
        The inventory; ``gpus`` is empty on a machine without (visible) NVIDIA GPUs.
    """
    inherited = env.get(VISIBLE_VAR)
    text = run_smi()
    if text is None:
        return Inventory([], False, inherited, "nvidia-smi not found or failed: no GPU reported", [])
    rows = _parse_smi(text)
    gpus, notes = _map_visible(inherited, rows)
    order = env.get(ORDER_VAR)
    if (
        order not in (None, DEFAULT_ORDER)
        and gpus
        and any(not g.visible_entry.startswith(("GPU-", "MIG-")) for g in gpus)
    ):
        notes.append(
            f"{ORDER_VAR}={order}: CUDA numbers GPUs differently from nvidia-smi, so the names shown may not "
            f"match the devices used; unset it or set {ORDER_VAR}={DEFAULT_ORDER}"
        )
    cuda_ok = bool(gpus) and _torch_has_cuda()
    if gpus and not cuda_ok:
        notes.append("GPUs are visible but the installed torch is built without CUDA")
    return Inventory(gpus, cuda_ok, inherited, f"nvidia-smi ({len(rows)} GPU(s) on the machine)", notes)
