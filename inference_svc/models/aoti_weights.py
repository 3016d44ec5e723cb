"""One copy of the weights for a model and all its AOTInductor packages.

A package keeps its weights inside its shared library by default, and the loader copies them
into memory of its own at load: the LM's prefill and decode packages then held two more
copies of the weights beside the eager model's (measured on the packaged SmolLM2 in float32:
1.77 GB of anonymous memory against 0.36 GB eager). A package built with unfrozen weights
(``--freeze-weights off``) keeps them as the model's own parameters, by name; such a package
is built with its weights outside the library (``UNFROZEN_OPTIONS``) and loaded with the
eager model's tensors, handed over without a copy (``user_managed``): the packages and the
eager model share one copy. Frozen weights are folded and prepacked (oneDNN's opaque
layout) and differ from the parameters, so a frozen package keeps its own copy.

What the model does not hold under a constant's name, shape and strides (a constant that
export lifted from the code, a parameter that a tensor subclass stores as parts) comes from
the package's own copy, read from its archive.
"""

from __future__ import annotations

import io
import json
import zipfile
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


def constants(path: Path, names: list[str], module: torch.nn.Module) -> Constants | None:
    """The tensors for a package's constants: the module's own where its name, shape and
    strides match the package's record, else the package's copy; None for a package that
    keeps its weights inside its library (built frozen)."""
    with zipfile.ZipFile(path) as z:
        configs = [n for n in z.namelist() if n.endswith(_CONFIG)]
        if not configs:
            return None
        (config,) = configs
        records: dict[str, list] = json.loads(z.read(config))
        mine = {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}
        root = config[: -len(_CONFIG)]
        stored: dict[str, torch.Tensor] = {}
        out, shared, own = {}, 0, 0
        for name in names:
            file, shape, stride, offset = records[name]
            tensor = mine.get(name)
            if (
                tensor is not None
                and type(tensor) is torch.Tensor
                and list(tensor.shape) == shape
                and list(tensor.stride()) == stride
            ):
                out[name] = tensor
                shared += tensor.nbytes
                continue
            if file not in stored:
                data = io.BytesIO(z.read(f"{root}{_WEIGHTS}{file}"))
                stored[file] = torch.load(data, weights_only=True)
            out[name] = stored[file].as_strided(shape, stride, offset)
            own += out[name].nbytes
    return Constants(out, shared, own)
