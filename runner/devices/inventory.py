"""What the machine has: the GPUs visible when runner starts (NVML and ``CUDA_VISIBLE_DEVICES``), their peak FLOP/s for
MFU, how busy the host is, and variables set for a block of code.

CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when it starts: the driver must choose the devices and narrow the variable
before anything starts CUDA in it, so nothing here initialises CUDA to look (NVML reads the GPUs instead). A spec's
``devices.ids`` index these GPUs as the user sees them (numbering: :mod:`runner.devices.resolve`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"
ORDER_VAR = "CUDA_DEVICE_ORDER"
DEFAULT_ORDER = "PCI_BUS_ID"

# Peak dense TFLOP/s of one GPU (no sparsity), by NVML name, for MFU. fp32 is CUDA-core FP32 (torch's default keeps
# TF32 off for matmuls); bf16 and fp16 are tensor-core figures. Source: NVIDIA's datasheet of each product, named in
# the entry; the first pattern that matches the name wins. An unknown GPU, a dtype a GPU lacks, and CPUs get no MFU.
PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"H200 NVL", "NVIDIA H200 NVL datasheet", {"fp32": 60.0, "bf16": 835.0, "fp16": 835.0}),
    (r"H200", "NVIDIA H200 SXM datasheet", {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0}),
    (r"H100 NVL", "NVIDIA H100 NVL datasheet", {"fp32": 60.0, "bf16": 835.0, "fp16": 835.0}),
    (r"H100 PCIe", "NVIDIA H100 PCIe datasheet", {"fp32": 51.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H100", "NVIDIA H100 SXM datasheet", {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0}),
    (r"A100", "NVIDIA A100 datasheet", {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0}),
    (r"L40S", "NVIDIA L40S datasheet", {"fp32": 91.6, "bf16": 362.0, "fp16": 362.0}),
    (r"\bL4\b", "NVIDIA L4 datasheet", {"fp32": 30.3, "bf16": 121.0, "fp16": 121.0}),
    (r"\bA10\b", "NVIDIA A10 datasheet", {"fp32": 31.2, "bf16": 125.0, "fp16": 125.0}),
    (r"V100", "NVIDIA V100 datasheet (SXM2)", {"fp32": 15.7, "fp16": 125.0}),
    (r"\bT4\b", "NVIDIA T4 datasheet", {"fp32": 8.1, "fp16": 65.0}),
)


@dataclass(frozen=True)
class GpuInfo:
    """One visible GPU: ``index`` is what ``devices.ids`` names; ``entry`` the ``CUDA_VISIBLE_DEVICES`` item that
    selects it (``None``: ``str(index)``); ``physical_index`` nvidia-smi's."""

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


def affinity_cores() -> int:
    """The CPU cores this process may run on (its affinity; ``os.cpu_count()`` where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class HostLoad:
    """The 1-minute load average at a run's start and end, and the CPU steal between (``None`` where unreported)."""

    start: float
    end: float
    cores: int
    steal: float | None = None

    @staticmethod
    def read() -> tuple[float, tuple[float, float]]:
        """The 1-minute load average now and the CPU's (steal, total) seconds (psutil), for :meth:`since`."""
        import psutil

        times = psutil.cpu_times()
        return psutil.getloadavg()[0], (getattr(times, "steal", 0.0), sum(times))

    @classmethod
    def since(cls, started: tuple[float, tuple[float, float]]) -> HostLoad:
        """The load from a reading at the run's start (:meth:`read`) to now."""
        end, counters = cls.read()
        (steal_before, total_before), (steal, total) = started[1], counters
        stolen = (steal - steal_before) / (total - total_before) if total > total_before else None
        return cls(started[0], end, affinity_cores(), stolen or None)

    def busy(self, used: int) -> bool:
        """Whether other work competed with the run: the load exceeded the ``used`` cores, or CPU was stolen."""
        return max(self.start, self.end) > min(used, self.cores) or (self.steal or 0.0) > 0.05

    def describe(self, used: int) -> str:
        """``busy: 1-min load 3.4 at the start, 2.1 at the end, on 2 cores; the run used 2 (...)``."""
        steal = f", {self.steal:.0%} CPU steal" if self.steal and self.steal >= 0.005 else ""
        text = (
            f"1-min load {self.start:.1f} at the start, {self.end:.1f} at the end{steal}, on {self.cores} cores; "
            f"the run used {min(used, self.cores)}"
        )
        if self.busy(used):
            return f"busy: {text}: other work competed for the CPU, so speed figures are low and noisy"
        return f"quiet: {text}"

    def tags(self, used: int) -> dict[str, str]:
        """A run's tags: ``runner.host_busy``, and ``runner.host_load``, :meth:`describe` in one short line (``busy:
        load 3.4 -> 2.1 on 2 cores, 2 used``)."""
        steal = f", {self.steal:.0%} steal" if self.steal and self.steal >= 0.005 else ""
        state = "busy" if self.busy(used) else "quiet"
        cores = f"{self.cores} cores, {min(used, self.cores)} used"
        load = f"{state}: load {self.start:.1f} -> {self.end:.1f} on {cores}{steal}"
        return {"runner.host_load": load, "runner.host_busy": str(self.busy(used)).lower()}

    def advice(self, used: int, threads: int, accelerator: str) -> str:
        """What to change when a CPU run with ``threads`` per process was ``busy``, else ``""``.

        The thread rule stays fixed (threads change a run's arithmetic); figures in docs/design.md §3.
        """
        if accelerator != "cpu" or threads < 2 or not self.busy(used):
            return ""
        return f"on a shared CPU one intra-op thread stalls less than {threads}: devices.threads_per_process = 1"


