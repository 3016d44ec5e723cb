"""--lm-weights auto and --embed-dtype auto: the table's choice per CPU capability (faked),
resolved once to a concrete scheme that the kept artifacts' key and the loaders see; never
"auto" below config. A service started with them reports the choice and why:
tests/test_weights.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference_svc.config import LM_WEIGHTS, parse_config
from inference_svc.engine.artifacts import for_config
from inference_svc.models import cpu
from inference_svc.models.weights import convert_linears

pytestmark = pytest.mark.unit

AMX = cpu.Capabilities("AVX512", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}))
AVX512_BF16 = cpu.Capabilities("AVX512", frozenset({"avx2", "avx512f", "avx512_bf16"}))
AVX512 = cpu.Capabilities("AVX512", frozenset({"avx2", "avx512f"}))
AVX2 = cpu.Capabilities("AVX2", frozenset({"avx2", "fma"}))
NO_VECTOR = cpu.Capabilities("DEFAULT", frozenset({"sse4_2"}))
CPU = torch.device("cpu")


def fake(monkeypatch: pytest.MonkeyPatch, caps: cpu.Capabilities) -> None:
    monkeypatch.setattr(cpu, "capabilities", lambda: caps)


@pytest.mark.parametrize(
    ("caps", "scheme", "tag"),
    [
        (AMX, "int4", "AMX-BF16"),
        (AVX512_BF16, "int4", "AVX512-BF16"),
        (AVX512, "int4", "AVX-512"),
        (AVX2, "int4", "AVX2"),
        (NO_VECTOR, "same", "no AVX2"),
        # The flags say AVX2, torch's kernels do not use it (ATEN_CPU_CAPABILITY=default).
        (cpu.Capabilities("DEFAULT", AVX2.flags), "same", "no AVX2"),
    ],
)
def test_auto_picks_per_cpu_capability(monkeypatch, caps, scheme, tag) -> None:
    fake(monkeypatch, caps)
    choice = cpu.choose_lm_weights("auto", CPU)
    assert (choice.scheme, choice.tag) == (scheme, tag)
    assert choice.auto and choice.reason


def test_auto_on_cuda_keeps_the_dtype(monkeypatch) -> None:
    fake(monkeypatch, AMX)  # whatever the host CPU has
    choice = cpu.choose_lm_weights("auto", torch.device("cuda", 0))
    assert (choice.scheme, choice.tag, choice.reason) == ("same", "CUDA", "a cuda device")
    config, resolved = cpu.resolve(parse_config(["--lm-weights", "auto", "--device", "cuda"]))
    assert config.lm_weights == "same" and resolved.lm.tag == "CUDA"


def test_a_named_scheme_is_kept_as_it_is(monkeypatch) -> None:
    fake(monkeypatch, NO_VECTOR)
    for scheme in LM_WEIGHTS:
        assert cpu.choose_lm_weights(scheme, CPU) == cpu.WeightsChoice(scheme)
        config = parse_config(["--lm-weights", scheme, "--compile-backend", "torch-compile",
                               "--decode-attention", "sdpa",
                               "--linear-kernel", "torch"])  # fmt: skip
        same = cpu.WeightsChoice("same")
        named = cpu.Choices(cpu.WeightsChoice(scheme), same, "torch-compile", "sdpa", "torch")
        assert cpu.resolve(config) == (config, named)


def test_the_compile_backend_auto_is_aoti_on_a_cpu_and_torch_compile_on_cuda() -> None:
    """--compile-backend auto (the default) becomes aoti on a CPU, torch-compile on a CUDA
    device; a named backend is kept; the resolved config names no "auto"."""
    assert parse_config([]).compile_backend == "auto"
    assert cpu.choose_compile_backend("auto", CPU) == "aoti"
    assert cpu.choose_compile_backend("auto", torch.device("cuda")) == "torch-compile"
    for named in ("aoti", "torch-compile"):
        assert cpu.choose_compile_backend(named, torch.device("cuda")) == named
    config, auto = cpu.resolve(parse_config(["--device", "cpu"]))
    assert config.compile_backend == auto.backend == "aoti"


def test_every_rule_keeps_agreement_with_float32() -> None:
    """auto chooses only schemes whose top-1 agreement stays >= 0.98 (docs/numerics.md)."""
    for rule in cpu.AUTO_RULES:
        assert rule.scheme in LM_WEIGHTS
        assert cpu.AGREEMENT[rule.scheme] >= cpu.AGREEMENT_FLOOR, rule
        assert rule.measured


def test_resolve_logs_the_choice_and_its_reason(monkeypatch, caplog) -> None:
    fake(monkeypatch, AMX)
    caplog.set_level("INFO", logger=cpu.__name__)
    args = ["--lm-weights", "auto", "--embed-dtype", "auto", "--device", "cpu"]
    config, choice = cpu.resolve(parse_config(args))
    assert config.lm_weights == "int4" and choice.lm.tag == "AMX-BF16"
    assert config.embed_dtype == "bfloat16" and choice.embed.tag == "AMX-BF16"
    assert "--lm-weights auto: int4 (CPU has AMX-BF16)" in caplog.text
    assert "--embed-dtype auto: bfloat16 (CPU has AMX-BF16)" in caplog.text


@pytest.mark.parametrize(
    ("caps", "dtype", "tag"),
    [
        (AMX, "bfloat16", "AMX-BF16"),
        (AVX512_BF16, "bfloat16", "AVX512-BF16"),
        (AVX512, "same", "no native bfloat16"),  # bfloat16 emulated: slower than float32
        (AVX2, "same", "no native bfloat16"),
        (NO_VECTOR, "same", "no native bfloat16"),
        (cpu.Capabilities("DEFAULT", AMX.flags), "same", "no native bfloat16"),
    ],
)
def test_embed_dtype_auto_picks_bfloat16_only_where_the_cpu_computes_it(
    monkeypatch, caps, dtype, tag
) -> None:
    fake(monkeypatch, caps)
    choice = cpu.choose_embed_dtype("auto", CPU)
    assert (choice.scheme, choice.tag) == (dtype, tag) and choice.reason
    assert cpu.choose_embed_dtype("auto", torch.device("cuda", 0)).scheme == "same"
    for named in ("same", "float32", "bfloat16"):
        assert cpu.choose_embed_dtype(named, CPU) == cpu.WeightsChoice(named)
    assert parse_config([]).embed_dtype == "same"  # the default: exact float32 vectors
    for rule in cpu.EMBED_AUTO_RULES:
        assert rule.measured


def test_the_default_stays_same_and_nothing_below_config_takes_auto() -> None:
    assert parse_config([]).lm_weights == "same"
    assert parse_config(["--lm-weights", "auto"]).lm_weights == "auto"
    assert "auto" not in LM_WEIGHTS
    with pytest.raises(ValueError, match="auto"):
        convert_linears(torch.nn.Sequential(torch.nn.Linear(32, 16)), "auto")


@pytest.mark.parametrize(("caps", "scheme"), [(AMX, "int4"), (NO_VECTOR, "same")])
def test_the_kept_artifacts_key_names_the_resolved_scheme(
    monkeypatch, tmp_path: Path, caps, scheme
) -> None:
    fake(monkeypatch, caps)
    lm = tmp_path / "lm"
    lm.mkdir()
    args = ["--lm-weights", "auto", "--device", "cpu", "--compilation-mode", "default",
            "--compile-cache-dir", str(tmp_path / "kept"), "--embed-dtype", "auto"]  # fmt: skip
    store = for_config(parse_config(args), {"generative": lm})
    assert store is not None
    try:
        numerics = store.key.fields["numerics"]
        assert f"lm_weights={scheme} " in numerics and "lm_weights=auto" not in numerics
        assert "embed_dtype=auto" not in numerics
        # --compile-backend auto (the default) on a CPU: the key names aoti.
        assert store.key.fields["mode"] == "default backend=aoti freeze=False"
    finally:
        store.close()
    # The same key as the scheme named outright.
    named = for_config(parse_config([*args[:1], scheme, *args[2:]]), {"generative": lm})
    assert named is not None
    named.close()
    assert named.key.digest == store.key.digest


def test_capabilities_are_this_machines_read_once() -> None:
    caps = cpu.capabilities()
    assert caps.isa == torch.backends.cpu.get_cpu_capability()
    assert cpu.capabilities() is caps
    if Path("/proc/cpuinfo").exists() and caps.isa in cpu.VECTOR:
        assert "avx2" in caps.flags
