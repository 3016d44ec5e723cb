"""The generative model: tokenizer, Llama forward passes, the static KV cache."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from inference_api.plan import Bucket, CompilationMode, Phase
from inference_svc.compile_monitor import CompileMonitor, Origin
from inference_svc.limits import GenLimits
from inference_svc.models.compile import batch_buckets, bucket_for, compile_fn, length_buckets
from inference_svc.models.llama import LlamaLM, LlamaShape
from inference_svc.models.loading import load_causal_lm_parts
from inference_svc.models.weights import convert_linears, numerics

log = logging.getLogger(__name__)


class _Prefill(torch.nn.Module):
    """The LM's prefill as a module of its own (see GenerativeModel.__init__)."""

    def __init__(self, lm: LlamaLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, *args: Tensor | list[Tensor]) -> Tensor:
        return self.lm.prefill(*args)


class _Decode(torch.nn.Module):
    """The LM's decode step as a module of its own (see GenerativeModel.__init__)."""

    def __init__(self, lm: LlamaLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, *args: Tensor | list[Tensor]) -> Tensor:
        return self.lm.decode(*args)


SUPPORTED_ARCHITECTURES = ("llama",)


class GenerativeModel:
    has_kv_cache = True

    def __init__(
        self,
        name: str,
        lm: LlamaLM,
        tokenizer: object,
        limits: GenLimits,
        mode: CompilationMode,
        monitor: CompileMonitor,
        eos_ids: frozenset[int],
        weights: str = "same",
    ) -> None:
        self.name = name
        self.lm = lm
        self.tokenizer = tokenizer
        self.limits = limits
        self.mode = mode
        self.monitor = monitor
        self.eos_ids = eos_ids
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else min(eos_ids)
        param = next(lm.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.numerics = numerics(self.dtype, weights)
        self.batch_buckets = batch_buckets(limits.max_batch, mode)
        # A prompt is prefilled in chunks of at most prefill_chunk tokens, each padded to
        # a chunk bucket; every forward attends to a context bucket of its row's slots.
        # Chunk buckets step by 16 tokens, not by powers of two: prefill costs what it
        # computes, and a 38-token prompt padded to 64 would pay 68 % more than at 48.
        chunk = min(limits.prefill_chunk, limits.max_input_tokens)
        self.chunk_buckets = tuple(sorted({*range(16, chunk, 16), chunk}))
        self.context_buckets = length_buckets(limits.max_seq_len, smallest=32)
        self.request_shapes: set[Bucket] = set()  # what requests ran (tests check vs Describe)
        # Mark the varying dimensions dynamic before each compiled call (see _vary). Off when
        # the graphs came from kept artifacts: torch 2.13 saves their guards as if nothing
        # had been marked, and a marked input then fails them ("_has_dynamo_dim_marking is
        # present on runtime tensor but was absent at compile time").
        self.mark_dynamic = True
        # Compiled as modules of their own, not as bound methods: a restart did not reuse a
        # bound method's kept Dynamo package (engine/artifacts.py), a module's forward it
        # does. One class each: torch keys a package on the function's qualified name.
        self._prefill = compile_fn(_Prefill(lm), mode)
        self._decode = compile_fn(_Decode(lm), mode)
        # One [rows, kv_heads, slots, head_dim] tensor per layer (None until sized).
        self.k_cache: list[Tensor] | None = None
        self.v_cache: list[Tensor] | None = None

    # -- cache -------------------------------------------------------------
    @property
    def cache_rows(self) -> int:
        return 0 if self.k_cache is None else self.k_cache[0].shape[0] - 1

    @property
    def kv_cache_tokens(self) -> int:
        return self.cache_rows * self.limits.max_seq_len

    def allocate_cache(self, tokens: int) -> int:
        """Allocate a cache of ``tokens`` slots (whole sequences); returns rows."""
        fits = min(tokens // self.limits.max_seq_len, self.limits.max_batch)
        # Whole batch buckets only: every row of the cache is reachable by a decode bucket.
        rows = max((b for b in self.batch_buckets if b <= fits), default=fits)
        if rows < 2:
            need = 2 * self.limits.max_seq_len
            raise ValueError(
                f"a KV cache of {tokens} tokens holds fewer than 2 sequences of "
                f"{self.limits.max_seq_len} tokens; give at least {need} "
                "(--kv-cache-tokens) or lower --max-input-tokens/--max-new-tokens"
            )
        s = self.lm.shape
        # Rows first: a batch's rows, cache[:b], are one contiguous block of each layer.
        # One row and one slot more than any batch or context bucket: a compiled graph
        # sees views of this tensor (and guards on its base's sizes), so no view's batch or
        # context may equal the base's, or the graph specialises on that equality.
        dims = (rows + 1, s.num_kv_heads, self.limits.max_seq_len + 1, s.head_dim)
        opts = {"dtype": self.dtype, "device": self.device}
        self.k_cache = [torch.zeros(dims, **opts) for _ in range(s.num_layers)]
        self.v_cache = [torch.zeros(dims, **opts) for _ in range(s.num_layers)]
        log.info("model %s: KV cache %d rows x %d slots", self.name, rows, dims[2] - 1)
        return rows

    def kv_bytes_per_token(self) -> int:
        return self.lm.shape.kv_bytes_per_token(self.dtype)

    def usable_batch_buckets(self) -> tuple[int, ...]:
        return tuple(b for b in self.batch_buckets if b <= max(self.cache_rows, 2))

    def batch_bucket(self, rows: int) -> int:
        """The batch a step over cache rows [0, rows) runs at (decode and the sampler)."""
        return bucket_for(rows, self.usable_batch_buckets())

    # -- text --------------------------------------------------------------
    def encode(self, prompt: str, messages: list[dict[str, str]]) -> list[int]:
        tok = self.tokenizer
        if messages:
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return [int(i) for i in ids]
        return [int(i) for i in tok(prompt)["input_ids"]]

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def warm_text(self) -> None:
        """Run the text path once (tokenizer, chat template, decoding): its first call
        sets things up lazily, and that first call should not be a request's."""
        ids = self.encode("warm up", [])
        ids += self.encode("", [{"role": "user", "content": "warm up"}])
        self.detokenize(ids)
        self.token_text(ids[0])

    # -- forward passes ----------------------------------------------------
    def chunk_shape(self, start: int, n: int) -> Bucket:
        """The padded shape of a prefill chunk of ``n`` tokens written from slot ``start``."""
        width = bucket_for(n, self.chunk_buckets)
        context = bucket_for(min(start + width, self.limits.max_seq_len), self.context_buckets)
        return Bucket(Phase.PREFILL, 1, width, context)

    def decode_shape(self, rows: int, top: int) -> Bucket:
        """The padded shape of a decode step over cache rows [0, rows) whose highest
        written slot is ``top``."""
        batch = self.batch_bucket(rows)
        return Bucket(Phase.DECODE, batch, 1, bucket_for(top + 1, self.context_buckets))

    @torch.inference_mode()
    def prefill(self, row: int, ids: list[int], start: int, origin: Origin) -> Tensor:
        """Write one chunk of a prompt into cache ``row`` from slot ``start``; returns the
        logits [1, vocab] after its last token. The chunk is right-padded to a chunk bucket;
        the padding writes the next free slot, which the next chunk or decode overwrites."""
        shape = self.chunk_shape(start, len(ids))
        width, slots = shape.seq_len, self.limits.max_seq_len
        tokens = torch.full((1, width), self.pad_id, dtype=torch.long)
        tokens[0, : len(ids)] = torch.tensor(ids)
        positions = (torch.arange(width) + start).clamp(max=slots - 1)[None]
        last = torch.tensor([len(ids) - 1])
        keys, values = self._view(slice(row, row + 1), shape.context_len)
        d = self.device
        with self.monitor.context(self.name, f"prefill/{origin.value}", str(shape)):
            self._seen(shape, origin)
            tokens, positions = tokens.to(d), positions.to(d)
            self._vary(tokens, positions, dim=1)  # the chunk's width
            return self._prefill(tokens, positions, last.to(d), keys, values)

    @torch.inference_mode()
    def decode(self, tokens: Tensor, positions: list[int], origin: Origin) -> Tensor:
        """One token for each cache row [0, B): ``tokens`` [B], written at ``positions``
        (one per row; padding rows give a slot nobody attends to). Logits [B, vocab]."""
        shape = self.decode_shape(len(positions), max(positions))
        pad = shape.batch_size - len(positions)
        ids = torch.cat([tokens.cpu(), torch.full((pad,), self.pad_id)])[:, None]
        pos = torch.tensor(positions + [0] * pad)[:, None]
        d = self.device
        with self.monitor.context(self.name, f"decode/{origin.value}", str(shape)):
            self._seen(shape, origin)
            ids, pos = ids.to(d), pos.to(d)
            slots = torch.arange(shape.context_len, device=d)
            self._vary(ids, pos, dim=0)  # the batch
            if self.mode is not CompilationMode.NONE and self.mark_dynamic:
                torch._dynamo.maybe_mark_dynamic(slots, 0)  # the context
            return self._decode(ids, pos, slots, self.k_cache, self.v_cache)

    def _vary(self, ids: Tensor, positions: Tensor, dim: int) -> None:
        """Mark the dimension that varies between buckets as dynamic: its own symbol, never
        merged with another dimension that happens to have the same size in the first
        compile (torch's "duck sizing" would merge a 64-token chunk with head_dim 64)."""
        if self.mode is not CompilationMode.NONE and self.mark_dynamic:
            torch._dynamo.maybe_mark_dynamic(ids, dim)
            torch._dynamo.maybe_mark_dynamic(positions, dim)

    def _seen(self, shape: Bucket, origin: Origin) -> None:
        if origin is Origin.REQUEST:
            self.request_shapes.add(shape)

    def _view(self, rows: slice, context: int) -> tuple[list[Tensor], list[Tensor]]:
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not allocated"
        return (
            [k[rows, :, :context] for k in self.k_cache],
            [v[rows, :, :context] for v in self.v_cache],
        )

    def dummy_prefill(self, width: int, context: int, gen: torch.Generator) -> Tensor:
        """A prefill chunk of random tokens at this shape, into row 0 (warmup, profiling)."""
        ids = torch.randint(0, self.lm.shape.vocab_size, (width,), generator=gen).tolist()
        start = max(0, min(context, self.limits.max_seq_len) - width)
        return self.prefill(0, ids, start, Origin.WARMUP)

    def dummy_decode(self, batch: int, context: int, gen: torch.Generator) -> Tensor:
        """A decode step at this shape: rows at random slots, the highest at the last one."""
        tokens = torch.randint(0, self.lm.shape.vocab_size, (batch,), generator=gen)
        positions = torch.randint(0, context, (batch,), generator=gen).tolist()
        positions[0] = context - 1
        return self.decode(tokens, positions, Origin.WARMUP)


def load_generative(
    name: str,
    directory: Path,
    limits: GenLimits,
    mode: CompilationMode,
    monitor: CompileMonitor,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: Path | None = None,
    weights: str = "same",
) -> GenerativeModel:
    config, state, tokenizer = load_causal_lm_parts(directory, cache_dir)
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model type {config.model_type!r} is not supported for Generate "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    shape = LlamaShape.from_hf(config)
    if limits.max_seq_len > shape.max_positions:
        raise ValueError(
            f"max input + max new tokens = {limits.max_seq_len} exceeds the model's "
            f"{shape.max_positions} positions"
        )
    if shape.tie_embeddings:
        state.pop("lm_head.weight", None)
    lm, missing = LlamaLM.from_state(shape, state)
    if missing:
        raise ValueError(f"weights do not fit: missing {missing[:5]}")
    del state
    lm = lm.to(device=device, dtype=dtype).eval()
    convert_linears(lm, weights)
    eos = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(config, "eos_token_id", None), "__iter__", None)
    if gen_eos is not None:
        eos.update(config.eos_token_id)
    elif config.eos_token_id is not None:
        eos.add(config.eos_token_id)
    eos.discard(None)
    return GenerativeModel(name, lm, tokenizer, limits, mode, monitor, frozenset(eos), weights)
