"""Memory readings for sizing the KV cache (the PROFILE step)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def _cgroup_headroom() -> int | None:
    limit = Path("/sys/fs/cgroup/memory.max")
    usage = Path("/sys/fs/cgroup/memory.current")
    try:
        raw = limit.read_text().strip()
        if raw == "max":
            return None
        return int(raw) - int(usage.read_text().strip())
    except (OSError, ValueError):
        return None


def available_bytes(device: torch.device) -> int:
    """Memory this process can still take on ``device`` (container limits included)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    avail = _meminfo_available()
    headroom = _cgroup_headroom()
    return avail if headroom is None else min(avail, headroom)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def peak_during(device: torch.device, fn: Callable[[], Any]) -> int:
    """Bytes of extra memory ``fn`` needed at its peak (activations, workspaces)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    before = _rss_kib("VmRSS")
    with contextlib.suppress(OSError):  # reset the peak-RSS mark: VmHWM measures fn alone
        Path("/proc/self/clear_refs").write_text("5")
    fn()
    return max(0, _rss_kib("VmHWM") - before) * 1024
