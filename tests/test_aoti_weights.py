"""An AOTInductor package built with unfrozen weights runs on the eager model's own tensors:
loading it costs no second copy of the weights (resident anonymous memory measured), gives
eager's outputs, and takes from its own copy only what the model does not hold as recorded."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_api.plan import CompilationMode
from inference_svc import kernels
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.models import aoti
from inference_svc.models.aoti import AotiGraph, inductor_options
from tests.test_aoti_graph import ROWS, KeptDir

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


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


def relaid(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its matrices laid out otherwise: the same values, other strides."""
    for p in module.parameters():
        if p.dim() == 2:
            p.data = p.data.t().contiguous().t()
    return module


def wide_graph(module: torch.nn.Module, root: Path) -> AotiGraph:
    """``module``'s unfrozen package, found in or built into ``root``."""
    options = inductor_options(CompilationMode.DEFAULT, freeze=False)
    g = AotiGraph(module, ROWS, "wide", options, KeptDir(root), CompileMonitor(), lambda: module)
    g.ranges = {"batch": (2, 8)}
    return g


def anon_bytes() -> int:
    with open("/proc/self/status") as f:
        (line,) = [x for x in f if x.startswith("RssAnon:")]
    return int(line.split()[1]) * 1024


def measure_load(root: str, relayout: bool) -> None:
    """Run in a fresh process: load the package in ``root`` for the model (its weights
    laid out otherwise when ``relayout``), print what the load cost in anonymous memory,
    whether it gave eager's output, and its log lines, as JSON."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("inference_svc.models.aoti")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    module = Wide().eval()
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(1))
    kernels.load()  # the ops packages run through: not what is measured (built if none kept)
    with torch.no_grad():
        expected = module(x)
        if relayout:
            relaid(module)
        gc.collect()
        before = anon_bytes()
        g = wide_graph(module, Path(root))
        grew = anon_bytes() - before
        same = torch.allclose(g(x), expected, atol=1e-5)
    print(json.dumps({"source": g.source, "grew": grew, "same": same, "log": records}))


def loaded(root: Path, relayout: bool) -> dict:
    """What loading the package in ``root`` costs in a fresh process. Measured there, not
    here: in a test worker freed memory stays resident and malloc hands it back, so a
    copy can land in pages RssAnon already counted (it measured 8 KiB for a 32 MiB copy
    once in CI). A fixed mmap threshold makes each large allocation its own mapping."""
    call = f"measure_load({str(root)!r}, {relayout})"
    code = f"from tests.test_aoti_weights import measure_load; {call}"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def build(module: torch.nn.Module, root: Path) -> None:
    x = torch.randn(3, 1024)
    with torch.no_grad():
        g = wide_graph(module, root)
        assert torch.allclose(g(x), module(x), atol=1e-5)
        assert g.source == "built"


def test_an_unfrozen_package_shares_the_models_weights(tmp_path: Path, caplog) -> None:
    module = Wide().eval()
    caplog.set_level(logging.INFO, logger="inference_svc.models.aoti")
    build(module, tmp_path)
    # Not stored twice: the package on disk holds its code and the constant export lifted.
    size = (tmp_path / "wide.pt2").stat().st_size
    assert size < weight_bytes(module) // 4, (size, weight_bytes(module))
    assert "32 MiB of weights left to the model" in caplog.text

    shared = loaded(tmp_path, relayout=False)
    assert shared["source"] == "loaded" and shared["same"], shared
    assert shared["grew"] < weight_bytes(module) // 4, (shared["grew"], weight_bytes(module))
    assert any("weights shared with the eager model 32 MiB, from the package 0 MiB" in m
               for m in shared["log"]), shared["log"]  # fmt: skip

    # A model whose weights are laid out otherwise (same values, other strides) cannot lend
    # them, and the package has no copy: it does not load, saying which constant, and is
    # built again (a start never sees this: the kept artifacts' key has the weights and code).
    refused = wide_graph(relaid(Wide().eval()), tmp_path)
    assert refused.source == "" and refused._run is None
    assert re.search(
        r"does not load \(WeightsMismatch\('(up|down)\.weight: left to the model at build "
        r"\(torch\.float32 \[\d+, \d+\], strides \[\d+, 1\]\); the model holds Tensor "
        r"torch\.float32 \[\d+, \d+\], strides \[1, \d+\]'\)\); building it again",
        caplog.text,
    ), caplog.text


def test_the_memory_measure_sees_a_copy(tmp_path: Path, monkeypatch) -> None:
    """The control for the measure above: a package that keeps its weights (not stripped),
    loaded for a model that cannot lend them (other strides), reads its own copy, and the
    load costs that copy's size."""
    monkeypatch.setattr(aoti, "strip_shared", lambda path, module: 0)
    build(Wide().eval(), tmp_path)
    copied = loaded(tmp_path, relayout=True)
    assert copied["source"] == "loaded" and copied["same"], copied
    assert copied["grew"] >= 0.9 * 32 * 2**20, copied["grew"]
    assert any("weights shared with the eager model 0 MiB, from the package 32 MiB" in m
               for m in copied["log"]), copied["log"]  # fmt: skip
