"""Kernels of our own, compiled here once and kept (C++ against the installed torch).

``decode_attention`` (decode_attention.cpp) is ``torch.ops.inference.decode_attention``: a
decode step's attention over the KV cache near the cache's read time, where torch's CPU SDPA
takes 4-6x it (bench/decode_attention.py). It is a ``torch.library`` op with a fake (meta)
implementation, so ``torch.export`` keeps it as one node and an AOTInductor package calls it
by name at run time: the op must be registered (``load``) before such a package runs.

The shared library is built for the CPU's vector instructions (as inductor picks them), so it is
keyed by the source, the flags, torch's version and the CPU's flags, and kept in a
directory (the service's --compile-cache-dir, else the user's cache): a later start loads it
in milliseconds; the first build takes ~20-40 s on a small CPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
BASE_CFLAGS = ["-O3", "-fopenmp"]
OP = "inference::decode_attention"
_lock = threading.Lock()
_loaded: Path | None = None  # the library this process registered the op from


def directory_for(compile_cache_dir: str) -> Path:
    """Where the library is kept: beside the compiled artifacts (--compile-cache-dir), or in
    the user's cache when they are not kept ('')."""
    if compile_cache_dir:
        return Path(compile_cache_dir).expanduser() / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inference-svc" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cflags() -> list[str]:
    """The vector instructions inductor picks for this CPU (AVX-512, AVX2, or none): at::vec
    in the kernel follows its CPU_CAPABILITY macro, the -m flags let the compiler emit it."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    macros = [f"-D{m}" for m in isa.build_macro()] if isa else []
    arch = isa.build_arch_flags().split() if isa else []
    return [*BASE_CFLAGS, *macros, *arch]


def key() -> str:
    """What the built library depends on: source, flags, torch, the CPU's instructions."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (*cflags(), torch.__version__, sys.version, _cpu_flags()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def available() -> bool:
    """Whether the op can be built here: a CPU build's C++ toolchain (what AOTInductor needs)."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def load(directory: Path | None = None) -> Path:
    """Register ``torch.ops.inference.decode_attention``, building its library into
    ``directory`` (default: the user's cache) when no kept one fits. The library's path."""
    global _loaded
    directory = directory or directory_for("")
    target = directory / f"decode_attention-{key()}.so"
    with _lock:
        if _loaded is not None:  # registered already (from another directory: keep it here too)
            if not target.exists():
                _publish(directory, target, lambda tmp: shutil.copy(_loaded, tmp))
            return target
        if not target.exists():
            _build(directory, target)
        torch.ops.load_library(str(target))
        _register_fake()
        _loaded = target
    return target


def _publish(directory: Path, target: Path, make: Callable[[Path], object]) -> None:
    """``make(tmp)`` writes a library into a directory of its own, then one rename: processes
    that build at once (test workers, replicas on one volume) never load a half-written one."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        make(Path(tmp))
        os.replace(next(Path(tmp).glob("*.so")), target)


def _build(directory: Path, target: Path) -> None:
    from torch.utils.cpp_extension import load

    # torch runs `ninja` from PATH: the one pip put beside this interpreter, if not on it
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    start = time.monotonic()
    log.info("building the decode attention kernel into %s (once per CPU and torch)", target)
    _publish(directory, target, lambda tmp: load(
        name=f"inference_kernels_{key()}", sources=[str(SOURCE)], extra_cflags=cflags(),
        extra_ldflags=["-fopenmp"], build_directory=str(tmp), is_python_module=False,
    ))  # fmt: skip
    log.info("decode attention kernel built in %.1f s", time.monotonic() - start)


def _register_fake() -> None:
    @torch.library.register_fake(OP)
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int,
          scale: float) -> torch.Tensor:  # fmt: skip
        return q.new_empty(q.shape)
