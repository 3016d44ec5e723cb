"""Zeroed tensors in transparent huge pages: the KV cache.

A decode step reads each row's cache, a block of keys and one of values per (row, KV head)
and layer: at 16 rows x 1024 slots of the packaged SmolLM2 a step's reads span ~180K 4 KiB
pages, far more than a TLB holds. In 2 MiB pages the int4 package's decode step ran 1.05 /
1.12 / 1.12x faster at 1 / 8 / 16 rows and context 1000, 1.00 / 1.04 / 1.05x at 256
(bench/README.md, "The KV cache in huge pages"). The weights in huge pages measured no gain,
so only the cache asks for them.

Linux backs memory with huge pages where ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always``, or ``madvise`` (the usual default) for a region that asks (``madvise
(MADV_HUGEPAGE)``); torch's allocator does not ask. So the cache is one anonymous private
mapping that asks, the tensors side by side in it, each page touched at allocation (a fault
mid-serving would zero 2 MiB in a request's time); what it wastes is under one huge page.
Without that call (not Linux, THP off) the tensors come from torch.zeros.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch
from torch import Tensor

HUGE = 2 << 20  # x86-64's transparent huge page
PAGE = 4096
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_setting() -> str:
    """The kernel's transparent huge page setting (always, madvise, never), or why none."""
    try:
        text = _SETTING.read_text()
    except OSError:
        return "unavailable"
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else text.strip()


def zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[list[Tensor], str]:
    """``count`` zeroed CPU tensors of ``shape`` and ``dtype``, in huge pages where the kernel
    gives them; and how they were allocated (for the log)."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    step = -(-nbytes // PAGE) * PAGE  # the tensors side by side, each on a page boundary
    setting = thp_setting()
    if setting not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"):
        plain = [torch.zeros(shape, dtype=dtype) for _ in range(count)]
        return plain, f"4 KiB pages (THP {setting})"
    region = mmap.mmap(-1, count * step + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE
    out = []
    for i in range(count):
        # A storage of its own for each (frombuffer's keeps the mapping alive): views of one
        # storage would be aliased inputs to a compiled graph that writes them. Set on a new
        # tensor, not viewed: a plain tensor, no view of a flat one.
        at = start + i * step
        flat = torch.frombuffer(region, dtype=dtype, count=numel, offset=at)
        t = torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), 0, shape)
        out.append(t.zero_())  # every page touched now: it reads as zeros already
    return out, f"huge pages (THP {setting})"
