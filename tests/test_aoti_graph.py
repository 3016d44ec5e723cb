"""AotiGraph on small modules: range checks before any call, the build counted as a compile
(late after SERVING), a round trip through a kept package, and the fallback to
torch.compile for a module that does not export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference_api.plan import CompilationMode, Phase
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.engine.buckets import EmbedBuckets, GenBuckets
from inference_svc.limits import GenLimits
from inference_svc.models.aoti import AotiGraph, Family, OutOfRange, ScratchPackages

pytestmark = pytest.mark.unit

ROWS = Family(
    "rows",
    lambda a: {"batch": a[0].shape[0]},
    lambda d, a: ({0: d["batch"]},),
)


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)) * 2


class Branchy(Scale):
    """Control flow on a tensor's value: torch.export cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) if float(x.sum()) > 0 else -self.proj(x)


class KeptDir:
    """A store that keeps packages in a directory and finds them there (as a kept
    artifacts directory does for a later start)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find(self, name: str) -> Path | None:
        path = self.root / f"{name}.pt2"
        return path if path.is_file() else None

    def target(self, name: str) -> Path:
        return self.root / f"{name}.pt2"


def graph(module: torch.nn.Module, store, monitor: CompileMonitor, lo: int = 2) -> AotiGraph:
    g = AotiGraph(module, ROWS, "m-rows", {"freezing": True}, store, monitor, lambda: module)
    g.ranges = {"batch": (lo, 16)}
    return g


def test_a_call_outside_the_exported_ranges_is_refused_before_anything_runs() -> None:
    store = ScratchPackages()
    g = graph(Scale().eval(), store, CompileMonitor())
    for batch in (1, 17):
        with pytest.raises(OutOfRange, match=f"batch {batch} outside .*\\[2, 16\\]"):
            g(torch.ones(batch, 8))
    assert g.source == "" and not list(store.root.iterdir())  # nothing built, nothing run
    store.close()


def test_a_package_is_built_once_counted_and_loaded_whole_by_the_next_start(tmp_path) -> None:
    monitor = CompileMonitor()
    module = Scale().eval()
    x = torch.randn(1, 8)  # a first call of one row still exports the whole range
    with torch.no_grad():
        expected = module(x)
        first = graph(module, KeptDir(tmp_path), monitor, lo=1)
        monitor.mark_serving()  # a build after SERVING is a late compile
        assert torch.allclose(first(x), expected, atol=1e-5)
        assert first.source == "built" and monitor.total == 1 and monitor.late == 1
        assert first(torch.randn(16, 8)).shape == (16, 8)  # one package, any batch in range

        again = CompileMonitor()
        kept = graph(module, KeptDir(tmp_path), again, lo=1)
        assert kept.source == "loaded"
        for batch in (1, 16):  # both ends of the range
            y = torch.randn(batch, 8)
            assert torch.allclose(kept(y), module(y), atol=1e-5)
        assert again.total == 0


def test_loading_a_package_asks_for_amx_first(tmp_path, monkeypatch) -> None:
    """A max-autotune package may run AMX tiles, which Linux allows only after the process
    asks: the service asks before loading (without it, a bfloat16 package's first call died
    of SIGILL in a service with no other AMX user)."""
    module = Scale().eval()
    with torch.no_grad():
        graph(module, KeptDir(tmp_path), CompileMonitor(), lo=1)(torch.randn(2, 8))
    asked: list[str] = []
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append("amx") or False)
    assert graph(module, KeptDir(tmp_path), CompileMonitor(), lo=1).source == "loaded"
    assert asked == ["amx"]


def test_a_loaded_package_leaves_no_unpacked_copy_behind(tmp_path, monkeypatch) -> None:
    """torch unpacks a package into $TMPDIR and cleans up only in the loader's destructor,
    which a killed or exiting process never runs: the service removes the copy at once."""
    module = Scale().eval()
    kept = tmp_path / "kept"
    with torch.no_grad():
        graph(module, KeptDir(kept), CompileMonitor(), lo=1)(torch.randn(2, 8))
        tmp = tmp_path / "tmp"
        tmp.mkdir()
        monkeypatch.setenv("TMPDIR", str(tmp))
        monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
        loaded = graph(module, KeptDir(kept), CompileMonitor(), lo=1)
        assert loaded.source == "loaded"
        assert list(tmp.iterdir()) == []  # nothing unpacked is left, while it is loaded
        y = torch.randn(5, 8)
        assert torch.allclose(loaded(y), module(y), atol=1e-5)  # and it still runs


def test_a_module_that_does_not_export_falls_back_and_says_why() -> None:
    store = ScratchPackages()
    module = Branchy().eval()
    g = graph(module, store, CompileMonitor())
    x = torch.ones(3, 8)
    with torch.no_grad():
        assert torch.equal(g(x), module(x))
    assert g.source == "fallback"
    assert g.backend.startswith("torch-compile (rows does not export:"), g.backend
    store.close()


@pytest.mark.parametrize("max_batch,chunk,inputs,new", [(16, 64, 512, 512), (2, 8, 20, 5)])
def test_every_bucket_lies_inside_the_ranges_packages_are_exported_for(
    max_batch: int, chunk: int, inputs: int, new: int
) -> None:
    gen = GenBuckets.plan(GenLimits(max_batch, inputs, new, chunk), CompilationMode.DEFAULT, True)
    assert gen.batch[0] == 1  # a package takes one row as it is: no padding to two
    assert gen.sampler_batch(1) == 1 == gen.sampler_batches[0]  # the sampler runs eagerly
    r = gen.ranges()
    for b in gen.all():
        assert r["context"][0] <= b.context_len <= r["context"][1]
        if b.phase is Phase.PREFILL:
            assert r["chunk"][0] <= b.seq_len <= r["chunk"][1]
        else:
            assert r["batch"][0] <= b.batch_size <= r["batch"][1]
    embed = EmbedBuckets.plan(max_batch, inputs, CompilationMode.DEFAULT, aoti=True)
    er = embed.ranges()
    for b in embed.all():
        assert er["batch"][0] <= b.batch_size <= er["batch"][1]
        assert er["length"][0] <= b.seq_len <= er["length"][1]
