"""--lm-weights: int4 groups reproduce GGUF Q4_1 blocks bit for bit; each option is
declared (Describe, Info) and warmed: compiled on a tiny LM with no late compiles; auto is
resolved at load and reported with its reason."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_svc.models.weights import BFloat16Linear, Int4Linear, convert_linears, numerics
from tests.conftest import TORCH_COMPILE, tiny_args
from tests.rpc import serving
from tests.test_batching import mixed_arrivals, shapes_ran_and_listed

pytestmark = pytest.mark.rpc


def q4_1_weights(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Weights as a Q4_1 GGUF stores them: per 32 inputs, fp16 scale d and minimum m,
    w = d * q + m with q in 0..15 (both ends used, as the quantizer makes them)."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    return (q * d + m).view(n, k)


def test_int4_groups_reproduce_q4_1_weights_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=False)
    with torch.no_grad():
        linear.weight.copy_(q4_1_weights(1536, 576, gen))
    layer = Int4Linear(linear)
    assert layer.max_error == 0.0
    x = torch.randn(3, 5, 576, generator=gen)
    want = F.linear(x, linear.weight)
    got = layer(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    # bfloat16 activations and scales: close, not equal.
    assert (got - want).abs().max() / want.abs().max() < 2e-2


def test_convert_linears_swaps_every_linear_layer() -> None:
    model = torch.nn.Sequential()
    model.add_module("up", torch.nn.Linear(64, 32, bias=False))
    model.add_module("lm_head", torch.nn.Linear(32, 48, bias=False))
    convert_linears(model, "int4")
    assert isinstance(model.up, Int4Linear)  # groups of 32 along 64 inputs
    assert isinstance(model.lm_head, BFloat16Linear)  # the output layer stays bfloat16
    assert model(torch.randn(2, 64)).shape == (2, 48)
    with pytest.raises(ValueError, match="int8"):
        convert_linears(model, "int8")


def test_a_biased_layer_keeps_its_bias_in_bfloat16_and_int4() -> None:
    """Qwen2's q/k/v carry a bias: bfloat16 weights keep it; int4 leaves the layer bfloat16."""
    torch.manual_seed(0)
    for scheme in ("bfloat16", "int4"):
        lm = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=True))
        with torch.no_grad():
            lm[0].bias.normal_(0, 3.0)
        x = torch.randn(4, 64)
        want = lm(x)
        convert_linears(lm, scheme)
        assert isinstance(lm[0], BFloat16Linear)
        assert (lm(x) - want).abs().max() < 0.1  # bfloat16 products; the bias is exact


def test_numerics_names_what_the_graphs_compute_in() -> None:
    assert numerics(torch.float32, "same") == "float32"
    assert numerics(torch.float32, "int4") == "float32+int4-linear"
    assert numerics(torch.float32, "bfloat16") == "float32+bfloat16-linear"
    assert numerics(torch.bfloat16, "bfloat16") == "bfloat16"


@pytest.mark.parametrize(
    "option", [("--lm-weights", "int4", "--linear-kernel", "native"), ("--dtype", "bfloat16")]
)
async def test_each_option_is_declared_and_compiled_before_serving(
    tiny_embed_dir, tiny_lm_dir, option
) -> None:
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--compilation-mode", "default", *TORCH_COMPILE,
                     *option)  # fmt: skip
    want = "float32+int4-linear-native" if option[1] == "int4" else "bfloat16"
    async with serving(args, loaded=True) as (service, c):
        described = await c.admin.Describe(apb.DescribeRequest())
        lm = next(m for m in described.models if m.name == "generative")
        assert lm.numerics == want
        compile_step = next(
            s for s in described.required_steps
            if s.step == apb.WARMUP_STEP_KIND_COMPILE and s.model == "generative"
        )  # fmt: skip
        assert want in compile_step.reason
        reports = await c.warm_and_serve()
        events = {(r.step, r.model): r.compile_events for r in reports}
        assert events[(apb.WARMUP_STEP_KIND_PROFILE, "generative")] == 2
        assert events[(apb.WARMUP_STEP_KIND_COMPILE, "generative")] == 0
        greedy = pb.GenerateRequest(prompt="one two", sampling=pb.SamplingParams(max_tokens=8))
        first = await c.inference.Generate(greedy)
        await mixed_arrivals(c, random.Random(5), 16, max_words=30, max_tokens=12)
        again = await c.inference.Generate(greedy)
        assert list(again.token_ids) == list(first.token_ids)
        info = await c.inference.Info(pb.InfoRequest())
        assert info.late_compile_events == 0, info
        assert next(m for m in info.models if m.kind == pb.MODEL_KIND_GENERATIVE).dtype == want
        ran, listed = await shapes_ran_and_listed(service, c)
        assert ran <= listed, sorted(map(str, ran - listed))


@pytest.mark.parametrize(
    ("isa", "flags", "scheme", "want", "embed_want"),
    [
        ("AVX512", {"avx2", "amx_bf16"}, "int4", "float32+int4-linear (auto: AMX-BF16)",
         "bfloat16 (auto: AMX-BF16)"),
        ("DEFAULT", {"sse4_2"}, "same", "float32 (auto: no AVX2)",
         "float32 (auto: no native bfloat16)"),
    ],
)  # fmt: skip
async def test_auto_is_resolved_at_load_and_reported_with_its_reason(
    tiny_embed_dir, tiny_lm_dir, monkeypatch, caplog, isa, flags, scheme, want, embed_want
) -> None:
    """--lm-weights auto and --embed-dtype auto on a faked CPU: the engine loads concrete
    choices, logs why, and Describe and Info say both; Embed answers in the chosen dtype."""
    from inference_svc.models import cpu

    monkeypatch.setattr(cpu, "capabilities", lambda: cpu.Capabilities(isa, frozenset(flags)))
    caplog.set_level("INFO", logger=cpu.__name__)
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--lm-weights", "auto", "--device", "cpu",
                     "--embed-dtype", "auto")  # fmt: skip
    async with serving(args, warm=True) as (service, c):
        assert service.engine.config.lm_weights == scheme
        described = await c.admin.Describe(apb.DescribeRequest())
        assert next(m for m in described.models if m.name == "generative").numerics == want
        info = await c.inference.Info(pb.InfoRequest())
        assert next(m for m in info.models if m.kind == pb.MODEL_KIND_GENERATIVE).dtype == want
        embed = next(m for m in info.models if m.kind == pb.MODEL_KIND_EMBEDDING)
        assert embed.dtype == embed_want  # --lm-weights is the LM's alone, --embed-dtype Embed's
        assert next(m for m in described.models if m.name == "embedding").numerics == embed_want
        vectors = await c.inference.Embed(pb.EmbedRequest(inputs=["a text"]))
        norm = sum(v * v for v in vectors.embeddings[0].values) ** 0.5
        assert abs(norm - 1) < 1e-3, norm  # computed in the chosen dtype, returned as float32
        ask = pb.GenerateRequest(prompt="one two", sampling=pb.SamplingParams(max_tokens=8))
        reply = await c.inference.Generate(ask)
        assert reply.token_ids
    assert f"--lm-weights auto: {scheme} (" in caplog.text
