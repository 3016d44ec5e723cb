"""Embed on sentence-transformers directories of every kind, against sentence-transformers
itself: tiny models built with its own classes (fixed seeds) for each pooling mode (mean, CLS,
last token; max, mean_sqrt_len_tokens and weightedmean concatenated), with and without
Normalize, a Dense projection, a T5 encoder, prompts (a default one, named ones, left out of
the pooling where the model says so), and a decoder (Qwen3, left padding, last-token pooling)
as Qwen3-Embedding is. Our Embed RPC's vectors equal `SentenceTransformer(dir).encode(...)`'s
(cosine >= 0.9999, the same length) for batches of unequal lengths and an input past
max_seq_length; an unknown prompt is INVALID_ARGUMENT; compiled vectors equal eager ones with
0 late compiles; what is not supported is refused at load, by name."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from inference_api.plan import CompilationMode
from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.models.compile import ModelContext
from inference_svc.models.embedding import load_embedding
from inference_svc.models.loading import offline
from tests.conftest import TORCH_COMPILE, tiny_args
from tests.models import build_tiny_embedder, packaged_tokenizer
from tests.rpc import serving

pytestmark = pytest.mark.rpc

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "short",
    "Paris is the capital of France, and Lyon is a city on the Rhone.",
    # Past every model's max_seq_length below (16 or 24 tokens): cut, as ST cuts it.
    "Embeddings map sentences to vectors; similar sentences land close together, and this "
    "one is a good deal longer than the others so that it is truncated at the limit.",
]


@dataclass(frozen=True)
class Spec:
    """One tiny sentence-transformers model: its modules and prompts."""

    name: str
    pooling: str | tuple[str, ...]
    normalize: bool
    decoder: bool = False
    include_prompt: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    max_seq_length: int = 16
    lower_case: bool = False  # do_lower_case, as older sentence_bert_config.json files say
    dense: int = 0  # a Dense module (tanh) down to this width after the pooling
    t5: bool = False  # a T5 encoder (sentence-T5, GTR) with the BERT tokenizer


SPECS = [
    Spec("mean", "mean", True, prompts={"query": "query: ", "passage": "passage: "}),
    Spec(
        "cls",
        "cls",
        False,
        include_prompt=False,
        prompts={"query": "Represent this sentence for searching passages: "},
        default_prompt="query",
        dense=16,
    ),
    Spec(
        "multi",
        ("max", "mean_sqrt_len_tokens", "weightedmean"),
        False,
        include_prompt=False,
        prompts={"query": "query: "},
    ),
    Spec("t5", "mean", True, t5=True),
    Spec(
        "decoder",
        "lasttoken",
        True,
        decoder=True,
        max_seq_length=24,
        prompts={"query": "Instruct: Given a question, find passages\nQuery: "},
        lower_case=True,  # the tokenizer is cased
    ),
]


def _decoder(raw: Path) -> None:
    """Qwen3 with the SmolLM2 tokenizer, padded on the left and ending each input with an
    end-of-text token, as Qwen3-Embedding's tokenizer does."""
    from tokenizers.processors import TemplateProcessing
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = packaged_tokenizer()
    eos = tokenizer.eos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"$A {eos}", special_tokens=[(eos, tokenizer.eos_token_id)]
    )
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen3Model(config).save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    path = raw / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "padding_side": "left"}))


