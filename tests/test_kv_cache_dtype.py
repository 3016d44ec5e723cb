"""--kv-cache-dtype: the LM's KV cache in float16 under a float32 model (half the memory and
the bytes a decode step reads). What auto picks and says why; a cache of half the bytes whose
logits stay close to the float32 cache's on either decode attention; an AOTInductor package
that serves the tokens eager serves on the same cache, Describe and Info naming the cache's
dtype; kept artifacts keyed on the setting."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from inference_api.plan import Bucket, CompilationMode, Phase
from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_svc.compile_monitor import CompileMonitor, Origin
from inference_svc.config import parse_config
from inference_svc.engine.artifacts import for_config
from inference_svc.limits import GenLimits
from inference_svc.models import cpu
from inference_svc.models.compile import ModelContext
from inference_svc.models.generative import GenerativeModel, kv_cache_dtype, load_generative
from tests.conftest import tiny_args
from tests.rpc import serving

pytestmark = pytest.mark.rpc

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def context(dtype: torch.dtype = F32) -> ModelContext:
    return ModelContext("lm", CompilationMode.NONE, CompileMonitor(), torch.device("cpu"), dtype)


SMOLLM2 = SimpleNamespace(head_dim=64, num_heads=9, num_kv_heads=3)
LLAMA3 = SimpleNamespace(head_dim=128, num_heads=32, num_kv_heads=8)
NOT_FUSED = "not the kernel's fused path"


@pytest.mark.parametrize(
    ("setting", "attention", "dtype", "isa", "shape", "want", "why"),
    [
        ("auto", "native", F32, "AVX512", SMOLLM2, F16,
         "float16 (float32 model, native decode attention on AVX-512)"),
        ("auto", "sdpa", F32, "AVX512", SMOLLM2, F32, "float32 (decode attention sdpa)"),
        ("auto", "native", BF16, "AVX512", SMOLLM2, BF16,
         "bfloat16 (the model computes in bfloat16)"),
        ("auto", "native", F32, "AVX2", SMOLLM2, F32,
         f"float32 (capability AVX2, head size 64, 3 query heads a KV head: {NOT_FUSED})"),
        ("auto", "native", F32, "AVX512", LLAMA3, F32,
         f"float32 (capability AVX512, head size 128, 4 query heads a KV head: {NOT_FUSED})"),
        ("float16", "sdpa", F32, "AVX2", LLAMA3, F16, ""),
        ("same", "native", F32, "AVX512", SMOLLM2, F32, ""),
    ],
)  # fmt: skip
def test_what_each_setting_gives_and_auto_says_why(
    setting: str, attention: str, dtype: torch.dtype, isa: str, shape: SimpleNamespace,
    want: torch.dtype, why: str, caplog, monkeypatch,
) -> None:  # fmt: skip
    """auto: float16 only where the native kernel's fused path reads it (AVX-512, head size
    64, up to 3 query heads a KV head); elsewhere it measured slower than float32."""
    monkeypatch.setattr(cpu, "capabilities", lambda: cpu.Capabilities(isa, frozenset()))
    caplog.set_level(logging.INFO, logger="inference_svc.models.generative")
    lm = SimpleNamespace(decode_attention=attention, shape=shape)
    assert kv_cache_dtype(setting, lm, context(dtype)) == want  # type: ignore[arg-type]
    if why:
        assert f"model lm: --kv-cache-dtype auto: {why}" in caplog.text


def steps(model: GenerativeModel) -> list[torch.Tensor]:
    """A 6-token prompt prefilled into row 1, then 5 decode steps over rows 0 and 1."""
    model.allocate_cache(2)
    out = []
    with torch.inference_mode():
        prompt = torch.tensor([[3, 14, 15, 9, 2, 6, 0, 0]])
        out.append(model.prefill(1, prompt, torch.arange(8)[None], torch.tensor([5]),
                                 Bucket(Phase.PREFILL, 1, 8, 16), Origin.WARMUP))  # fmt: skip
        for step in range(5):
            ids = torch.tensor([[7 + step], [11 + step]])
            pos = torch.tensor([[step], [6 + step]])
            out.append(model.decode(ids, pos, Bucket(Phase.DECODE, 2, 1, 16), Origin.WARMUP))
    return out


@pytest.mark.parametrize("attention", ["native", "sdpa"])
def test_a_float16_cache_holds_half_the_bytes_and_decodes_close_to_float32(
    tiny_lm_dir: Path, attention: str
) -> None:
    limits = GenLimits(2, 16, 16, 8)
    f32, f16 = (load_generative(context(), tiny_lm_dir, limits, attention=attention, kv_cache=kv)
                for kv in ("same", "float16"))  # fmt: skip
    assert (f32.numerics, f16.numerics) == ("float32", "float32+float16-kv")
    assert 2 * f16.kv_bytes_per_token() == f32.kv_bytes_per_token()
    want, got = steps(f32), steps(f16)
    assert f16.k_cache is not None and f16.v_cache is not None
    assert {t.dtype for t in f16.k_cache + f16.v_cache} == {F16}
    for a, b in zip(want, got, strict=True):
        assert b.dtype == F32
        # float16 keeps 11 significant bits: the logits move by a few parts in a thousand
        assert (a - b).abs().max() <= 1e-2 * a.abs().max(), (a - b).abs().max()


def test_kept_artifacts_are_keyed_on_the_cache_dtype(tmp_path: Path) -> None:
    lm = tmp_path / "lm"
    lm.mkdir()
    base = ["--device", "cpu", "--compilation-mode", "default", "--compile-cache-dir",
            str(tmp_path / "kept")]  # fmt: skip
    keys = {}
    for setting in ("same", "float16"):
        store = for_config(parse_config([*base, "--kv-cache-dtype", setting]), {"generative": lm})
        assert store is not None
        store.close()
        assert f"kv_cache={setting}" in store.key.fields["numerics"]
        keys[setting] = store.key.digest
    assert keys["same"] != keys["float16"]


async def test_a_package_serves_the_tokens_eager_serves_on_a_float16_cache(
    tiny_embed_dir: Path, tiny_lm_dir: Path
) -> None:
    base = ("--embed-model", "none", "--kv-cache-dtype", "float16", "--compile-cache-dir", "")
    request = pb.GenerateRequest(
        prompt="one two three four", sampling=pb.SamplingParams(max_tokens=8)
    )
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir, *base), warm=True) as (svc, c):
        eager = list((await c.inference.Generate(request)).token_ids)
        model = svc.engine.runtimes["generative"].model
        assert model.k_cache is not None and model.k_cache[0].dtype == F16
    compiled = (*base, "--compilation-mode", "default")  # aoti: the default on a CPU
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir, *compiled), warm=True) as (_, c):
        described = (await c.admin.Describe(apb.DescribeRequest())).models
        m = next(m for m in described if m.name == "generative")
        assert m.backend == "aoti" and m.numerics == "float32+float16-kv", m
        assert list((await c.inference.Generate(request)).token_ids) == eager
        info = await c.inference.Info(pb.InfoRequest())
        assert [i.dtype for i in info.models] == ["float32+float16-kv"]
        assert info.late_compile_events == 0
