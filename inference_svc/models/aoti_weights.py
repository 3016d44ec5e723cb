"""One copy of the weights for a model and all its AOTInductor packages.

A package keeps its weights inside its shared library by default, and the loader copies them
into memory of its own at load: the LM's prefill and decode packages then held two more
copies of the weights beside the eager model's (measured on the packaged SmolLM2 in float32:
1.77 GB of anonymous memory against 0.36 GB eager). A package built with unfrozen weights
(``--freeze-weights off``) keeps them as the model's own parameters, by name; such a package
is built with its weights outside the library (``UNFROZEN_OPTIONS``) and loaded with the
eager model's tensors, handed over without a copy (``user_managed``): the packages and the
eager model share one copy. Frozen float linear weights are folded and prepacked
(oneDNN's opaque layout) and differ from the parameters, so such a frozen package keeps its
own copy; a frozen package whose weights freezing leaves as they are (int4 layers on this
project's kernel: aoti.freezing_keeps_weights) is built and shared as an unfrozen one.

What the model does not hold under a constant's name, shape and strides (a constant that
export lifted from the code, a parameter that a tensor subclass stores as parts) comes from
the package's own copy, read from its archive.

The package need not store what the model lends it: once built, its archive is rewritten
without every weight file the model holds (same name, dtype, shape, strides and values;
``strip_shared``), which cut each of the packaged LM's two packages from 518 MiB to a few,
and with them what a restart hashes and unpacks. What was left out is listed in the
archive (``shared_weights.json``); a model that cannot lend one of those makes the load
fail (``WeightsMismatch``), and the package is built again.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

# Inductor options of a package with unfrozen weights: the weights beside the library, one
# pickled tensor per storage, named in weights_config.json (torch 2.13's "pickle_weights").
UNFROZEN_OPTIONS = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}
_CONFIG = "data/aotinductor/model/weights_config.json"
_WEIGHTS = "data/weights/"
# Ours: the constants whose weight files were left out, name -> [dtype, shape, strides]
_SHARED = "data/shared_weights.json"


class WeightsMismatch(RuntimeError):
    """The package left a constant to the model, and the model does not hold it as it did."""


@dataclass
class Constants:
    """A package's constants by name, and how many bytes came from the model itself."""

    tensors: dict[str, torch.Tensor]  # kept alive as long as the package: it holds pointers
    shared_bytes: int
    own_bytes: int

    def text(self) -> str:
        mib = 2**20
        return (
            f"weights shared with the eager model {self.shared_bytes / mib:.0f} MiB, "
            f"from the package {self.own_bytes / mib:.0f} MiB"
        )


def _record(z: zipfile.ZipFile) -> tuple[str, dict[str, list]] | None:
    """The archive's root folder and its weight record (name -> [file, shape, strides,
    offset]); None when the package keeps its weights inside its library (built frozen)."""
    configs = [n for n in z.namelist() if n.endswith(_CONFIG)]
    if not configs:
        return None
    (config,) = configs  # ValueError for an archive of several models: not one of ours
    return config[: -len(_CONFIG)], json.loads(z.read(config))


def _stored(z: zipfile.ZipFile, root: str, file: str) -> torch.Tensor:
    """One of the package's own weight files."""
    return torch.load(io.BytesIO(z.read(f"{root}{_WEIGHTS}{file}")), weights_only=True)


def _own(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}


def _lends(tensor: torch.Tensor | None, shape: list[int], stride: list[int]) -> bool:
    """Whether the model's tensor can stand in for a record of this shape and strides."""
    return (
        tensor is not None
        and type(tensor) is torch.Tensor
        and list(tensor.shape) == shape
        and list(tensor.stride()) == stride
    )


def _described(t: torch.Tensor) -> str:
    return f"{type(t).__name__} {t.dtype} {list(t.shape)}, strides {list(t.stride())}"


def constants(path: Path, names: list[str], module: torch.nn.Module) -> Constants | None:
    """The tensors for a package's constants: the module's own where its name, shape and
    strides match the package's record, else the package's copy; None for a package that
    keeps its weights inside its library (built frozen). WeightsMismatch when the package
    left a constant to the model and the model does not hold it so."""
    with zipfile.ZipFile(path) as z:
        record = _record(z)
        if record is None:
            return None
        root, records = record
        shared_names = root + _SHARED
        left: dict[str, list] = {}
        if shared_names in z.namelist():
            left = json.loads(z.read(shared_names))
        mine = _own(module)
        stored: dict[str, torch.Tensor] = {}
        out, shared, own = {}, 0, 0
        for name in names:
            file, shape, stride, offset = records[name]
            tensor = mine.get(name)
            lends = _lends(tensor, shape, stride)
            if name in left and not (lends and str(tensor.dtype) == left[name][0]):
                held = "nothing" if tensor is None else _described(tensor)
                raise WeightsMismatch(
                    f"{name}: left to the model at build ({left[name][0]} {shape}, strides "
                    f"{stride}); the model holds {held}"
                )
            if lends:
                out[name] = tensor
                shared += tensor.nbytes
                continue
            if file not in stored:
                stored[file] = _stored(z, root, file)
            out[name] = stored[file].as_strided(shape, stride, offset)
            own += out[name].nbytes
    return Constants(out, shared, own)


def strip_shared(path: Path, module: torch.nn.Module) -> int:
    """Rewrite the package at ``path`` without the weight files the module holds exactly
    (every constant stored in the file: same name, dtype, shape, strides and values), and
    list what was left out. Returns the bytes removed; 0 for a package that keeps its
    weights inside its library (built frozen with prepacked ones)."""
    with zipfile.ZipFile(path) as z:
        record = _record(z)
        if record is None:
            return 0
        root, records = record
        mine = _own(module)
        by_file: dict[str, list[str]] = defaultdict(list)
        for name, record in records.items():
            by_file[record[0]].append(name)
        left: dict[str, list] = {}
        drop: set[str] = set()
        for file, names in by_file.items():
            if not all(_lends(mine.get(n), *records[n][1:3]) for n in names):
                continue
            data = _stored(z, root, file)
            views = {n: data.as_strided(*records[n][1:4]) for n in names}
            if all(mine[n].dtype == v.dtype and torch.equal(mine[n], v) for n, v in views.items()):
                drop.add(f"{root}{_WEIGHTS}{file}")
                left.update({n: [str(v.dtype), *records[n][1:3]] for n, v in views.items()})
        if not drop:
            return 0
        part = path.with_name(f".strip-{path.name}")
        with zipfile.ZipFile(part, "w") as out:
            for info in z.infolist():
                if info.filename not in drop:
                    out.writestr(info, z.read(info))
            out.writestr(root + _SHARED, json.dumps(left))
    before = path.stat().st_size
    os.replace(part, path)
    return before - path.stat().st_size
