"""Peak memory of one rank: the CUDA allocator's peak on its device, else the process's peak resident set."""

from __future__ import annotations

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak of ``device``, else this process's peak resident set size (bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes() or 0


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process image, bytes (``VmHWM``; Linux only, else ``None``).

    Unlike ``getrusage().ru_maxrss``, ``VmHWM`` starts afresh at ``exec``: a ``spawn``-ed worker
    does not inherit the peak of the process that started it.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
