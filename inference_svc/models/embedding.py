"""The embedding model: a sentence-transformers style encoder with pooling."""

from __future__ import annotations

import enum
import json
import logging
from pathlib import Path

import torch
from torch import Tensor

from inference_svc.compile_monitor import Origin
from inference_svc.models.aoti import AotiGraph, Family
from inference_svc.models.compile import ModelContext
from inference_svc.models.loading import offline
from inference_svc.models.weights import numerics

log = logging.getLogger(__name__)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class Pooling(enum.Enum):
    MEAN = "mean"  # the mean of the token vectors under the attention mask
    CLS = "cls"  # the first token's vector


def pooling_mode(directory: Path) -> Pooling:
    """From sentence-transformers' 1_Pooling/config.json (mean if absent)."""
    cfg = _read_json(directory / "1_Pooling" / "config.json")
    return Pooling.CLS if cfg.get("pooling_mode_cls_token") else Pooling.MEAN


class _Pooled(torch.nn.Module):
    """Encoder + pooling as one module: the graph that gets compiled."""

    def __init__(self, encoder: torch.nn.Module, mode: Pooling) -> None:
        super().__init__()
        self.encoder = encoder
        self.mode = mode

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=torch.zeros_like(input_ids),
        )
        hidden = out.last_hidden_state.float()
        if self.mode is Pooling.CLS:
            return hidden[:, 0]
        mask = attention_mask[..., None].to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


# The encoder's graph family (models/aoti.py): batch and padded length vary.
EMBED = Family(
    "embed",
    lambda a: {"batch": a[0].shape[0], "length": a[0].shape[1]},
    lambda d, a: ({0: d["batch"], 1: d["length"]}, {0: d["batch"], 1: d["length"]}),
)


class EmbeddingModel:
    has_kv_cache = False

    def __init__(
        self,
        ctx: ModelContext,
        pooled: _Pooled,
        tokenizer: object,
        max_input_tokens: int,
        dtype_why: str = "",
    ) -> None:
        self.ctx = ctx
        self.name, self.mode, self.monitor = ctx.name, ctx.mode, ctx.monitor
        self.tokenizer = tokenizer
        self.max_input_tokens = max_input_tokens
        param = next(pooled.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.numerics = numerics(self.dtype, "same", dtype_why)
        self.dimensions = pooled.encoder.config.hidden_size
        self.vocab_size = pooled.encoder.config.vocab_size
        self.pad_id = tokenizer.pad_token_id or 0
        self._forward = ctx.compile(pooled, EMBED)

    @property
    def graphs(self) -> list[AotiGraph]:
        """The graphs that run from AOTInductor packages (none on other backends)."""
        return [self._forward] if isinstance(self._forward, AotiGraph) else []

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text, untruncated (the caller checks the limit)."""
        return [list(ids) for ids in self.tokenizer(texts)["input_ids"]]

    def warm_text(self) -> None:
        """Run the tokenizer once: its first call sets things up lazily."""
        self.tokenize(["warm up", "the text path"])

    def truncate(self, ids: list[int]) -> list[int]:
        """Cut to the limit, keeping the final [SEP] token as the tokenizer would."""
        return ids[: self.max_input_tokens - 1] + ids[-1:]

    @torch.inference_mode()
    def forward(self, ids: Tensor, mask: Tensor, origin: Origin = Origin.REQUEST) -> Tensor:
        shapes = f"batch={ids.shape[0]} len={ids.shape[1]}"
        with self.monitor.context(self.name, f"embed/{origin.value}", shapes):
            return self._forward(ids.to(self.device), mask.to(self.device)).float().cpu()

    def dummy_run(self, batch: int, length: int, gen: torch.Generator) -> Tensor:
        ids = torch.randint(1000, self.vocab_size, (batch, length), generator=gen)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[0, length // 2 :] = 0  # a padded row, as real batches have
        return self.forward(ids, mask, Origin.WARMUP)


def load_embedding(ctx: ModelContext, directory: Path, dtype_why: str = "") -> EmbeddingModel:
    """The sentence-embedding model in ``directory``, in ``ctx.dtype`` (``dtype_why``: why
    --embed-dtype auto chose it, "" when it was named)."""
    from transformers import AutoModel, AutoTokenizer

    offline()
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    encoder = AutoModel.from_pretrained(str(directory), local_files_only=True, dtype=ctx.dtype)
    st_limit = _read_json(directory / "sentence_bert_config.json").get("max_seq_length")
    limit = int(st_limit or encoder.config.max_position_embeddings)
    limit = min(limit, encoder.config.max_position_embeddings)
    pooled = _Pooled(encoder, pooling_mode(directory)).to(ctx.device).eval()
    return EmbeddingModel(ctx, pooled, tokenizer, limit, dtype_why)
