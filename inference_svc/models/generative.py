"""The generative model: tokenizer, Llama forward passes, the static KV cache."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from inference_api.plan import CompilationMode
from inference_svc.compile_monitor import CompileMonitor, Origin
from inference_svc.limits import GenLimits
from inference_svc.models.compile import batch_buckets, compile_fn, length_buckets
from inference_svc.models.llama import LlamaLM, LlamaShape
from inference_svc.models.loading import load_causal_lm_parts

log = logging.getLogger(__name__)
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
        self.batch_buckets = batch_buckets(limits.max_batch, mode)
        self.prefill_buckets = length_buckets(limits.max_input_tokens)
        self._prefill = compile_fn(lm.prefill, mode)
        self._decode = compile_fn(lm.decode, mode)
        # One [rows, kv_heads, slots, head_dim] tensor per layer (None until sized).
        self.k_cache: list[Tensor] | None = None
        self.v_cache: list[Tensor] | None = None

    # -- cache -------------------------------------------------------------
    @property
    def cache_rows(self) -> int:
        return 0 if self.k_cache is None else self.k_cache[0].shape[0]

    @property
    def kv_cache_tokens(self) -> int:
        return self.cache_rows * self.limits.max_seq_len

    def allocate_cache(self, tokens: int) -> int:
        """Allocate a cache of ``tokens`` slots (whole sequences); returns rows."""
        rows = min(tokens // self.limits.max_seq_len, self.limits.max_batch)
        if rows < 2:
            need = 2 * self.limits.max_seq_len
            raise ValueError(
                f"a KV cache of {tokens} tokens holds fewer than 2 sequences of "
                f"{self.limits.max_seq_len} tokens; give at least {need} "
                "(--kv-cache-tokens) or lower --max-input-tokens/--max-new-tokens"
            )
        s = self.lm.shape
        # Rows first: a batch's rows, cache[:b], are one contiguous block of each layer.
        dims = (rows, s.num_kv_heads, self.limits.max_seq_len, s.head_dim)
        opts = {"dtype": self.dtype, "device": self.device}
        self.k_cache = [torch.zeros(dims, **opts) for _ in range(s.num_layers)]
        self.v_cache = [torch.zeros(dims, **opts) for _ in range(s.num_layers)]
        log.info("model %s: KV cache %d rows x %d slots", self.name, rows, dims[2])
        return rows

    def kv_bytes_per_token(self) -> int:
        return self.lm.shape.kv_bytes_per_token(self.dtype)

    def usable_batch_buckets(self) -> tuple[int, ...]:
        return tuple(b for b in self.batch_buckets if b <= max(self.cache_rows, 2))

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
    @torch.inference_mode()
    def prefill(self, ids: Tensor, positions: Tensor, valid: Tensor, origin: Origin) -> Tensor:
        shapes = f"batch={ids.shape[0]} len={ids.shape[1]}"
        with self.monitor.context(self.name, f"prefill/{origin.value}", shapes):
            keys, values = self._rows(ids.shape[0])
            return self._prefill(ids, positions, valid, keys, values)

    @torch.inference_mode()
    def decode(
        self, ids: Tensor, positions: Tensor, slot: Tensor, valid: Tensor, origin: Origin
    ) -> Tensor:
        shapes = f"batch={ids.shape[0]} slot={int(slot[0])}"
        with self.monitor.context(self.name, f"decode/{origin.value}", shapes):
            keys, values = self._rows(ids.shape[0])
            return self._decode(ids, positions, slot, valid, keys, values)

    def _rows(self, batch: int) -> tuple[list[Tensor], list[Tensor]]:
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not allocated"
        return [k[:batch] for k in self.k_cache], [v[:batch] for v in self.v_cache]

    def dummy_prefill(self, batch: int, length: int, gen: torch.Generator) -> Tensor:
        """A prefill of random tokens at this padded shape (warmup, profiling)."""
        ids = torch.randint(0, self.lm.shape.vocab_size, (batch, length), generator=gen)
        valid = torch.ones(batch, length, dtype=torch.bool)
        valid[0, : length // 2] = False  # a left-padded row, as real batches have
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        d = self.device
        return self.prefill(ids.to(d), positions.to(d), valid.to(d), Origin.WARMUP)

    def dummy_decode(self, batch: int, gen: torch.Generator) -> Tensor:
        slots = self.limits.max_seq_len
        ids = torch.randint(0, self.lm.shape.vocab_size, (batch, 1), generator=gen)
        slot = torch.tensor([slots // 2], dtype=torch.long)
        valid = torch.zeros(batch, slots, dtype=torch.bool)
        valid[:, : slots // 2 + 1] = True
        positions = torch.full((batch, 1), slots // 2, dtype=torch.long)
        d = self.device
        return self.decode(ids.to(d), positions.to(d), slot.to(d), valid.to(d), Origin.WARMUP)


def load_generative(
    name: str,
    directory: Path,
    limits: GenLimits,
    mode: CompilationMode,
    monitor: CompileMonitor,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: Path | None = None,
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
    lm = LlamaLM(shape)
    if shape.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = lm.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (shape.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    lm.tie_weights()
    del state
    lm = lm.to(device=device, dtype=dtype).eval()
    eos = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(config, "eos_token_id", None), "__iter__", None)
    if gen_eos is not None:
        eos.update(config.eos_token_id)
    elif config.eos_token_id is not None:
        eos.add(config.eos_token_id)
    eos.discard(None)
    return GenerativeModel(name, lm, tokenizer, limits, mode, monitor, frozenset(eos))
