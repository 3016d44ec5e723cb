"""A frozen AOTInductor package whose weights freezing leaves as they are (int4 layers on this
project's kernel) keeps them beside its library and runs on the model's own tensors, as an
unfrozen one does; one with float linear layers (prepacked by freezing) keeps them inside,
and a build that meets an opaque weight anyway is built again so, not failed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from inference_api.plan import CompilationMode
from inference_svc import kernels
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.models.aoti import AotiGraph, freezing_keeps_weights, inductor_options
from inference_svc.models.aoti_weights import UNFROZEN_OPTIONS
from inference_svc.models.weights import QuantLinear
from tests.test_aoti_graph import ROWS, KeptDir
from tests.test_aoti_weights import Wide

pytestmark = pytest.mark.unit


class Quant(torch.nn.Module):
    """Two int4 layers on inference::quant_linear (5 MiB of weights and scales)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = QuantLinear(torch.nn.Linear(1024, 4096, bias=False), 4)
        self.down = QuantLinear(torch.nn.Linear(4096, 1024, bias=False), 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def graph(module: torch.nn.Module, root: Path, options: dict) -> AotiGraph:
    g = AotiGraph(module, ROWS, "m", options, KeptDir(root), CompileMonitor(), lambda: module)
    g.ranges = {"batch": (2, 8)}
    return g


def test_which_modules_freezing_leaves_alone() -> None:
    kernels.load()
    assert freezing_keeps_weights(Quant()) and not freezing_keeps_weights(Wide())
    frozen = inductor_options(CompilationMode.DEFAULT, True, Quant())
    assert frozen["freezing"] and frozen["aot_inductor.package_constants_in_so"] is False
    prepacked = inductor_options(CompilationMode.DEFAULT, True, Wide())
    assert prepacked["freezing"] and "aot_inductor.package_constants_in_so" not in prepacked


def test_a_frozen_int4_package_runs_on_the_models_weights(tmp_path: Path, caplog) -> None:
    kernels.load()
    caplog.set_level(logging.INFO, logger="inference_svc.models.aoti")
    module = Quant().eval()
    stored = sum(t.nbytes for t in module.buffers())
    options = inductor_options(CompilationMode.DEFAULT, True, module)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        built = graph(module, tmp_path, options)
        assert torch.allclose(built(x), module(x), atol=1e-4)
    assert built.source == "built"
    assert (tmp_path / "m.pt2").stat().st_size < stored // 2, "the weights were stored"
    with torch.inference_mode():
        again = graph(module, tmp_path, options)  # a restart: the kept package
        assert again.source == "loaded"
        assert torch.allclose(again(x), module(x), atol=1e-4)
    mib = stored / 2**20
    assert f"weights shared with the eager model {mib:.0f} MiB, from the package 0 MiB" in (
        caplog.text
    ), caplog.text


def test_an_opaque_frozen_weight_is_kept_inside_the_library(tmp_path: Path, caplog) -> None:
    # Float linear layers frozen are prepacked into oneDNN's opaque layout, which cannot lie
    # beside the library: asked to anyway, the build says so and keeps them inside.
    caplog.set_level(logging.INFO, logger="inference_svc.models.aoti")
    module = Wide().eval()
    forced = {"freezing": True, **UNFROZEN_OPTIONS}
    x = torch.randn(3, 1024)
    with torch.inference_mode():
        g = graph(module, tmp_path, forced)
        assert torch.allclose(g(x), module(x), atol=1e-4)
    assert g.source == "built"
    if "frozen weights cannot be kept beside the library" not in caplog.text:
        pytest.skip("this torch kept every frozen weight of a float linear as a tensor")
    assert not UNFROZEN_OPTIONS.keys() & g.options
