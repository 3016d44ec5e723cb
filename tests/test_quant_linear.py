"""This project's quantised linear kernel (inference::quant_linear, --linear-kernel native):
exactly its stated integer arithmetic (4-bit groups with minimums, 8-bit groups, activations in
8-bit groups) for every row count the service gives it, near the float product and torch's
int4 kernel; bad input refused by name; a GGUF Q8_0 tensor kept bit for bit; an op
torch.export keeps and an AOTInductor package calls; what auto picks per CPU (capability
faked); a whole LM on it near torch's int4 path. (The real LM's top-1 agreement with float32:
tests/test_accuracy.py.)"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from inference_svc import kernels
from inference_svc.models import cpu
from inference_svc.models.weights import GROUP, Int4Linear, QuantLinear, convert_linears

pytestmark = pytest.mark.rpc


@pytest.fixture(scope="module", autouse=True)
def op() -> None:
    kernels.load()


def full(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[n/8, k/32, 8] per-group values -> [n, k], each repeated over its group."""
    return t.transpose(1, 2).reshape(n, k // GROUP).repeat_interleave(GROUP, 1)


def unpack(layer: QuantLinear, k: int) -> torch.Tensor:
    """The layer's q as [n, k] integers, out of the kernel's layout."""
    n, q = layer.out_features, layer.q
    if layer.bits == 8:
        return q.view(n // 8, k // 4, 8, 4).permute(0, 2, 1, 3).reshape(n, k).int()
    nibbles = torch.stack([q & 0x0F, q >> 4], 2)  # [n/8, k/8, 2, 32]
    return nibbles.view(n // 8, k // 8, 2, 8, 4).permute(0, 3, 1, 2, 4).reshape(n, k).int()


def terms(x: torch.Tensor) -> list[torch.Tensor]:
    """x [rows, k] as the kernel quantises it: two terms of 8 bits a group of 32 (scale
    max|r| / 127 of what is left, r), each as its dequantised float64 value."""
    k, left, out = x.shape[-1], x.double(), []
    for _ in range(2):
        g = left.view(-1, k // GROUP, GROUP)
        d = (g.abs().amax(-1, keepdim=True) / 127).float().double()  # the kernel's float32
        q = torch.where(d > 0, torch.round(g / torch.where(d > 0, d, 1)), 0)
        out.append((q * d).view(-1, k))
        left = left - out[-1]
    return out


def emulate(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: each term's dot with the integer weights, scaled;
    4 bits over q - 8, plus (min + 8 scale) times the exact sum of x."""
    k, n = x.shape[-1], layer.out_features
    q, scale = unpack(layer, k).double(), full(layer.scales, n, k).double()
    xq = sum(terms(x))
    if layer.bits == 4:
        m = full(layer.mins, n, k).double() + 8 * scale
        return xq @ ((q - 8) * scale).T + x.double() @ m.T
    return xq @ (q * scale).T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 37])
def test_the_kernel_computes_its_stated_arithmetic(bits: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 40, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen) * 0.05)
    layer = QuantLinear(linear, bits)
    x = torch.randn(rows, 96, generator=gen)
    y = layer(x)
    assert y.shape == (rows, 40) and y.dtype == torch.float32
    want = emulate(layer, x)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)
    # near the float product with the quantised weights (what torch's path computes)
    exact = x @ linear.weight.T
    assert (y - exact).norm() / exact.norm() < (0.12 if bits == 4 else 0.02)
    # with the layer's own (quantised) weights, the activations' two terms leave ~1/127^2
    k, n = 96, 40
    q, scale = unpack(layer, k).float(), full(layer.scales, n, k)
    w = q * scale if bits == 8 else (q - 8) * scale + full(layer.mins, n, k) + 8 * scale
    own = x @ w.T
    assert (y - own).norm() / own.norm() < 1e-3
    yb = layer(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    assert torch.allclose(yb.float(), layer(x.bfloat16().float()), rtol=1e-2, atol=1e-2)


# The kernel's other paths that this CPU can run, besides the one the service built for it:
# the scalar loop, AVX2's 256-bit kernels (16 registers), AVX-512 without VNNI (32 registers,
# int16 sums). Each is built alone under another op namespace, in a subprocess.
VARIANTS = {
    "scalar": ((), []),
    "AVX2": (("avx2", "fma"), kernels.ISA_FLAGS["AVX2"]),
    "AVX512": (("avx512f", "avx512bw", "avx512vl", "avx512dq"), kernels.ISA_FLAGS["AVX512"]),
}
_RUN_VARIANT = """
import sys, torch
from torch.utils.cpp_extension import load
src, out, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
load(name="quant_linear_variant", sources=[src], extra_cflags=flags,
     extra_ldflags=["-fopenmp"], build_directory=out, is_python_module=False)
cases = torch.load(out + "/cases.pt")
torch.save([torch.ops.variant.quant_linear(*case) for case in cases], out + "/outputs.pt")
"""


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_path_of_the_kernel_computes_the_same_arithmetic(variant: str, tmp_path) -> None:
    needs, flags = VARIANTS[variant]
    caps = cpu.capabilities()
    if not set(needs) <= caps.flags:
        pytest.skip(f"this CPU cannot run the {variant} kernels")
    if kernels.cflags() == [*kernels.BASE_CFLAGS, *flags]:
        pytest.skip(f"the service's own build is the {variant} one (tested above)")
    here = Path(kernels.__file__).parent
    for name in ("quant_linear.cpp", *(h.name for h in kernels.HEADERS)):
        text = (here / name).read_text().replace("(inference,", "(variant,")
        (tmp_path / name).write_text(text)
    gen = torch.Generator().manual_seed(7)
    cases, want = [], []
    for bits in (4, 8):
        linear = nn.Linear(96, 40, bias=False)  # 5 blocks: wide steps and a single one
        with torch.no_grad():
            linear.weight.copy_(torch.randn(40, 96, generator=gen) * 0.05)
        layer = QuantLinear(linear, bits)
        for rows in (1, 2, 3, 5, 8):
            x = torch.randn(rows, 96, generator=gen)
            cases.append((x, layer.q, layer.scales, layer.mins, bits))
            want.append(emulate(layer, x))
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    src = str(tmp_path / "quant_linear.cpp")
    subprocess.run([sys.executable, "-c", _RUN_VARIANT, src, str(tmp_path),
                    *kernels.BASE_CFLAGS, *flags], check=True, env=env, timeout=600)  # fmt: skip
    outputs = torch.load(tmp_path / "outputs.pt")
    for (x, q, scales, mins, bits), y, expected in zip(cases, outputs, want, strict=True):
        assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5), (bits, len(x))
        ours = torch.ops.inference.quant_linear(x, q, scales, mins, bits)
        assert torch.allclose(y, ours, rtol=1e-5, atol=1e-5), (bits, len(x))


def test_leading_dimensions_and_no_rows() -> None:
    layer = QuantLinear(nn.Linear(64, 16, bias=False), 4)
    x = torch.randn(2, 3, 64)
    assert torch.equal(layer(x), layer(x.view(6, 64)).view(2, 3, 16))
    assert layer(torch.randn(0, 64)).shape == (0, 16)


def test_near_torchs_int4_kernel_on_a_model_sized_layer() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(576, 1536, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1536, 576, generator=gen) * 0.05)
    x = torch.randn(7, 576, generator=gen)
    ours, torchs = QuantLinear(linear, 4)(x), Int4Linear(linear)(x)
    assert (ours - torchs).norm() / torchs.norm() < 0.02


@pytest.mark.parametrize("bits", [4, 8])
def test_the_threads_split_a_model_sized_layer_without_changing_a_bit(bits: int) -> None:
    """Where the layer is large enough for both threads (a call quantises its input and runs
    its weight blocks in one parallel region, each thread a share of each), every output is
    the one a single thread computes: the same products, summed in the same order."""
    gen = torch.Generator().manual_seed(bits)
    linear = nn.Linear(576, 960, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(960, 576, generator=gen) * 0.05)
    layer = QuantLinear(linear, bits)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 5, 13):
            x = torch.randn(rows, 576, generator=gen)
            torch.set_num_threads(1)
            alone = layer(x)
            torch.set_num_threads(2)
            assert torch.equal(layer(x), alone), rows
            assert torch.allclose(alone.double(), emulate(layer, x), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def _comes_back(bits: int, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> None:
    """A GGUF tensor [16, 64] (w = q * d (+ m), d and m float16 per group of 32) packed by
    QuantLinear: its q, scales and minimums exactly."""
    w = q.view(16, 2, GROUP) * d + (m if m is not None else 0)
    linear = nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w.view(16, 64))
    layer = QuantLinear(linear, bits)
    assert torch.equal(unpack(layer, 64), q.int())
    assert torch.equal(full(layer.scales, 16, 64)[:, ::GROUP].float(), d.view(16, 2))
    if m is not None:
        assert torch.equal(full(layer.mins, 16, 64)[:, ::GROUP].float(), m.view(16, 2))


def test_a_q8_0_tensor_comes_back_bit_for_bit() -> None:
    """The GGUF's Q8_0 output layer: a group's largest |q| is 127, w = q * d."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (16, 64), generator=gen)
    q[:, ::GROUP] = 127  # each group holds its scale's extreme
    d = (torch.rand(16, 2, 1, generator=gen) + 0.01).half().float()  # GGUF keeps float16
    _comes_back(8, q, d, None)


def test_a_q4_1_tensor_comes_back_bit_for_bit() -> None:
    """The GGUF's Q4_1 layers: w = q * d + m, d and m float16, each group spanning q 0..15."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (16, 64), generator=gen)
    q[:, ::GROUP], q[:, 1::GROUP] = 0, 15
    d = (torch.rand(16, 2, 1, generator=gen) * 0.01 + 1e-4).half().float()
    m = (-torch.rand(16, 2, 1, generator=gen) * 0.05).half().float()
    _comes_back(4, q, d, m)


def test_bad_input_is_refused_by_name() -> None:
    layer = QuantLinear(nn.Linear(64, 16, bias=False), 4)
    op = torch.ops.inference.quant_linear
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="bits 4 or 8"):
        op(x, layer.q, layer.scales, layer.mins, 3)
    with pytest.raises(RuntimeError, match="uint8 for 4 bits"):
        op(x, layer.q.view(torch.int8), layer.scales, layer.mins, 4)
    with pytest.raises(RuntimeError, match="last dimension must be K = 64"):
        op(torch.randn(2, 32), layer.q, layer.scales, layer.mins, 4)
    with pytest.raises(RuntimeError, match="mins"):
        op(x, layer.q, layer.scales, torch.empty(0, dtype=torch.float16), 4)
    with pytest.raises(RuntimeError, match=r"scales: \[N / 8, K / 32, 8\] float16"):
        op(x, layer.q, layer.scales.float(), layer.mins, 4)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(x.half(), layer.q, layer.scales, layer.mins, 4)
    with pytest.raises(ValueError, match="--linear-kernel native runs --lm-weights int4"):
        convert_linears(nn.Sequential(nn.Linear(64, 16)), "bfloat16", "native")


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = QuantLinear(nn.Linear(64, 128, bias=False), 4)
        self.head = QuantLinear(nn.Linear(128, 40, bias=False), 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.up(x)))


def test_export_keeps_the_op_and_an_aoti_package_calls_it(tmp_path) -> None:
    model = _Mlp().eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=gen)
    rows = torch.export.Dim("rows", max=16)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: rows},))
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.inference.quant_linear.default) == 2
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
    run = torch._inductor.aoti_load_package(package)
    for n in (3, 1, 16):  # points of the dynamic range
        call = torch.randn(n, 64, generator=gen)
        assert torch.allclose(run(call), model(call), atol=1e-5)


def _fake_isa(monkeypatch, isa: str, *flags: str) -> None:
    monkeypatch.setattr(cpu, "capabilities", lambda: cpu.Capabilities(isa, frozenset(flags)))


def test_auto_is_native_where_measured_and_torch_elsewhere(monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="inference_svc.models.cpu")
    here = torch.device("cpu")
    _fake_isa(monkeypatch, "AVX2", "avx2")
    assert cpu.choose_linear_kernel("auto", here, "int4") == "native"
    assert "--linear-kernel auto: native (AMD EPYC, AVX2" in caplog.text
    assert cpu.choose_linear_kernel("auto", here, "bfloat16") == "torch"
    assert cpu.choose_linear_kernel("auto", torch.device("cuda"), "int4") == "torch"
    _fake_isa(monkeypatch, "AVX512", "avx2", "avx512f", "avx512_vnni")
    assert cpu.choose_linear_kernel("auto", here, "int4") == "native"
    assert "--linear-kernel auto: native (AMD EPYC, AVX512-VNNI" in caplog.text
    caplog.clear()
    _fake_isa(monkeypatch, "AVX512", "avx2", "avx512f")  # no VNNI: not measured
    assert cpu.choose_linear_kernel("auto", here, "int4") == "torch"
    assert "torch's capability AVX512: native not measured on this CPU class" in caplog.text
    _fake_isa(monkeypatch, "AVX512", "avx512f", "avx512_vnni", "amx_tile")  # AMX: torch's
    assert cpu.choose_linear_kernel("auto", here, "int4") == "torch"
    assert cpu.choose_linear_kernel("native", here, "int4") == "native"


def test_auto_falls_back_to_torch_when_the_ops_do_not_build(monkeypatch, caplog) -> None:
    def broken(directory=None):
        raise RuntimeError("c++: internal compiler error")

    _fake_isa(monkeypatch, "AVX2", "avx2")
    monkeypatch.setattr(kernels, "load", broken)
    caplog.set_level(logging.INFO, logger="inference_svc.models.cpu")
    assert cpu.choose_linear_kernel("auto", torch.device("cpu"), "int4") == "torch"
    assert "--linear-kernel auto: torch (this project's ops did not build)" in caplog.text


def test_an_lm_on_the_kernel_is_near_torchs_int4_path(tiny_lm_dir) -> None:
    """The whole tiny LM, prefill and decode through the service's runner: its output layer in
    int8 groups, Describe's numerics naming the kernel, logits near torch's int4 path."""
    from bench.accuracy import load_lm, prefill
    from inference_api.plan import CompilationMode

    ours = load_lm("float32", "int4:native", CompilationMode.NONE, str(tiny_lm_dir))
    torchs = load_lm("float32", "int4", CompilationMode.NONE, str(tiny_lm_dir))
    lm = ours.model.lm
    assert isinstance(lm.lm_head, QuantLinear) and lm.lm_head.bits == 8
    assert ours.model.numerics == "float32+int4-linear-native"
    assert torchs.model.numerics == "float32+int4-linear"
    ids = [5, 17, 42, 7, 99, 3, 12, 64, 8, 1, 30]
    with torch.inference_mode():
        a, b = prefill(ours, ids), prefill(torchs, ids)
    assert a.shape == b.shape
    assert (a - b).norm() / b.norm() < 0.05
