"""Compiled artifacts kept between starts (--compile-cache-dir).

A compiled start leaves what torch.compile made (Dynamo packages, so a restart skips
tracing; AOTAutograd and inductor cache entries; the C++ kernels) in one directory per
key under the cache root. The key covers everything the artifacts depend on and torch
does not check itself: the torch and Python versions, the CPU's capabilities, the thread
count, the compilation mode, the numerics, the shape limits, the weights (a hash of the
model files) and the code of the compiled functions. A start uses a directory only when
its manifest names the same key and every file matches its recorded hash; anything else
(none yet, another key, a truncated or corrupt file, a load error) is logged with the
reason and the service compiles as if there were no cache.

Concurrency: a process never writes into a kept directory. It works in a private copy
(in the temp directory), and publishes by copying to a hidden directory under the root and
renaming it into place, which is atomic: replicas that start together each compile, the
first rename wins, and the others keep theirs unpublished. A read-only root (a volume
filled once, mounted read-only by many replicas) works: nothing is written to it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from inference_api.plan import CompilationMode
from inference_svc.config import ServiceConfig
from inference_svc.engine.artifact_key import (
    FORMAT,
    MANIFEST,
    SHAPE_SETTINGS,
    ArtifactKey,
    make_key,
    manifest_files,
    verify,
)

log = logging.getLogger(__name__)


def _executable(directory: Path) -> bool:
    """Whether shared objects in ``directory`` can be loaded: inductor dlopens the C++
    kernels it compiles there, and Docker mounts a tmpfs ``noexec`` unless told otherwise."""
    try:
        return not os.statvfs(directory).f_flag & os.ST_NOEXEC and os.access(directory, os.W_OK)
    except OSError:
        return False


def work_parent(root: Path) -> Path:
    """Where a process's private working directory goes: the temp directory, unless it is
    mounted noexec (a container's tmpfs /tmp), then the compile cache directory."""
    tmp = Path(tempfile.gettempdir())
    if _executable(tmp):
        return tmp
    with contextlib.suppress(OSError):
        root.mkdir(parents=True, exist_ok=True)
    if root.is_dir() and _executable(root):
        log.warning(
            "compiled artifacts: %s is mounted noexec (compiled kernels cannot load from it); "
            "working in %s instead (mount it with exec, e.g. compose `tmpfs: [/tmp:exec]`)",
            tmp,
            root,
        )
        return root
    raise OSError(
        f"no directory to compile in: {tmp} is mounted noexec or read-only (compiled kernels "
        f"cannot load from it) and so is {root}; mount {tmp} with exec"
    )


def _isa_checks_where_they_last() -> None:
    """Inductor test-builds and loads a small library per vector ISA the first time a process
    compiles (~9.5 s on a 2-core AMD EPYC), into its cache directory, where the next process
    finds them. A start that compiles points that directory at its own empty one (``open``),
    so every cold start paid them again: run them first, in inductor's directory as the user
    set it (its answers are then cached in this process). A start from kept artifacts skips
    this: it needs no check (a restart built nothing: 0 compiler runs); so does one whose
    models run on a GPU (inductor's C++ may never be needed there).
    """
    from torch._inductor import cpu_vec_isa

    start = time.monotonic()
    cpu_vec_isa.valid_vec_isa_list()
    log.debug("inductor's vector ISA checks: %.1f s", time.monotonic() - start)


class CompileArtifacts:
    """The kept artifacts of one start: opened before the models are built (torch.compile
    looks up Dynamo packages then), published after the last warmup step."""

    def __init__(self, root: Path, key: ArtifactKey, cpu: bool = True) -> None:
        self.root, self.key = root, key
        self.cpu = cpu  # the models run on a CPU (inductor generates C++ for them)
        self.entry = root / key.digest
        parent = work_parent(root)
        prefix = ".work-" if parent == root else "inference-svc-compile-"  # hidden in the root
        self.staging = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        self.loaded = False
        self.reason = ""  # why nothing was loaded

    def open(self) -> None:
        """Choose, then point torch at the working directory. On the compiling thread."""
        self.choose()
        if not self.loaded and self.cpu:
            _isa_checks_where_they_last()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.staging)
        # Dynamo packages on (torch.compile saves and finds them). torch 2.13 keeps config
        # set at run time per thread: call this on the thread that compiles.
        torch._dynamo.config.caching_precompile = True
        logging.getLogger("torch._dynamo.guards").addFilter(_quiet_dropped_guards)

    def choose(self) -> None:
        """Copy usable kept artifacts into the private working directory, or say why not."""
        marker = _refused_marker(self.key)
        if self.entry.is_dir() and marker.is_file():
            self.reason = (
                f"{self.entry} not used: it failed on this machine before "
                f"({marker.read_text()[:300]}); delete {marker} to try it again"
            )
            log.warning("compiled artifacts: %s; compiling", self.reason)
            return
        if self.entry.is_dir():
            problem = verify(self.entry, self.key)
            if problem is None:
                # AOTInductor packages are read where they are (find), not copied.
                ignore = shutil.ignore_patterns("*.pt2")
                shutil.copytree(self.entry, self.staging, dirs_exist_ok=True, ignore=ignore)
                (self.staging / MANIFEST).unlink(missing_ok=True)
                self.loaded = True
                log.info("compiled artifacts: loading %s", self.entry)
                return
            self.reason = f"{self.entry} not used: {problem}"
            log.warning("compiled artifacts: %s; compiling", self.reason)
        else:
            self.reason, stale = self._why_none()
            level = logging.WARNING if stale else logging.INFO
            log.log(level, "compiled artifacts: %s; compiling (kept in %s)", self.reason, self.root)

    def _why_none(self) -> tuple[str, bool]:
        """No directory for this key: say how the newest other one differs, if any (and
        whether there was one: stale or foreign artifacts are worth a warning)."""
        others = []
        if self.root.is_dir():
            others = sorted(
                (
                    p
                    for p in self.root.iterdir()
                    if not p.name.startswith(".") and (p / MANIFEST).is_file()
                ),
                key=lambda p: (p / MANIFEST).stat().st_mtime,
            )
        if not others:
            return "none kept yet", False
        try:
            fields = json.loads((others[-1] / MANIFEST).read_text())["key"]
        except (OSError, ValueError, KeyError):
            return f"none for this key ({others[-1].name} has an unreadable manifest)", True
        differences = "; ".join(self.key.differences(fields))
        return f"none for this key; {others[-1].name} was made for {differences}", True

    # -- AOTInductor packages (models/aoti.py) -------------------------------------------
    def find(self, name: str) -> Path | None:
        """A package kept by an earlier start (read in place: the directory was verified)."""
        path = self.entry / "aoti" / f"{name}.pt2"
        return path if self.loaded and path.is_file() else None

    def target(self, name: str) -> Path:
        """Where this start writes a package it builds (published with the rest)."""
        return self.staging / "aoti" / f"{name}.pt2"

    def model_status(self, model: str, before: dict[str, int], packages: list[bool]) -> str:
        """ "loaded" if every function of the model just built found its Dynamo package
        and every AOTInductor graph its package (``packages``: loaded or not, one per
        graph) in the kept artifacts, else "compiled"; logged either way."""
        after = dynamo_cache_counts()
        hits, misses, errors = (
            after.get(f"dynamo_cache_{k}", 0) - before.get(f"dynamo_cache_{k}", 0)
            for k in ("hit", "miss", "error")
        )
        dynamo = not misses and not errors and bool(hits or packages)
        if self.loaded and dynamo and all(packages):
            log.info(
                "model %s: %d compiled functions and %d packages loaded from kept artifacts",
                model, hits, len(packages),
            )  # fmt: skip
            return "loaded"
        if self.loaded:
            log.warning(
                "model %s: kept artifacts incomplete (%d functions loaded, %d missing, %d "
                "failed to load; %d of %d packages loaded): COMPILE compiles the rest",
                model, hits, misses, errors, sum(packages), len(packages),
            )  # fmt: skip
        return "compiled"

    def publish(self, boot_id: str) -> str:
        """Keep what this start compiled for the next one; returns what happened."""
        torch._dynamo.config.caching_precompile = True  # per thread: this one's too
        torch.compiler.save_cache_artifacts()  # writes the Dynamo packages into staging
        if self.loaded:
            return f"loaded from {self.entry}: nothing to keep"
        if self.entry.exists() and verify(self.entry, self.key) is None:
            return f"{self.entry} was kept meanwhile (another replica): not replaced"
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        try:
            shutil.copytree(self.staging, tmp, ignore=_not_kept(self.staging))
            manifest = {
                "format": FORMAT,
                "key": self.key.fields,
                "files": manifest_files(tmp),
                "boot_id": boot_id,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if self.entry.exists():  # a bad copy of the same key: replace it
                shutil.rmtree(self.entry, ignore_errors=True)
            os.rename(tmp, self.entry)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if self.entry.exists() and verify(self.entry, self.key) is None:
                return f"{self.entry} was kept meanwhile (another replica): not replaced"
            return f"could not keep artifacts in {self.root}: {e}"
        return f"kept in {self.entry} ({len(manifest['files'])} files)"

    def discard(self, reason: str) -> Path | None:
        """Loaded artifacts failed (a torch error, not a miss): set the directory aside
        (renamed, kept for a post-mortem) so that the next start of this key compiles, and
        remember the refusal on this machine (the temp directory) for a read-only volume
        that cannot be renamed. Returns where the directory went, or None."""
        marker = _refused_marker(self.key)
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(reason)
        except OSError as e:
            log.error("compiled artifacts: could not write %s: %s", marker, e)
        aside = self.root / f".bad-{self.key.digest}-{int(time.time())}"
        try:
            os.rename(self.entry, aside)
        except OSError as e:
            log.error("compiled artifacts: could not set %s aside: %s", self.entry, e)
            return None
        return aside

    def close(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def for_config(config: ServiceConfig, model_dirs: dict[str, Path]) -> CompileArtifacts | None:
    """The kept artifacts a configuration uses, or None when nothing is kept."""
    if config.compilation_mode is CompilationMode.NONE or not config.compile_cache_dir:
        return None
    from inference_svc.models.cpu import choices  # the key names what runs, never "auto"

    auto = choices(config)
    aoti = auto.backend == "aoti"
    if config.freeze_weights and not aoti:
        log.info(
            "--freeze-weights on: compiled artifacts are not kept (torch 2.13 caches no "
            "frozen graph); this start compiles every graph"
        )
        return None
    shapes = {name: getattr(config, name) for name in SHAPE_SETTINGS}
    numerics = (
        f"device={config.device} dtype={config.dtype} lm_weights={auto.lm.scheme} "
        f"embed_dtype={auto.embed.scheme} logprobs={config.logprobs_mode.value} "
        f"attention={auto.attention} linear={auto.linear} kv_cache={config.kv_cache_dtype}"
    )
    mode = f"{config.compilation_mode.value} backend={auto.backend}"
    if aoti:
        mode += f" freeze={config.freeze_weights}"
    key = make_key(mode, numerics, shapes, model_dirs)
    from inference_svc.models.loading import pick_device

    cpu = pick_device(config.device).type == "cpu"
    return CompileArtifacts(Path(config.compile_cache_dir).expanduser(), key, cpu=cpu)


def _not_kept(staging: Path) -> Callable[[str, list[str]], set[str]]:
    """What publish leaves out: inductor's lock files, and the build directories that
    AOTInductor leaves in its cache (one per package, named by a long hash: the same
    weights and shared object the package under aoti/ holds, hundreds of MiB each)."""
    top = str(staging)

    def ignore(directory: str, names: list[str]) -> set[str]:
        out = {n for n in names if n == "locks"}
        if directory == top:
            out |= {n for n in names if len(n) >= 40 and (staging / n).is_dir()}
        return out

    return ignore


def _refused_marker(key: ArtifactKey) -> Path:
    return Path(tempfile.gettempdir()) / "inference-svc-refused-artifacts" / key.digest


def _quiet_dropped_guards(record: logging.LogRecord) -> bool:
    """Dynamo warns once per global-builtin guard it leaves out of a package (over a
    hundred lines per model): those guards check that builtins were not replaced."""
    return "is dropped with caching_precompile=True" not in record.getMessage()


def dynamo_cache_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["dynamo_cache"])
