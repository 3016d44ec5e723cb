"""This project's C++ ops, compiled here once and kept (against the installed torch):

- ``torch.ops.inference.decode_attention`` (decode_attention.cpp): a decode step's attention
  over the KV cache near the cache's read time, where torch's CPU SDPA takes 2-6x it
  (bench/decode_attention.py; ``--decode-attention native``).
- ``torch.ops.inference.quant_linear`` (quant_linear.cpp, quant_linear_x86.h): a linear layer
  in 4- or 8-bit groups as integer dot products, 1.3-2.7x torch's int4 kernel on an AVX2 CPU,
  1.2-1.7x its decode step on AVX512-VNNI (models/weights.py ``QuantLinear``;
  ``--linear-kernel native``).
- ``torch.classes.inference.Package`` and ``torch.ops.inference.run_package`` (package.cpp):
  an AOTInductor package run with the GIL released (models/aoti.py).

The decode attention and the linear have fake (meta) implementations, so ``torch.export``
keeps each as one node and an AOTInductor package calls it by name at run time: the library
must be loaded (``load``) before such a package runs. It is built for the vector
instructions ATen uses on this CPU, so it is keyed by the sources, the flags, torch's
version and the CPU's flags, and kept in a directory (``set_directory``: the service's
--compile-cache-dir, else the user's cache): a later start loads it in milliseconds; the
first build takes ~15-40 s on 2 cores. Every build also leaves a copy in the user's cache,
and a directory without the library takes that copy when it fits (a new --compile-cache-dir
on a machine that built it once: a copy, not a build).
"""

from __future__ import annotations

import functools
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

HERE = Path(__file__).parent
SOURCES = [HERE / f"{name}.cpp" for name in ("decode_attention", "quant_linear", "package")]
HEADERS = [HERE / "quant_linear_x86.h"]
BASE_CFLAGS = ["-O3", "-fopenmp"]
_lock = threading.Lock()
_loaded: Path | None = None  # the library this process registered its ops from
_directory: Path | None = None  # where load() keeps it (set_directory), else the user's cache


def set_directory(compile_cache_dir: str) -> None:
    """Keep the library beside the compiled artifacts from now on (the service's start)."""
    global _directory
    _directory = directory_for(compile_cache_dir)


def directory_for(compile_cache_dir: str) -> Path:
    """Where the library is kept: beside the compiled artifacts (--compile-cache-dir), or in
    the user's cache when they are not kept ('')."""
    if compile_cache_dir:
        return Path(compile_cache_dir).expanduser() / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inference-svc" / "kernels"


# The vector instructions ATen dispatches its own kernels to on this CPU, as CPU_CAPABILITY
# macros (at::vec in the kernels follows them) and the -m flags inductor compiles them with.
# (Not inductor's own pick_vec_isa: it imports inductor and test-builds a library per ISA in
# subprocesses, seconds a restart from kept packages otherwise never spends.)
ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
               "-mavx512bw", "-mfma", "-mf16c"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}  # fmt: skip


# Instructions past the capability's, used where /proc/cpuinfo lists them (quant_linear's
# VNNI integer dot products on an AVX-512 CPU).
EXTRA_FLAGS = {"AVX512": {"avx512_vnni": "-mavx512vnni"}}


def cflags() -> list[str]:
    from inference_svc.models.cpu import capabilities

    caps = capabilities()
    extra = [f for flag, f in EXTRA_FLAGS.get(caps.isa, {}).items() if flag in caps.flags]
    return [*BASE_CFLAGS, *ISA_FLAGS.get(caps.isa, []), *extra]


@functools.cache
def key() -> str:
    """What the built library depends on: source, flags, torch, the CPU's instructions."""
    from inference_svc.models.cpu import capabilities

    h = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS)))
    flags = " ".join(sorted(capabilities().flags))
    for part in (*cflags(), torch.__version__, sys.version, flags):
        h.update(part.encode())
    return h.hexdigest()[:16]


def available() -> bool:
    """Whether the op can be built here: a CPU build's C++ toolchain (what AOTInductor needs)."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def load(directory: Path | None = None) -> Path:
    """Register this project's ops (``torch.ops.inference.*``), building their library into
    ``directory`` (default: set_directory's, else the user's cache) when no kept one fits.
    The library's path."""
    global _loaded
    directory = directory or _directory or directory_for("")
    target = directory / f"inference_ops-{key()}.so"
    with _lock:
        if _loaded is not None:  # registered already (from another directory: keep it here too)
            if not target.exists():
                _publish(directory, target, lambda tmp: shutil.copy(_loaded, tmp))
            return target
        if not target.exists():
            _build_or_copy(directory, target)
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


def _build_or_copy(directory: Path, target: Path) -> None:
    """The library into ``directory``: the user's cache's copy when it has one, else built
    (and a copy left there; a read-only home only logs it)."""
    shared = directory_for("")
    kept = shared / target.name
    if directory != shared and kept.exists():
        _publish(directory, target, lambda tmp: shutil.copy(kept, tmp))
        log.info("this project's ops copied from %s", kept)
        return
    _build(directory, target)
    if directory != shared and not kept.exists():
        try:
            _publish(shared, kept, lambda tmp: shutil.copy(target, tmp))
        except OSError as exc:
            log.info("this project's ops not kept in %s: %s", shared, exc)


def _build(directory: Path, target: Path) -> None:
    from torch.utils.cpp_extension import load

    # torch runs `ninja` from PATH: the one pip put beside this interpreter, if not on it
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    start = time.monotonic()
    log.info("building this project's ops into %s (once per CPU and torch)", target)
    _publish(directory, target, lambda tmp: load(
        name=f"inference_kernels_{key()}", sources=[str(src) for src in SOURCES],
        extra_cflags=cflags(), extra_ldflags=["-fopenmp"], build_directory=str(tmp),
        is_python_module=False,
    ))  # fmt: skip
    log.info("this project's ops built in %.1f s", time.monotonic() - start)


def _register_fake() -> None:
    @torch.library.register_fake("inference::decode_attention")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int,
          scale: float) -> torch.Tensor:  # fmt: skip
        return q.new_empty(q.shape)

    @torch.library.register_fake("inference::quant_linear")
    def _(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
          bits: int) -> torch.Tensor:  # fmt: skip
        return x.new_empty((*x.shape[:-1], q.shape[0] * 8))
