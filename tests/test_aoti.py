"""--compile-backend aoti on tiny models: the service serves what eager serves with 0 late
compiles, Describe names the backend and the proof, the decode package calls the native
attention kernel, a restart loads the kept packages (and the kernel) with
0 compile events, a corrupt package is refused by name, and every LM weight format
exports."""

from __future__ import annotations

import pytest

from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_svc.engine import artifact_key
from tests.conftest import tiny_args
from tests.rpc import serving
from tests.test_compiled_tiny import eager_results, serves_like_eager  # noqa: F401

pytestmark = pytest.mark.rpc

# A compiled mode on a CPU: --compile-backend auto (the default) is aoti there.
AOTI = ("--compilation-mode", "default")


def _proof_diffs(proof: str) -> list[float]:
    """The max|diff| figures of Describe's proof, one per graph."""
    return [float(part.split("max|diff| ")[1].split()[0]) for part in proof.split("; ")]


async def described(c) -> dict[str, apb.ModelProfile]:
    reply = await c.admin.Describe(apb.DescribeRequest())
    return {m.name: m for m in reply.models}


async def test_aoti_serves_like_eager_and_a_restart_loads_its_packages(
    tiny_embed_dir,
    tiny_lm_dir,
    eager_results,  # noqa: F811
    tmp_path,
) -> None:
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, *AOTI, "--compile-cache-dir", str(tmp_path))
    async with serving(args, warm=True) as (service, c):
        models = await described(c)
        for m in models.values():
            assert m.backend == "aoti" and m.artifacts == "compiled", m
            assert max(_proof_diffs(m.proof)) < 1e-4, m.proof
        assert "prefill" in models["generative"].proof and "decode" in models["generative"].proof
        await serves_like_eager(service, c, eager_results)
        # the decode package calls this project's attention kernel (the default on a CPU),
        # whose library is kept beside the packages
        assert service.engine.runtimes["generative"].model.lm.decode_attention == "native"
        assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".so"]
        entry = service.engine.artifacts.entry
        key = service.engine.artifacts.store.key
    packages = sorted(p.name for p in (entry / "aoti").iterdir())
    assert packages == ["embedding-embed.pt2", "generative-decode.pt2", "generative-prefill.pt2"]

    async with serving(args, loaded=True) as (service, c):
        reports = await c.warm_and_serve()
        assert [r.compile_events for r in reports] == [0] * len(reports), reports
        # Kept packages run once per range, at the smallest shapes (the proof's), not at the
        # largest too: the start that built them ran both ends.
        compiles = {r.model: r for r in reports if r.step == apb.WARMUP_STEP_KIND_COMPILE}
        assert [len(compiles[m].shapes) for m in ("embedding", "generative")] == [1, 2]
        assert all("its smallest shapes, checked against eager" in r.detail
                   for r in compiles.values()), compiles  # fmt: skip
        for m in (await described(c)).values():
            assert m.backend == "aoti" and m.artifacts == "loaded", m
            assert max(_proof_diffs(m.proof)) < 1e-4, m.proof
        await serves_like_eager(service, c, eager_results)

    # A corrupt package: the whole directory is refused, naming the file.
    package = entry / "aoti" / "generative-decode.pt2"
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0xFF
    package.write_bytes(bytes(data))
    assert artifact_key.verify(entry, key) == (
        "file aoti/generative-decode.pt2 is corrupt (its hash differs from the manifest's)"
    )


@pytest.mark.parametrize("weights", ["bfloat16", "int4"])
async def test_every_lm_weight_format_exports_and_matches_its_eager_tokens(
    tiny_embed_dir, tiny_lm_dir, weights: str
) -> None:
    base = ("--embed-model", "none", "--lm-weights", weights, "--compile-cache-dir", "")
    request = pb.GenerateRequest(
        prompt="one two three four", sampling=pb.SamplingParams(max_tokens=8)
    )
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir, *base), warm=True) as (_s, c):
        eager = list((await c.inference.Generate(request)).token_ids)
    async with serving(tiny_args(tiny_embed_dir, tiny_lm_dir, *base, *AOTI), warm=True) as (_s, c):
        m = (await described(c))["generative"]
        assert m.backend == "aoti", m.backend  # exported, no fallback
        assert max(_proof_diffs(m.proof)) < 1e-2, m.proof
        assert list((await c.inference.Generate(request)).token_ids) == eager
        info = await c.inference.Info(pb.InfoRequest())
        assert info.late_compile_events == 0
