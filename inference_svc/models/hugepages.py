"""Zeroed tensors in transparent huge pages: the KV cache.

A decode step reads each row's cache, a block of keys and one of values per (row, KV head)
and layer: at 16 rows x 1024 slots of the packaged SmolLM2 a step's reads span ~180K 4 KiB
pages, far more than a TLB holds. In 2 MiB pages the native decode attention ran 0.87-0.94x
its time on 4 KiB pages, and the int4 decode step 0.96-0.98x at 8 and 16 rows, ~1.0 at one
(bench/README.md, "The KV cache in huge pages"). The weights in huge pages measured no gain
(a step reads each layer's weights as one stream), so only the cache asks for them.

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
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
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
        flat = torch.frombuffer(region, dtype=dtype, count=math.prod(shape), offset=at)
        t = torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), 0, shape)
        out.append(t.zero_())  # every page touched now: it reads as zeros already
    return out, f"huge pages (THP {setting})"