@dataclass(frozen=True)
class Inventory:
    """The GPUs visible when runner starts, in visible order, with how they were found and the CPU affinity's cores."""

    gpus: list[GpuInfo] = field(default_factory=list)
    cuda_available: bool = False
    source: str = "none"
    notes: list[str] = field(default_factory=list)
    cores: int = field(default_factory=affinity_cores)


GpuRow = tuple[int, str, str | None, int | None]  # PCI-order index, name, uuid, total memory in bytes


def read_nvml(nvml: Any = None) -> list[GpuRow] | str:  # Any: pynvml has no type stubs
    """The machine's GPUs through NVML (``pynvml``, or a stand-in), sorted by PCI bus id: ``(index, name, uuid,
    bytes)`` rows, or why none could be read. NVML does not initialise CUDA."""
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return "NVML unavailable (install nvidia-ml-py): no GPU reported"
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and its subclasses: no driver, no library, ...
        return f"NVML unavailable ({_text(exc) or type(exc).__name__}): no GPU reported"
    try:
        found = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            bus = _text(nvml.nvmlDeviceGetPciInfo(handle).busId).lower()
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            found.append((bus, _text(nvml.nvmlDeviceGetName(handle)), uuid, _memory(nvml, handle)))
    except Exception as exc:
        return f"NVML failed while listing GPUs ({_text(exc) or type(exc).__name__}): no GPU reported"
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    found.sort(key=lambda row: row[0])
    return [
        (index, name, uuid if uuid.startswith(("GPU-", "MIG-")) else None, mem)
        for index, (_, name, uuid, mem) in enumerate(found)
    ]


def _memory(nvml: Any, handle: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:  # NVMLError_NotSupported on some devices
        return None


def _text(value: Any) -> str:
    """NVML strings are ``bytes`` in older ``pynvml`` releases and ``str`` in newer ones."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _map_visible(value: str | None, rows: list[GpuRow]) -> tuple[list[GpuInfo], list[str]]:
    """The machine's GPUs (PCI bus order) that ``CUDA_VISIBLE_DEVICES`` leaves, by CUDA's rules (docs/design.md §4)."""
    if value is None:
        return [GpuInfo(pos, name, uuid, mem, str(idx), idx) for pos, (idx, name, uuid, mem) in enumerate(rows)], []
    notes: list[str] = []
    by_index = {r[0]: r for r in rows}
    chosen: list[tuple[str, GpuRow | None]] = []
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


def probe_inventory(env: Mapping[str, str] = os.environ, nvml: Any = None) -> Inventory:
    """List the GPUs visible to runner without initialising CUDA: NVML's, narrowed by an inherited
    ``CUDA_VISIBLE_DEVICES`` (integers or ``GPU-`` UUIDs; empty or ``-1``: none). Only reads ``env``."""
    rows = read_nvml(nvml)
    if isinstance(rows, str):
        return Inventory([], False, rows, [])
    gpus, notes = _map_visible(env.get(VISIBLE_VAR), rows)
    order = env.get(ORDER_VAR)
    if (
        order not in (None, DEFAULT_ORDER)
        and gpus
        and any(not g.visible_entry.startswith(("GPU-", "MIG-")) for g in gpus)
    ):
        notes.append(
            f"{ORDER_VAR}={order}: CUDA numbers GPUs differently from the PCI bus order, so the names shown may not "
            f"match the devices used; unset it or set {ORDER_VAR}={DEFAULT_ORDER}"
        )
    cuda_ok = bool(gpus) and _torch_has_cuda()
    if gpus and not cuda_ok:
        notes.append("GPUs are visible but the installed torch is built without CUDA")
    return Inventory(gpus, cuda_ok, f"NVML ({len(rows)} GPU(s) on the machine)", notes)


def peak_tflops(name: str, dtype: str) -> tuple[float, str] | None:
    """``(peak dense TFLOP/s, source)`` of one device named ``name`` (NVML's name, or ``"cpu"``) computing in
    ``dtype`` (``fp32``, ``bf16`` or ``fp16``), from :data:`PEAK_TFLOPS`; ``None`` when unknown."""
    for pattern, source, peaks in PEAK_TFLOPS:
        if re.search(pattern, name) and dtype in peaks:
            return peaks[dtype], source
    return None


def cuda_initialized() -> bool:
    """Whether CUDA is initialised in this process (never imports torch to find out)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the duration of the ``with`` block, then put the previous values back (a
    variable that was unset is removed again). Child processes started inside the block inherit them."""
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