def _t5(raw: Path) -> None:
    """A T5 (encoder and decoder, as sentence-T5 and GTR ship) with the BERT tokenizer."""
    from transformers import T5Config, T5Model

    build_tiny_embedder(raw)
    config = T5Config(vocab_size=30522, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    torch.manual_seed(0)
    T5Model(config).save_pretrained(raw)


def build(spec: Spec, root: Path) -> Path:
    """The model of ``spec`` saved by sentence-transformers' own classes."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    raw, out = root / f"{spec.name}-raw", root / spec.name
    (_decoder if spec.decoder else _t5 if spec.t5 else build_tiny_embedder)(raw)
    text_only = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    encoder = Transformer(
        str(raw),
        max_seq_length=spec.max_seq_length,
        modality_config=text_only,
        module_output_name="token_embeddings",
    )
    width = encoder.get_embedding_dimension()
    modules = [encoder, Pooling(width, spec.pooling, include_prompt=spec.include_prompt)]
    if spec.dense:
        torch.manual_seed(1)
        modules.append(Dense(modules[1].get_embedding_dimension(), spec.dense))
    model = SentenceTransformer(
        modules=modules + [Normalize()] * spec.normalize,
        prompts=spec.prompts,
        default_prompt_name=spec.default_prompt,
        device="cpu",
    )
    model.save(str(out))
    if spec.lower_case:
        path = out / "sentence_bert_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "do_lower_case": True}))
    return out


@dataclass
class Built:
    directory: Path
    spec: Spec
    # (prompt name or "", normalize) -> sentence-transformers' vectors of TEXTS
    want: dict[tuple[str, bool], torch.Tensor]
    tokens: dict[str, int]  # prompt name or "" -> tokens of TEXTS as ST feeds them


def prompt_names(spec: Spec) -> list[str]:
    return ["", *sorted(spec.prompts)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Built]:
    """Every model built, and sentence-transformers' vectors: all before any service starts
    (building a transformers model changes state compiled code guards on)."""
    from sentence_transformers import SentenceTransformer

    offline()
    root = tmp_path_factory.mktemp("st-models")
    out = {}
    for spec in SPECS:
        directory = build(spec, root)
        st = SentenceTransformer(str(directory), device="cpu", local_files_only=True)
        want, tokens = {}, {}
        for name in prompt_names(spec):
            kw = {"prompt_name": name} if name else {}
            for norm in (True, False):
                vectors = st.encode(TEXTS, normalize_embeddings=norm, batch_size=8, **kw)
                want[name, norm] = torch.tensor(vectors)
            prompt = st._resolve_prompt(None, name or None)
            tokens[name] = int(st.preprocess(TEXTS, prompt=prompt)["attention_mask"].sum())
        out[spec.name] = Built(directory, spec, want, tokens)
    return out


def args(directory: Path, *extra: str) -> list[str]:
    return tiny_args(directory, "none", "--embed-max-batch", "8", *extra)


def matrix(reply: pb.EmbedResponse) -> torch.Tensor:
    return torch.tensor([list(e.values) for e in reply.embeddings])


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min().item() >= 0.9999, cos
    norms = got.norm(dim=-1), want.norm(dim=-1)
    assert torch.allclose(*norms, rtol=1e-4), norms


async def embed_all(c, built: Built) -> dict[tuple[str, bool], pb.EmbedResponse]:
    """Each prompt option, normalised and not, in one call of unequal lengths (padding) with
    the last input past max_seq_length (truncate)."""
    out = {}
    for name in prompt_names(built.spec):
        for norm in (True, False):
            req = pb.EmbedRequest(inputs=TEXTS, truncate=True, prompt_name=name)
            if not norm:
                req.normalize = False
            out[name, norm] = await c.inference.Embed(req)
    return out


@pytest.mark.parametrize("name", [s.name for s in SPECS])
async def test_vectors_equal_sentence_transformers(models, name) -> None:
    built = models[name]
    async with serving(args(built.directory), warm=True) as (_service, c):
        replies = await embed_all(c, built)
        for key, reply in replies.items():
            assert_same(matrix(reply), built.want[key])
            assert reply.usage.prompt_tokens == built.tokens[key[0]], key
        # Alone, each input gets the vector it got in the batch (the padding is not read).
        alone = await c.inference.Embed(pb.EmbedRequest(inputs=TEXTS[1:2], truncate=True))
        assert_same(matrix(alone), built.want["", True][1:2])
        info = await c.inference.Info(pb.InfoRequest())
        (model,) = info.models
        assert set(model.prompt_names) == {"query", "document", *built.spec.prompts}
        assert model.default_prompt_name == (built.spec.default_prompt or "")


async def test_an_unknown_prompt_or_an_input_too_long_is_invalid_argument(models) -> None:
    built = models["mean"]
    async with serving(args(built.directory), warm=True) as (_service, c):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.inference.Embed(pb.EmbedRequest(inputs=["x"], prompt_name="passages"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'passages'; the model declares 'document', 'passage', 'query'" in (
            info.value.details()
        )
        # The prompt's tokens count toward the limit: 16 tokens with "query: " is too many.
        text = "one two three four five six seven eight nine ten eleven twelve thirteen"
        ok = await c.inference.Embed(pb.EmbedRequest(inputs=[text]))
        assert ok.usage.prompt_tokens == 15
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.inference.Embed(pb.EmbedRequest(inputs=[text], prompt_name="query"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "17 tokens with the prompt 'query'; the limit is 16" in info.value.details()


async def test_cli_prompt_name_and_info(models, capsys) -> None:
    """inference-cli embed --prompt-name sends the name: the vectors are ST's with that
    prompt; info lists the prompts."""
    from inference_cli import cli

    built = models["mean"]
    async with serving(args(built.directory), warm=True) as (service, _c):
        addr = ["--addr", f"127.0.0.1:{service.port}"]
        argv = ["embed", *addr, "--prompt-name", "passage", "--truncate", "--json", *TEXTS]
        assert await asyncio.to_thread(cli.main, argv) == cli.EXIT_OK
        reply = json.loads(capsys.readouterr().out)
        got = torch.tensor([e["values"] for e in reply["embeddings"]])
        assert_same(got, built.want["passage", True])
        assert await asyncio.to_thread(cli.main, ["info", *addr]) == cli.EXIT_OK
        assert "    prompts: document, passage, query\n" in capsys.readouterr().out


@pytest.mark.timeout(600)
async def test_compiled_decoder_equals_eager_with_no_late_compile(models) -> None:
    built = models["decoder"]
    async with serving(args(built.directory), warm=True) as (_service, c):
        eager = await embed_all(c, built)
    torch._dynamo.reset()  # counts compile events: graphs of other tests do not count
    compiled = args(built.directory, "--compilation-mode", "default", *TORCH_COMPILE)
    async with serving(compiled, loaded=True) as (_service, c):
        reports = await c.warm_and_serve()
        # One graph for every bucket (dynamic shapes): more would be a bucket recompiled.
        assert [r.compile_events for r in reports if r.step == apb.WARMUP_STEP_KIND_COMPILE] == [1]
        got = await embed_all(c, built)
        for n in (1, 2, 3, 5, 8):  # every batch bucket, short and long rows
            await c.inference.Embed(pb.EmbedRequest(inputs=(TEXTS * 2)[:n], truncate=True))
        info = await c.inference.Info(pb.InfoRequest())
        assert info.late_compile_events == 0, info
    for key, reply in got.items():
        assert torch.allclose(matrix(reply), matrix(eager[key]), atol=1e-4), key


def _refused(model: Path, tmp_path: Path, edit: dict[str, object]) -> str:
    """The load error of ``model`` with the files ``edit`` names rewritten."""
    directory = tmp_path / "model"
    shutil.copytree(model, directory)
    for name, content in edit.items():
        (directory / name).parent.mkdir(exist_ok=True)
        (directory / name).write_text(json.dumps(content))
    ctx = ModelContext(
        "embedding", CompilationMode.NONE, CompileMonitor(), torch.device("cpu"), torch.float32
    )
    with pytest.raises(ValueError) as info:
        load_embedding(ctx, directory)
    return str(info.value)


LEGACY = "sentence_transformers.models."
LAYER_NORM = [
    {"idx": 0, "path": "", "type": LEGACY + "Transformer"},
    {"idx": 1, "path": "1_Pooling", "type": LEGACY + "Pooling"},
    {"idx": 2, "path": "2_LayerNorm", "type": LEGACY + "LayerNorm"},
]
DENSE = {"idx": 2, "path": "2_Dense", "type": LEGACY + "Dense"}
MESSAGE = {
    "text": {"method": "forward", "method_output_name": "last_hidden_state"},
    "message": {"method": "forward", "method_output_name": "last_hidden_state"},
}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"modules.json": LAYER_NORM},
         "module 'sentence_transformers.models.LayerNorm' (2_LayerNorm) is not supported"),
        ({"modules.json": [*LAYER_NORM[:2], DENSE],
          "2_Dense/config.json": {"in_features": 32, "out_features": 8,
                                  "activation_function": "mypackage.Swish"}},
         "Dense activation_function 'mypackage.Swish' is not supported"),
        ({"config.json": {"model_type": "bart"}},
         "encoder-decoder model type 'bart' is not supported for Embed"),
        ({"1_Pooling/config.json": {"pooling_mode": "attention"}},
         "pooling mode 'attention' is not supported"),
        ({"sentence_bert_config.json": {"modality_config": MESSAGE}},
         "chat-template 'message' inputs are not"),
        ({"config_sentence_transformers.json": {"prompts": {"query": "q: "},
                                                "default_prompt_name": "passage"}},
         "default_prompt_name 'passage' is not among the prompts"),
    ],
)  # fmt: skip
def test_what_is_not_supported_is_refused_at_load_by_name(models, tmp_path, edit, message):
    assert message in _refused(models["mean"].directory, tmp_path, edit)
