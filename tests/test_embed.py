"""Embed on the real all-MiniLM-L6-v2 against sentence-transformers, and its errors."""

from __future__ import annotations

import grpc
import pytest
import torch

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_svc.models.loading import resolve_embed_dir

pytestmark = pytest.mark.rpc

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A gRPC service that never answers on a cold path.",
    "Paris is the capital of France.",
    "short",
    "Embeddings map sentences to vectors; similar sentences land close together, "
    "and this one is a good deal longer than the others to exercise padding.",
]


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(resolve_embed_dir("default")), device="cpu")
    return torch.tensor(model.encode(TEXTS, normalize_embeddings=True))


def _matrix(reply: pb.EmbedResponse) -> torch.Tensor:
    return torch.tensor([list(e.values) for e in reply.embeddings])


async def test_embed_matches_sentence_transformers(real, reference):
    reply = await real.inference.Embed(pb.EmbedRequest(inputs=TEXTS))
    got = _matrix(reply)
    assert got.shape == (len(TEXTS), 384)
    cos = torch.nn.functional.cosine_similarity(got, reference, dim=-1)
    assert cos.min().item() >= 0.999, cos
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-4)
    assert reply.usage.prompt_tokens > len(TEXTS)


async def test_embed_order_and_batching_do_not_change_vectors(real):
    alone = _matrix(await real.inference.Embed(pb.EmbedRequest(inputs=[TEXTS[1]])))
    batch = _matrix(await real.inference.Embed(pb.EmbedRequest(inputs=TEXTS[::-1])))
    assert torch.allclose(alone[0], batch[len(TEXTS) - 2], atol=1e-5)


async def test_embed_dimensions_and_normalize_options(real, reference):
    raw = _matrix(await real.inference.Embed(pb.EmbedRequest(inputs=TEXTS[:2], normalize=False)))
    # Unit length all the same: the model's modules.json ends in Normalize, so its own
    # vectors are normalised, as sentence-transformers' encode(normalize_embeddings=False).
    assert torch.allclose(raw.norm(dim=-1), torch.ones(2), atol=1e-4)
    cut = _matrix(await real.inference.Embed(pb.EmbedRequest(inputs=TEXTS[:2], dimensions=64)))
    assert cut.shape == (2, 64)
    want = torch.nn.functional.normalize(raw[:, :64], dim=-1)
    assert torch.allclose(cut, want, atol=1e-5)


async def test_embed_truncate(real):
    long_text = "word " * 400
    reply = await real.inference.Embed(pb.EmbedRequest(inputs=[long_text], truncate=True))
    assert len(reply.embeddings[0].values) == 384
    assert reply.usage.prompt_tokens == 256


@pytest.mark.parametrize(
    ("request_kwargs", "needle"),
    [
        ({"inputs": []}, "inputs: empty batch"),
        ({"inputs": ["ok", ""]}, "inputs[1]: empty string"),
        ({"inputs": ["x"] * 33}, "the limit is 32"),
        ({"inputs": ["word " * 400]}, "the limit is 256 (set truncate=true"),
        ({"inputs": ["x"], "dimensions": 999}, "dimensions: 999; the model has 384"),
    ],
)
async def test_embed_bad_input_is_invalid_argument(real, request_kwargs, needle):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await real.inference.Embed(pb.EmbedRequest(**request_kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


async def test_info_names_the_models_and_their_limits(real):
    info = await real.inference.Info(pb.InfoRequest())
    by_kind = {m.kind: m for m in info.models}
    embed, lm = by_kind[pb.MODEL_KIND_EMBEDDING], by_kind[pb.MODEL_KIND_GENERATIVE]
    assert embed.name == "all-MiniLM-L6-v2" and embed.dimensions == 384
    assert embed.max_input_tokens == 256 and not embed.has_kv_cache
    assert lm.name == "SmolLM2-135M-Instruct" and lm.has_kv_cache and lm.vocab_size == 49152
    assert info.compilation_mode == pb.COMPILATION_MODE_NONE and info.serving
    reply = await real.inference.Embed(pb.EmbedRequest(inputs=["x"]))
    assert reply.model == "all-MiniLM-L6-v2"
