"""The KV cache in transparent huge pages (inference_svc/models/hugepages.py): zeroed tensors
of their own, in huge pages where the kernel gives them, torch.zeros where it does not; and a
model decodes the same tokens on either."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch

from inference_api.plan import Bucket, CompilationMode, Phase
from inference_svc.compile_monitor import CompileMonitor, Origin
from inference_svc.limits import GenLimits
from inference_svc.models import hugepages
from inference_svc.models.compile import ModelContext

pytestmark = pytest.mark.unit

THP_ON = hugepages.thp_setting() in ("always", "madvise")


def anon_huge_kib() -> int:
    with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_tensors_are_zeroed_and_each_its_own() -> None:
    shape = (4, 3, 300, 64)  # 0.9 MiB each, 3.7 MiB in all: past one huge page
    ts, how = hugepages.zeros(4, shape, torch.float32)
    assert [tuple(t.shape) for t in ts] == [shape] * 4
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in ts)
    assert all(float(t.abs().sum()) == 0.0 for t in ts)
    storages = {t.untyped_storage().data_ptr() for t in ts}
    assert len(storages) == 4, "one storage each: a compiled graph must not see aliased inputs"
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in ts)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), "overlap"
    ts[1].fill_(3.0)
    assert [float(t.sum()) for t in ts] == [0.0, 3.0 * ts[1].numel(), 0.0, 0.0]
    assert ("huge pages" in how) == THP_ON, how


@pytest.mark.skipif(not THP_ON, reason=f"transparent huge pages {hugepages.thp_setting()}")
def test_a_large_cache_lies_in_huge_pages() -> None:
    before = anon_huge_kib()
    ts, how = hugepages.zeros(2, (8, 2**18), torch.float32)  # 2 x 8 MiB
    assert how.startswith("huge pages"), how
    # The kernel may fall back to small pages where memory is too fragmented for one: ask
    # for one huge page of the eight each tensor spans.
    assert anon_huge_kib() - before >= 2048, "no huge page backs the cache"
    del ts


def test_without_thp_torch_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "thp_setting", lambda: "never")
    ts, how = hugepages.zeros(3, (1024, 1024), torch.float32)
    assert how == "4 KiB pages (THP never)"
    assert len(ts) == 3 and all(float(t.abs().sum()) == 0.0 for t in ts)


def test_a_model_decodes_the_same_on_either_cache(
    tiny_lm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mapped cache under the model's in-place writes and the native decode attention:
    the same logits, step after step, as torch.zeros' cache."""
    from inference_svc.models.generative import load_generative

    ctx = ModelContext("lm", CompilationMode.NONE, CompileMonitor(), torch.device("cpu"),
                       torch.float32)  # fmt: skip
    model = load_generative(ctx, tiny_lm_dir, GenLimits(2, 16, 16, 8), attention="native")
    ids = torch.tensor([[5], [9]])

    def run() -> list[torch.Tensor]:
        model.allocate_cache(2)
        out = []
        with torch.inference_mode():
            for step in range(6):
                pos = torch.tensor([[step], [step + 2]])
                out.append(model.decode(ids + step, pos, Bucket(Phase.DECODE, 2, 1, 16),
                                        Origin.WARMUP))  # fmt: skip
        return out

    mapped = run()
    assert model.cache_pages.startswith("huge pages") == THP_ON, model.cache_pages
    assert model.k_cache is not None and model.k_cache[0]._base is None  # no view of another
    monkeypatch.setattr(hugepages, "thp_setting", lambda: "never")
    plain = run()
    assert model.cache_pages.startswith("4 KiB pages"), model.cache_pages
    for a, b in zip(mapped, plain, strict=True):
        assert torch.equal(a, b)
