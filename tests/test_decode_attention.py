"""This project's decode attention kernel (inference_svc/kernels, --decode-attention native):
torch's SDPA's results for every layout the service gives it (float32 and bfloat16, a
float16 cache under either, head sizes on and off the vector path and the fused heads' path,
one to many query heads per KV head, rows of different lengths, one long row split over
threads, sliding windows); an op torch.export keeps whole and an AOTInductor package calls;
what auto picks; a library kept and loaded, not rebuilt.
(Model-level parity with transformers on both attentions: tests/test_families.py.)"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from inference_svc import kernels
from inference_svc.models.cpu import choose_decode_attention

pytestmark = pytest.mark.rpc


@pytest.fixture(scope="module", autouse=True)
def op() -> None:
    kernels.load()


def sdpa(q, k, v, pos, window: int, scale: float) -> torch.Tensor:
    """What the decode step computes without the kernel (LlamaLM.decode's masks)."""
    slots = torch.arange(k.shape[2])
    mask = slots[None] <= pos[:, None]
    if window:
        mask &= slots[None] > pos[:, None] - window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None], scale=scale)


CASES = {  # name: (rows, kv heads, query heads per kv head, head size, slots, window)
    "one-row-long": (1, 1, 3, 64, 700, 0),  # one task alone: split in chunks over threads
    "rows-of-lengths": (5, 3, 3, 64, 96, 0),
    "window": (4, 2, 2, 64, 80, 17),
    "head-128-mha": (2, 4, 1, 128, 50, 0),
    "head-24-generic": (3, 2, 2, 24, 40, 0),
    "head-24-window": (3, 2, 2, 24, 40, 8),
    "one-slot": (2, 1, 4, 64, 1, 0),
    "one-head-a-kv-head": (3, 4, 1, 64, 45, 0),
}
DTYPES = {  # query, cache
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float32-f16-cache": (torch.float32, torch.float16),
    "bfloat16-f16-cache": (torch.bfloat16, torch.float16),
}


@pytest.mark.parametrize("dtypes", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernel_gives_sdpas_attention(case: str, dtypes: str) -> None:
    b, kv, g, d, slots, window = CASES[case]
    dtype, cache = DTYPES[dtypes]
    gen = torch.Generator().manual_seed(0)
    # views of a larger cache, as the decode step passes them (strided, one spare row/slot)
    k = torch.randn(b + 1, kv, slots + 1, d, generator=gen).to(cache)
    v = torch.randn(b + 1, kv, slots + 1, d, generator=gen).to(cache)
    q = torch.randn(b, kv, g, d, generator=gen).to(dtype)
    pos = torch.randint(0, slots, (b,), generator=gen)
    pos[0] = slots - 1
    k, v = k[:b, :, :slots], v[:b, :, :slots]
    scale = d**-0.5
    got = torch.ops.inference.decode_attention(q, k, v, pos, window, scale)
    want = sdpa(q.float(), k.float(), v.float(), pos, window, scale)
    assert got.dtype == dtype and got.shape == q.shape
    atol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 output rounding
    assert (got.float() - want).abs().max() <= atol


def test_bad_input_is_refused_by_name() -> None:
    q = torch.randn(1, 2, 2, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.inference.decode_attention(
            q.half(), k.half(), k.half(), torch.tensor([3]), 0, 0.25
        )
    with pytest.raises(RuntimeError, match="in q's dtype or float16, not BFloat16"):
        b16 = k.bfloat16()
        torch.ops.inference.decode_attention(q, b16, b16, torch.tensor([3]), 0, 0.25)
    with pytest.raises(RuntimeError, match="one position per row"):
        torch.ops.inference.decode_attention(q, k, k, torch.tensor([3, 4]), 0, 0.25)
    with pytest.raises(RuntimeError, match="last dimension contiguous"):
        t = k.transpose(2, 3)
        torch.ops.inference.decode_attention(q[..., :8], t, t, torch.tensor([3]), 0, 0.25)


class _Step(torch.nn.Module):
    def forward(self, q, pos, slots, k, v):
        b, n = q.shape[0], slots.shape[0]
        return torch.ops.inference.decode_attention(q, k[:b, :, :n], v[:b, :, :n], pos, 0, 0.5)


def test_export_keeps_the_op_and_an_aoti_package_calls_it(tmp_path) -> None:
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(9, 2, 65, 16, generator=gen) for _ in range(2))
    args = (torch.randn(3, 2, 2, 16, generator=gen), torch.tensor([5, 63, 0]), torch.arange(64))
    batch, context = torch.export.Dim("batch", max=8), torch.export.Dim("context", max=64)
    dynamic = ({0: batch}, {0: batch}, {0: context}, None, None)
    ep = torch.export.export(_Step(), (*args, k, v), dynamic_shapes=dynamic)
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.inference.decode_attention.default in ops
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "s.pt2"))
    run = torch._inductor.aoti_load_package(package)
    for b, n in ((3, 64), (1, 10)):  # two points of the dynamic ranges
        call = (args[0][:b], args[1][:b].clamp(max=n - 1), torch.arange(n), k, v)
        assert torch.allclose(run(*call), _Step()(*call), atol=1e-6)


def test_auto_is_native_on_a_cpu_with_a_compiler_and_sdpa_elsewhere() -> None:
    assert kernels.available()  # this suite builds the kernel: a compiler is here
    cpu = torch.device("cpu")
    assert choose_decode_attention("auto", cpu) == "native"
    assert choose_decode_attention("auto", torch.device("cuda")) == "sdpa"
    assert choose_decode_attention("sdpa", cpu) == "sdpa"


