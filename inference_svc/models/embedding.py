"""The embedding model: a sentence-transformers pipeline (models/embed_st.py reads what the
directory declares) run as one module: the transformers encoder, the pooling, Dense, Normalize."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from inference_svc.compile_monitor import Origin
from inference_svc.models.aoti import AotiGraph, Family
from inference_svc.models.compile import ModelContext
from inference_svc.models.embed_st import StConfig, pool, read_st_config
from inference_svc.models.loading import offline
from inference_svc.models.weights import numerics

log = logging.getLogger(__name__)


class _Pooled(torch.nn.Module):
    """Encoder, pooling, Dense and Normalize as one module: the graph that gets compiled."""

    def __init__(self, encoder: torch.nn.Module, st: StConfig) -> None:
        super().__init__()
        self.encoder = encoder
        self.modes = st.pooling
        self.dense = torch.nn.ModuleList(d.build() for d in st.dense)
        self.normalize = st.normalize
        params = inspect.signature(encoder.forward).parameters
        self.type_ids = "token_type_ids" in params  # BERT-style encoders; decoders take none
        self.no_cache = "use_cache" in params  # decoders: no KV cache built for one pass

    def forward(self, input_ids: Tensor, attention_mask: Tensor, pooled: Tensor) -> Tensor:
        """``pooled``: the tokens pooled (``attention_mask`` less a prompt left out)."""
        extra: dict[str, object] = {}
        if self.type_ids:
            extra["token_type_ids"] = torch.zeros_like(input_ids)
        if self.no_cache:
            extra["use_cache"] = False
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra)
        vectors = pool(out.last_hidden_state.float(), attention_mask, pooled, self.modes)
        for dense in self.dense:
            vectors = dense(vectors.to(dense.linear.weight.dtype))
        return F.normalize(vectors, p=2, dim=-1) if self.normalize else vectors


# The encoder's graph family (models/aoti.py): batch and padded length vary.
def _embed_shapes(d: dict, a: tuple) -> tuple[dict, ...]:
    return tuple({0: d["batch"], 1: d["length"]} for _ in a)


EMBED = Family("embed", lambda a: {"batch": a[0].shape[0], "length": a[0].shape[1]}, _embed_shapes)


class EmbeddingModel:
    has_kv_cache = False

    def __init__(
        self,
        ctx: ModelContext,
        pooled: _Pooled,
        tokenizer: object,
        max_input_tokens: int,
        dtype_why: str = "",
        st: StConfig | None = None,
    ) -> None:
        self.ctx = ctx
        self.name, self.mode, self.monitor = ctx.name, ctx.mode, ctx.monitor
        self.tokenizer = tokenizer
        self.max_input_tokens = max_input_tokens
        self.st = st or StConfig()
        param = next(pooled.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.numerics = numerics(self.dtype, "same", dtype_why)
        width = pooled.encoder.config.hidden_size * len(self.st.pooling)
        self.dimensions = self.st.dense[-1].out_features if self.st.dense else width
        self.vocab_size = pooled.encoder.config.vocab_size
        self.pad_id = tokenizer.pad_token_id or 0
        self.left_padded = tokenizer.padding_side == "left"
        # Tokens of each prompt left out of the pooling (include_prompt false), counted as
        # sentence-transformers counts them: the prompt alone, less a trailing special token.
        self.prompt_skip = {
            text: 0 if self.st.include_prompt or not text else self._prompt_length(text)
            for text in self.st.prompts.values()
        }
        self._forward = ctx.compile(pooled, EMBED)

    @property
    def graphs(self) -> list[AotiGraph]:
        """The graphs that run from AOTInductor packages (none on other backends)."""
        return [self._forward] if isinstance(self._forward, AotiGraph) else []

    def _prompt_length(self, prompt: str) -> int:
        ids = self.tokenize([prompt], truncate=True)[0]
        special = set(self.tokenizer.all_special_ids)
        return len(ids) - 1 if ids and ids[-1] in special else len(ids)

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids per text; ``truncate``: cut to the limit as the tokenizer cuts (its
        special tokens kept), as sentence-transformers does."""
        if not truncate:
            return [list(ids) for ids in self.tokenizer(texts)["input_ids"]]
        out = self.tokenizer(texts, truncation=True, max_length=self.max_input_tokens)
        return [list(ids) for ids in out["input_ids"]]

    def warm_text(self) -> None:
        """Run the tokenizer once: its first call sets things up lazily."""
        self.tokenize(["warm up", "the text path"])
        self.tokenize(["warm up the truncating path"], truncate=True)

    def batch(
        self, rows: list[list[int]], skips: list[int], batch: int, length: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``rows`` padded to (batch, length) on the tokenizer's side: ids, the attention
        mask, and the pooled mask (each row's first ``skips[i]`` tokens left out). Rows past
        ``rows`` are padding: one visible token each, never read back."""
        ids = torch.full((batch, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros(batch, length, dtype=torch.long)
        pooled = torch.zeros(batch, length, dtype=torch.long)
        for i, (r, skip) in enumerate(zip(rows, skips, strict=True)):
            start = length - len(r) if self.left_padded else 0
            ids[i, start : start + len(r)] = torch.tensor(r)
            mask[i, start : start + len(r)] = 1
            pooled[i, start + skip : start + len(r)] = 1
        edge = -1 if self.left_padded else 0
        mask[len(rows) :, edge] = 1
        pooled[len(rows) :, edge] = 1
        return ids, mask, pooled

    @torch.inference_mode()
    def forward(
        self,
        ids: Tensor,
        mask: Tensor,
        origin: Origin = Origin.REQUEST,
        pooled: Tensor | None = None,
    ) -> Tensor:
        shapes = f"batch={ids.shape[0]} len={ids.shape[1]}"
        pooled = mask if pooled is None else pooled
        with self.monitor.context(self.name, f"embed/{origin.value}", shapes):
            args = (ids.to(self.device), mask.to(self.device), pooled.to(self.device))
            return self._forward(*args).float().cpu()

    def dummy_run(self, batch: int, length: int, gen: torch.Generator) -> Tensor:
        ids = torch.randint(1000, self.vocab_size, (batch, length), generator=gen).tolist()
        rows = [ids[0][: max(1, length // 2)], *ids[1:]]  # a padded row, as real batches have
        skips = [0] * batch
        if batch > 1:
            skips[1] = 1  # a row with a prompt left out of the pooling
        t_ids, mask, pooled = self.batch(rows, skips, batch, length)
        return self.forward(t_ids, mask, Origin.WARMUP, pooled)


def _lowercase(tokenizer: object) -> None:
    """do_lower_case: lowercase in the tokenizer's normalizer, as sentence-transformers does."""
    from tokenizers.normalizers import Lowercase
    from tokenizers.normalizers import Sequence as NormalizerSequence

    backend = tokenizer.backend_tokenizer
    normalizer = backend.normalizer
    if normalizer is not None and "Lowercase" in repr(normalizer):
        return
    chain = [Lowercase()]
    if isinstance(normalizer, NormalizerSequence):
        chain += list(normalizer)
    elif normalizer is not None:
        chain.append(normalizer)
    backend.normalizer = NormalizerSequence(chain)


# Encoder-decoder models whose encoder alone embeds (sentence-T5, GTR), as
# sentence-transformers loads them.
ENCODER_ONLY = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}


def _encoder_class(config: object) -> type:
    import transformers

    kind = config.model_type
    if kind in ENCODER_ONLY:  # saved whole, or as its encoder alone (is_encoder_decoder off)
        return getattr(transformers, ENCODER_ONLY[kind])
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"encoder-decoder model type {kind!r} is not supported for Embed (encoders of: "
            f"{', '.join(ENCODER_ONLY)})"
        )
    return transformers.AutoModel


def load_embedding(ctx: ModelContext, directory: Path, dtype_why: str = "") -> EmbeddingModel:
    """The sentence-embedding model in ``directory``, in ``ctx.dtype`` (``dtype_why``: why
    --embed-dtype auto chose it, "" when it was named). ValueError, before any weights are
    read, for what the directory declares and is not supported (models/embed_st.py)."""
    from transformers import AutoConfig, AutoTokenizer

    offline()
    st = read_st_config(directory)
    kwargs = dict(st.tokenizer_kwargs)
    if st.max_seq_length and "model_max_length" not in kwargs:
        kwargs["model_max_length"] = int(st.max_seq_length)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **kwargs)
    if st.do_lower_case:
        _lowercase(tokenizer)
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    encoder = _encoder_class(config).from_pretrained(
        str(directory), local_files_only=True, dtype=ctx.dtype
    )
    positions = getattr(encoder.config, "max_position_embeddings", None) or 2**31
    limit = min(int(tokenizer.model_max_length), positions)
    pooled = _Pooled(encoder, st).to(ctx.device).eval()
    return EmbeddingModel(ctx, pooled, tokenizer, limit, dtype_why, st)
