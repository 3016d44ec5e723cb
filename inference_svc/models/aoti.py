"""AOTInductor packages: a model's graph exported once (``torch.export``), compiled ahead of
time into a ``.pt2`` package (with ``--freeze-weights on`` the weights are folded and
prepacked inside it; with max-autotune inductor may pick its C++ GEMM templates), kept
whole, and loaded by a later start with no Dynamo, no guards and no compile.

One package per graph family (Embed's forward, the LM's prefill chunk, the LM's decode
step), each exported with dynamic dimensions over the ranges its buckets span, so weights
are stored once per family, never once per bucket. A package called outside its exported
ranges is undefined behaviour: every call is checked first (``OutOfRange``, a bug of the
caller, never a request's fault). The KV cache comes in as inputs written in place, not as
module buffers (a buffer would become a constant private to each package).

A model that does not export falls back to torch.compile for that graph, with a log line
naming the reason; ``AotiGraph.backend`` says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from inference_api.plan import CompilationMode
from inference_svc.models.aoti_weights import UNFROZEN_OPTIONS, Constants, constants, strip_shared

log = logging.getLogger(__name__)

Args = tuple[Any, ...]


class OutOfRange(RuntimeError):
    """A call outside the ranges a package was exported for (the service never makes one:
    its buckets lie inside them)."""


class PackageStore(Protocol):
    """Where packages are found (kept by an earlier start) and written (this start's)."""

    def find(self, name: str) -> Path | None: ...

    def target(self, name: str) -> Path: ...


class ScratchPackages:
    """Packages of this process only (no --compile-cache-dir): a temp directory."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="inference-svc-aoti-"))

    def find(self, name: str) -> Path | None:
        return None

    def target(self, name: str) -> Path:
        return self.root / f"{name}.pt2"

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass(frozen=True)
class Family:
    """One graph family: where each dynamic dimension sits in a call's arguments."""

    graph: str  # "decode", "prefill", "embed"
    sizes: Callable[[Args], dict[str, int]]  # each dynamic dimension's size in a call
    # export's ``dynamic_shapes`` for a call's arguments, from one Dim per name
    dynamic_shapes: Callable[[dict[str, Any], Args], Any]


def inductor_options(
    mode: CompilationMode, freeze: bool, module: torch.nn.Module | None = None
) -> dict[str, Any]:
    """A package's inductor options. Its weights lie beside its library, to be lent by the
    model (models/aoti_weights.py), where they stay the model's own: unfrozen, or frozen in a
    ``module`` with nothing that freezing prepacks (``freezing_keeps_weights``)."""
    opts: dict[str, Any] = {"freezing": freeze}
    if not freeze or (module is not None and freezing_keeps_weights(module)):
        opts.update(UNFROZEN_OPTIONS)
    if mode is CompilationMode.MAX_AUTOTUNE:
        opts.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return opts


def freezing_keeps_weights(module: torch.nn.Module) -> bool:
    """Whether freezing leaves ``module``'s weights as they are: no float linear layer, whose
    weight inductor would prepack into oneDNN's opaque layout (a tensor with no storage,
    which a package can only keep inside its library). The int4 scheme on this project's
    kernel (``--linear-kernel native``) has none: its frozen packages then share the
    model's weights as unfrozen ones do (the packaged SmolLM2's two: 2 x 200 MiB less)."""
    from inference_svc.models.weights import BFloat16Linear

    return not any(isinstance(m, (torch.nn.Linear, BFloat16Linear)) for m in module.modules())


class AotiGraph:
    """A module's forward run from an AOTInductor package: loaded from the store when an
    earlier start kept it, else exported and compiled at its first call (warmup's), on the
    compute thread, counted by the compile monitor like any compile."""

    def __init__(
        self,
        module: torch.nn.Module,
        family: Family,
        name: str,
        options: dict[str, Any],
        store: PackageStore,
        monitor: Any,
        fallback: Callable[[], Callable[..., Any]],
    ) -> None:
        self.module = module
        self.family = family
        self.name = name  # the package's name: "<model>-<graph>"
        self.options = options
        self.store = store
        self.monitor = monitor
        self._make_fallback = fallback
        self.ranges: dict[str, tuple[int, int]] = {}  # set by the runtime from its buckets
        self.source = ""  # "loaded" (kept package), "built" (here), "fallback"
        self.backend = "aoti"
        self.check_eager = False  # COMPILE's proof: also run eager, keep the difference
        self.proof: dict[str, float] = {}  # the largest |package - eager| per shape seen
        self._run: Callable[..., Any] | None = None
        found = store.find(name)
        if found is not None:
            try:
                self._run = _load(found, module)
                self.source = "loaded"
                log.info("package %s: loaded from %s", name, found)
            except Exception as e:  # a broken package: built again at the first call
                log.warning("package %s: %s does not load (%r); building it again", name, found, e)

    @property
    def graph(self) -> str:
        return self.family.graph

    def check(self, args: Args) -> dict[str, int]:
        """The call's dynamic sizes; OutOfRange if one lies outside the exported ranges."""
        sizes = self.family.sizes(args)
        for dim, size in sizes.items():
            lo, hi = self.ranges[dim]
            if not lo <= size <= hi:
                raise OutOfRange(
                    f"package {self.name}: {dim} {size} outside its exported range [{lo}, {hi}]"
                )
        return sizes

    def __call__(self, *args: Any) -> Any:
        if not self.ranges:
            raise OutOfRange(f"package {self.name}: no ranges set (the runtime sets them)")
        sizes = self.check(args)
        if self._run is None:
            self._run = self._build(args)
        out = self._run(*args)
        if self.check_eager and self.source != "fallback" and self._smallest(sizes):
            ref = self.module(*args)
            label = "x".join(str(sizes[d]) for d in sorted(sizes))
            self.proof[label] = float((out.float() - ref.float()).abs().max())
        return out

    def _smallest(self, sizes: dict[str, int]) -> bool:
        """Whether a call is at the low end of every range but the cache's rows: the
        proof's eager check runs there (the same graph at the other end costs an eager
        forward at the largest bucket, up to a second per restart, and checks no more)."""
        return all(sizes[d] == self.ranges[d][0] for d in sizes if d != "rows")

    def _build(self, args: Args) -> Callable[..., Any]:
        """Export and compile the package (or fall back to torch.compile)."""
        self.monitor.record(f"aoti/{self.name}")
        start = time.perf_counter()
        dims = {  # a range of one size is static (export refuses a Dim with min == max)
            d: torch.export.Dim(d, min=lo, max=hi) if lo < hi else torch.export.Dim.STATIC
            for d, (lo, hi) in self.ranges.items()
        }
        shapes = self.family.dynamic_shapes(dims, args)
        try:
            with torch.inference_mode(False), torch.no_grad():
                program = torch.export.export(
                    self.module, _widened(args, shapes), dynamic_shapes=shapes, strict=False
                )
        except Exception as e:
            self.source = "fallback"
            self.backend = f"torch-compile ({self.graph} does not export: {_short(e)})"
            log.warning("package %s: torch.export failed (%s); falling back to torch.compile",
                        self.name, _short(e))  # fmt: skip
            return self._make_fallback()
        exported = time.perf_counter()
        path = self.store.target(self.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{uuid.uuid4().hex}-{path.name}")  # ends in .pt2, as torch asks

        def compile_into_part() -> None:
            with torch.no_grad():
                torch._inductor.aoti_compile_and_package(
                    program, package_path=str(part), inductor_configs=self.options
                )

        try:
            compile_into_part()
        except Exception as e:
            if not self.options.get("freezing") or not UNFROZEN_OPTIONS.keys() & self.options:
                raise
            # A frozen constant that cannot lie beside the library (an opaque prepacked
            # weight freezing_keeps_weights did not foresee): keep them all inside it.
            log.warning("package %s: frozen weights cannot be kept beside the library (%s); "
                        "building it with them inside", self.name, _short(e))  # fmt: skip
            self.options = {k: v for k, v in self.options.items() if k not in UNFROZEN_OPTIONS}
            compile_into_part()
        left = strip_shared(part, self.module)  # what the model lends is not stored twice
        part.rename(path)
        run = _load(path, self.module)
        self.source = "built"
        log.info(
            "package %s: exported in %.1f s, compiled in %.1f s (%.0f MiB, %.0f MiB of "
            "weights left to the model; %s)",
            self.name, exported - start, time.perf_counter() - exported,
            path.stat().st_size / 2**20, left / 2**20, _ranges_text(self.ranges),
        )  # fmt: skip
        return run

    def proof_text(self) -> str:
        if not self.proof:
            return ""
        worst = max(self.proof.values())
        shapes = sorted(self.proof)
        return f"{self.graph} max|diff| {worst:.2g} over {len(shapes)} shapes"


def _widened(args: Args, shapes: Any) -> Args:
    """The call's arguments as export's example, with every dynamic dimension of size 1
    doubled: export specialises a size-1 example to 1 (and refuses the range), so a first
    call of one row (a request before any warmup) would otherwise never export."""
    if isinstance(shapes, dict) and "args" in shapes:  # a forward(*args)
        shapes = shapes["args"]

    def widen(arg: Any, shape: Any) -> Any:
        if isinstance(arg, (list, tuple)) and isinstance(shape, (list, tuple)):
            return type(arg)(widen(a, s) for a, s in zip(arg, shape, strict=True))
        if isinstance(arg, torch.Tensor) and isinstance(shape, dict):
            for dim, spec in shape.items():
                if isinstance(spec, torch.export.Dim) and arg.shape[dim] == 1:
                    arg = torch.cat([arg, arg], dim)
        return arg

    return tuple(widen(a, s) for a, s in zip(args, shapes, strict=True))


_EXTRACT = threading.Lock()  # TMPDIR is process-wide: one load at a time


def _load(path: Path, module: torch.nn.Module) -> Package:
    """Load a package. torch's loader unpacks it (its shared library and weights: hundreds
    of MB) into ``$TMPDIR/aotinductor_*`` and removes that only when the loader is
    destroyed, which a process that is killed or simply exits never does: every start
    leaked a copy (11 GB in /tmp after a day of restarts here). So it unpacks into a
    directory of ours, removed as soon as the package has loaded: the library is mapped
    and the weights read, so the files are not needed again. A package built unfrozen
    gets the module's own tensors as its weights (models/aoti_weights.py)."""
    # A package built with max-autotune may run AMX tiles (inductor's C++ micro-GEMMs), which
    # Linux allows a process only after it asks (arch_prctl XTILEDATA): without this, its
    # first call dies of SIGILL when nothing else here used AMX yet. inductor asks in its
    # ISA check, which Package skips; returns False where the CPU has no AMX.
    torch.cpu._init_amx()
    native = _native_runs()
    scratch = Path(tempfile.mkdtemp(prefix="inference-svc-aoti-load-"))
    try:
        with _EXTRACT, _tmpdir(scratch):
            if native:
                loader = torch.classes.inference.Package(str(path), "model")
            else:
                loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        fqns = loader.constant_fqns() if native else loader.get_constant_fqns()
        weights = constants(path, fqns, module)
        if weights is not None:
            # user_managed: the package runs on these tensors, no copy (Package keeps them)
            if native:
                loader.load_constants(weights.tensors)
            else:
                loader.load_constants(weights.tensors, False, True, True)
            log.info("package %s: %s", path.stem, weights.text())
        return Package(loader, weights, native)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _native_runs() -> bool:
    """Whether packages run through this project's op (inference_svc/kernels/package.cpp),
    which releases the GIL for the forward pass, as torch's own binding does not: the
    service's other threads (health checks, streaming, detokenizing) then run during a step,
    not after it. Where the ops cannot be built, torch's binding runs them (logged)."""
    from inference_svc import kernels

    try:
        kernels.load()
    except Exception as e:  # no compiler for a first build, an unwritable directory
        log.warning("packages run holding the GIL (this project's ops did not load: %s)", e)
        return False
    return True


class Package:
    """A loaded package's forward: what ``torch._inductor.aoti_load_package`` returns, less
    two costs measured on a restart. Its loader checks the device first (only ever for a
    warning): that builds and dlopens a test library per vector ISA in ten subprocesses,
    1.3 s of a 7 s restart, for what the kept artifacts' key pins already (the CPU's
    capability and flags); and importing it imports inductor (0.8 s), which a restart from
    kept packages otherwise never needs. Its call also parsed the call spec at every call;
    here once."""

    def __init__(self, loader: Any, weights: Constants | None = None, native: bool = False) -> None:
        self.loader = loader  # torch's binding, or inference::Package (native: GIL released)
        self.weights = weights  # the tensors an unfrozen package runs on: alive as long as it
        _, out_spec = loader.call_spec() if native else loader.get_call_spec()
        self.out_spec = pytree.treespec_loads(out_spec)
        self._one = self.out_spec.is_leaf()  # one tensor out (every graph of ours)
        self._run = self._native if native else loader.boxed_run

    def _native(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return torch.ops.inference.run_package(self.loader, inputs)

    def __call__(self, *args: Any) -> Any:
        out = self._run(_tensors(args))
        return out[0] if self._one else pytree.tree_unflatten(out, self.out_spec)


def _tensors(args: Any) -> list[torch.Tensor]:
    """The tensors of ``args`` in pytree's order: a loop over tuples and lists (a graph's
    arguments and its KV-cache lists), pytree for anything else; pytree itself cost 23 us
    a decode step on the LM's 65 arguments, a sixth of what a step adds to its package."""
    flat: list[torch.Tensor] = []
    for x in args:
        if isinstance(x, torch.Tensor):
            flat.append(x)
        elif isinstance(x, list | tuple):
            flat.extend(_tensors(x))
        else:
            flat.extend(t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor))
    return flat


@contextlib.contextmanager
def _tmpdir(path: Path) -> Iterator[None]:
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _ranges_text(ranges: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{d} {lo}..{hi}" for d, (lo, hi) in sorted(ranges.items()))