def test_auto_falls_back_to_sdpa_when_the_kernel_does_not_build(monkeypatch, caplog) -> None:
    """The service still starts (on torch's kernel) where the build fails; named, it fails."""

    def broken(directory=None):
        raise RuntimeError("c++: internal compiler error")

    monkeypatch.setattr(kernels, "load", broken)
    cpu = torch.device("cpu")
    caplog.set_level(logging.INFO, logger="inference_svc.models.cpu")
    assert choose_decode_attention("auto", cpu) == "sdpa"
    assert "--decode-attention auto: sdpa (the native kernel did not build)" in caplog.text
    assert choose_decode_attention("native", cpu) == "native"  # load_generative says why


# A fresh process (a restart) that loads the library from argv[1] and runs the op; it exits
# with "rebuilt" if it would have to build the library.
LOAD_WITHOUT_BUILDING = (
    "import sys, torch; from pathlib import Path; from inference_svc import kernels\n"
    "kernels._build = lambda *a: sys.exit('rebuilt')\n"
    "p = kernels.load(Path(sys.argv[1]))\n"
    "q = torch.ones(1, 1, 1, 8); k = torch.ones(1, 1, 4, 8)\n"
    "print(p.name, torch.ops.inference.decode_attention(q, k, k, torch.tensor([2]), 0, 1.0)"
    ".sum().item())\n"
)


def test_a_kept_library_is_loaded_not_rebuilt(tmp_path) -> None:
    """A fresh process (a restart) pointed at a directory that holds the library loads that
    file as it is, and the op runs there."""
    target = kernels.load(tmp_path)  # registered already here: the library is copied in
    before = target.stat().st_mtime_ns
    out = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_BUILDING, str(tmp_path)],
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    out = out.stdout.split()
    assert out == [target.name, "8.0"]
    assert target.stat().st_mtime_ns == before


def test_a_new_directory_copies_the_users_cache_instead_of_building(tmp_path) -> None:
    """A restart with a new --compile-cache-dir on a machine that built the library once
    (the user's cache holds it) copies that file: no build, and the op runs."""
    shared = tmp_path / "xdg" / "inference-svc" / "kernels"
    made = kernels.load(shared)  # registered already here: the library is copied in
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    cmd = [sys.executable, "-c", LOAD_WITHOUT_BUILDING, str(tmp_path / "cc")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [made.name, "8.0"], out.stderr
    assert (tmp_path / "cc" / made.name).read_bytes() == made.read_bytes()


def test_a_build_leaves_a_copy_in_the_users_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    built: list[Path] = []

    def build(directory: Path, target: Path) -> None:  # the compiler's output, faked
        directory.mkdir(parents=True)
        target.write_bytes(b"library")
        built.append(target)

    monkeypatch.setattr(kernels, "_build", build)
    target = tmp_path / "cc" / "kernels" / "inference_ops-k.so"
    kernels._build_or_copy(target.parent, target)
    shared = tmp_path / "xdg" / "inference-svc" / "kernels" / target.name
    assert built == [target] and shared.read_bytes() == b"library"
    again = tmp_path / "cc2" / "kernels" / target.name
    kernels._build_or_copy(again.parent, again)  # a second directory: copied, not built
    assert built == [target] and again.read_bytes() == b"library"


def test_native_named_and_not_built_fails_the_load_naming_the_setting(
    monkeypatch, tiny_lm_dir
) -> None:
    from inference_api.plan import CompilationMode
    from inference_svc.compile_monitor import CompileMonitor
    from inference_svc.limits import GenLimits
    from inference_svc.models.compile import ModelContext
    from inference_svc.models.generative import load_generative

    def broken(directory=None):
        raise RuntimeError("c++: internal compiler error")

    monkeypatch.setattr(kernels, "load", broken)
    ctx = ModelContext(
        "lm", CompilationMode.NONE, CompileMonitor(), torch.device("cpu"), torch.float32
    )
    with pytest.raises(RuntimeError, match=r"--decode-attention native: .*internal compiler"):
        load_generative(ctx, tiny_lm_dir, GenLimits(1, 8, 8, 8), attention="native")


class _Chain(torch.nn.Module):
    """Long enough a forward pass (~0.1 s) to watch another thread during it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(512, 512) / 512**0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(40):
            x = torch.tanh(x @ self.w)
        return x


def test_a_package_runs_with_the_gil_released(tmp_path) -> None:
    """inference::run_package (models/aoti.py's way to run packages) lets the service's other
    Python threads run during a forward pass: this thread counts while another thread's one
    call is in flight. (torch's own loader binding holds the GIL for the whole call.)"""
    import threading

    x = torch.randn(1024, 512)
    ep = torch.export.export(_Chain(), (x,))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "c.pt2"))
    package = torch.classes.inference.Package(path, "model")
    (out,) = torch.ops.inference.run_package(package, [x])
    assert torch.allclose(out, ep.module()(x), atol=1e-4)  # the weights inside the package

    started, done = threading.Event(), threading.Event()

    def call() -> None:
        started.set()
        torch.ops.inference.run_package(package, [x])
        done.set()

    worker = threading.Thread(target=call)
    worker.start()
    started.wait()
    counted = 0
    while not done.is_set():
        counted += 1
    worker.join()
    assert counted > 10_000, counted
