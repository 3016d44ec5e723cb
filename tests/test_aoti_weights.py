"""An AOTInductor package built with unfrozen weights runs on the eager model's own tensors:
loading it costs no second copy of the weights (resident anonymous memory measured), gives
eager's outputs, and takes from its own copy only what the model does not hold as recorded."""

from __future__ import annotations

import copy
import gc
import logging
from pathlib import Path

import pytest
import torch

from inference_api.plan import CompilationMode
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.models.aoti import AotiGraph, Family, inductor_options
from tests.test_aoti_graph import KeptDir

pytestmark = pytest.mark.unit

ROWS = Family("rows", lambda a: {"batch": a[0].shape[0]}, lambda d, a: ({0: d["batch"]},))


class Wide(torch.nn.Module):
    """32 MiB of float32 weights, and a constant of its code (export lifts it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(1024, 4096)
        self.down = torch.nn.Linear(4096, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = torch.tensor([0.5, -0.25] * 512)
        return self.down(torch.relu(self.up(x))) + shift


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.nbytes for p in module.parameters())


def anon_bytes() -> int:
    with open("/proc/self/status") as f:
        (line,) = [x for x in f if x.startswith("RssAnon:")]
    return int(line.split()[1]) * 1024


def loaded(module: torch.nn.Module, root: Path) -> tuple[AotiGraph, int]:
    """The package in ``root`` loaded for ``module``, and the anonymous memory it took."""
    gc.collect()
    before = anon_bytes()
    options = inductor_options(CompilationMode.DEFAULT, freeze=False)
    g = AotiGraph(module, ROWS, "wide", options, KeptDir(root), CompileMonitor(), lambda: module)
    g.ranges = {"batch": (2, 8)}
    assert g.source == "loaded"
    return g, anon_bytes() - before


def test_an_unfrozen_package_shares_the_models_weights(tmp_path: Path, caplog) -> None:
    module = Wide().eval()
    x = torch.randn(3, 1024)
    with torch.no_grad():
        expected = module(x)
        build = AotiGraph(
            module, ROWS, "wide", inductor_options(CompilationMode.DEFAULT, freeze=False),
            KeptDir(tmp_path), CompileMonitor(), lambda: module,
        )  # fmt: skip
        build.ranges = {"batch": (2, 8)}
        assert torch.allclose(build(x), expected, atol=1e-5)
        del build

        caplog.set_level(logging.INFO, logger="inference_svc.models.aoti")
        g, grew = loaded(module, tmp_path)
        assert torch.allclose(g(x), expected, atol=1e-5)
        assert grew < weight_bytes(module) // 4, (grew, weight_bytes(module))
        assert "weights shared with the eager model 32 MiB, from the package 0 MiB" in caplog.text

        # The control: a model whose weights are laid out otherwise (same values, other
        # strides) cannot lend them; the package's own copy is read, and it costs its size.
        other = copy.deepcopy(module)
        for p in other.parameters():
            if p.dim() == 2:
                p.data = p.data.t().contiguous().t()
        caplog.clear()
        g2, grew2 = loaded(other, tmp_path)
        assert torch.allclose(g2(x), expected, atol=1e-5)
        assert grew2 >= 0.9 * 32 * 2**20, grew2
        assert "weights shared with the eager model 0 MiB, from the package 32 MiB" in caplog.text
