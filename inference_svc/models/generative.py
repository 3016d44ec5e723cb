"""The generative model: tokenizer, Llama forward passes, the static KV cache."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import Tensor

from inference_api.plan import Bucket, CompilationMode
from inference_svc.compile_monitor import Origin
from inference_svc.limits import GenLimits
from inference_svc.models import cpu, hugepages
from inference_svc.models.aoti import AotiGraph, Family
from inference_svc.models.compile import ModelContext
from inference_svc.models.decoder_shape import text_decoder
from inference_svc.models.llama import LlamaLM, LlamaShape
from inference_svc.models.loading import load_causal_lm_parts, own_memory
from inference_svc.models.weights import convert_linears, dtype_name, numerics

log = logging.getLogger(__name__)


class _Prefill(torch.nn.Module):
    """The LM's prefill as a module of its own (see GenerativeModel.__init__)."""

    def __init__(self, lm: LlamaLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, *args: Tensor | list[Tensor]) -> Tensor:
        return self.lm.prefill(*args)


class _Decode(_Prefill):
    """The LM's decode step as a module of its own: a class of its own, since torch keys a
    kept Dynamo package on the forward's qualified name."""

    def forward(self, *args: Tensor | list[Tensor]) -> Tensor:
        return self.lm.decode(*args)


def _by_rows(caches: list[Tensor], rows: object) -> list[dict[int, object]]:
    """Each layer's cache tensor varies in its rows (PROFILE sizes the cache)."""
    return [{0: rows} for _ in caches]


# The LM's graph families (models/aoti.py): what varies between buckets, and where.
PREFILL = Family(
    "prefill",
    lambda a: {"chunk": a[0].shape[1], "context": a[4].shape[0], "rows": a[5][0].shape[0]},
    lambda d, a: {"args": (
        {1: d["chunk"]}, {1: d["chunk"]}, None, None, {0: d["context"]},
        _by_rows(a[5], d["rows"]), _by_rows(a[6], d["rows"]),
    )},
)  # fmt: skip
DECODE = Family(
    "decode",
    lambda a: {"batch": a[0].shape[0], "context": a[2].shape[0], "rows": a[3][0].shape[0]},
    lambda d, a: {"args": (
        {0: d["batch"]}, {0: d["batch"]}, {0: d["context"]},
        _by_rows(a[3], d["rows"]), _by_rows(a[4], d["rows"]),
    )},
)  # fmt: skip


class GenerativeModel:
    """The LM, its tokenizer and its static KV cache; forward passes at shapes the caller
    chose and padded (engine/runner.py, from the model's buckets)."""

    has_kv_cache = True

    def __init__(
        self,
        ctx: ModelContext,
        lm: LlamaLM,
        tokenizer: object,
        limits: GenLimits,
        eos_ids: frozenset[int],
        weights: str = "same",
        weights_why: str = "",
        linear: str = "torch",
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.ctx = ctx
        self.name, self.mode, self.monitor = ctx.name, ctx.mode, ctx.monitor
        self.lm = lm
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_ids = eos_ids
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else min(eos_ids)
        param = next(lm.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache_dtype = cache_dtype or self.dtype  # the KV cache's (--kv-cache-dtype)
        self.numerics = numerics(self.dtype, weights, weights_why, linear, self.cache_dtype)
        # Mark the varying dimensions dynamic before each compiled call (see _vary). Off when
        # the graphs came from kept artifacts: torch 2.13 saves their guards as if nothing
        # had been marked, and a marked input then fails them ("_has_dynamo_dim_marking is
        # present on runtime tensor but was absent at compile time").
        self.mark_dynamic = True
        # Compiled as modules of their own, not as bound methods: a restart did not reuse a
        # bound method's kept Dynamo package (engine/artifacts.py), a module's forward it
        # does. One class each: torch keys a package on the function's qualified name.
        self._prefill = ctx.compile(_Prefill(lm), PREFILL)
        self._decode = ctx.compile(_Decode(lm), DECODE)
        self._aranges: dict[int, Tensor] = {}  # arange(context) per context bucket (_slots)
        # One [rows, kv_heads, slots, head_dim] tensor per layer (None until sized).
        self.k_cache: list[Tensor] | None = None
        self.v_cache: list[Tensor] | None = None
        self.cache_pages = ""  # how the cache is allocated (hugepages.zeros)

    @property
    def graphs(self) -> list[AotiGraph]:
        """The graphs that run from AOTInductor packages (none on other backends)."""
        return [g for g in (self._prefill, self._decode) if isinstance(g, AotiGraph)]

    def set_ranges(self, ranges: dict[str, tuple[int, int]]) -> None:
        """What packages are exported for: the span of the runtime's buckets (batch, chunk,
        context); the cache's rows are one more than any batch (see allocate_cache)."""
        lo, hi = ranges["batch"]
        rows = (max(lo, 2) + 1, hi + 1)
        for g in self.graphs:
            dims = ("chunk", "context") if g.graph == "prefill" else ("batch", "context")
            g.ranges = {d: ranges[d] for d in dims} | {"rows": rows}

    # -- cache -------------------------------------------------------------
    @property
    def cache_rows(self) -> int:
        return 0 if self.k_cache is None else self.k_cache[0].shape[0] - 1

    @property
    def kv_cache_tokens(self) -> int:
        return self.cache_rows * self.limits.max_seq_len

    def allocate_cache(self, rows: int) -> None:
        """A cache of ``rows`` sequences of ``max_seq_len`` slots each."""
        s = self.lm.shape
        # Rows first: a batch's rows, cache[:b], are one contiguous block of each layer.
        # One row and one slot more than any batch or context bucket: a compiled graph
        # sees views of this tensor (and guards on its base's sizes), so no view's batch or
        # context may equal the base's, or the graph specialises on that equality.
        dims = (rows + 1, s.num_kv_heads, self.limits.max_seq_len + 1, s.head_dim)
        self.k_cache = self.v_cache = None  # the old cache freed before the new one is made
        # Normal tensors, not inference tensors (the compute thread runs under inference
        # mode): torch.export traces the in-place cache writes outside it (models/aoti.py).
        with torch.inference_mode(False):
            if self.device.type == "cpu":  # in huge pages where the kernel gives them
                both, how = hugepages.zeros(2 * s.num_layers, dims, self.cache_dtype)
            else:
                both = [torch.zeros(dims, dtype=self.cache_dtype, device=self.device)
                        for _ in range(2 * s.num_layers)]  # fmt: skip
                how = str(self.device)
        self.k_cache, self.v_cache = both[: s.num_layers], both[s.num_layers :]
        self.cache_pages = how
        log.info("model %s: KV cache %d rows x %d slots, %s, %s", self.name, rows, dims[2] - 1,
                 dtype_name(self.cache_dtype), how)  # fmt: skip

    def free_cache(self) -> None:
        self.k_cache = self.v_cache = None

    def kv_bytes_per_token(self) -> int:
        return self.lm.shape.kv_bytes_per_token(self.cache_dtype)

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
    def prefill(
        self, row: int, tokens: Tensor, positions: Tensor, last: Tensor, shape: Bucket,
        origin: Origin,
    ) -> Tensor:  # fmt: skip
        """Write a padded chunk ``tokens`` [1, width] at ``positions`` into cache ``row``,
        attending to ``shape.context_len`` slots; the logits [1, vocab] at index ``last``."""
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not allocated"
        d = self.device
        with self.monitor.context(self.name, f"prefill/{origin.value}", str(shape)):
            tokens, positions = tokens.to(d), positions.to(d)
            slots = self._slots(shape.context_len)
            which = torch.tensor([row], device=d)
            if self._marks(self._prefill):
                self._vary(tokens, positions, dim=1)  # the chunk's width
                self._vary_context(slots)
            return self._prefill(
                tokens, positions, last.to(d), which, slots, self.k_cache, self.v_cache
            )

    @torch.inference_mode()
    def decode(self, ids: Tensor, positions: Tensor, shape: Bucket, origin: Origin) -> Tensor:
        """One token for each cache row [0, B): ``ids`` [B, 1] written at ``positions``
        [B, 1], each row attending to ``shape.context_len`` slots. Logits [B, vocab]."""
        d = self.device
        with self.monitor.context(self.name, f"decode/{origin.value}", str(shape)):
            ids, positions = ids.to(d), positions.to(d)
            slots = self._slots(shape.context_len)
            if self._marks(self._decode):
                self._vary(ids, positions, dim=0)  # the batch
                self._vary_context(slots)
            return self._decode(ids, positions, slots, self.k_cache, self.v_cache)

    def _slots(self, context: int) -> Tensor:
        """arange(context): one tensor per context bucket, made once (no graph writes it)."""
        slots = self._aranges.get(context)
        if slots is None:
            slots = self._aranges[context] = torch.arange(context, device=self.device)
        return slots

    def _marks(self, graph: object) -> bool:
        """Whether a call of ``graph`` marks its varying dimensions: only where Dynamo may
        run (a package's ranges are fixed at export; the first call, which may fall back to
        torch.compile, and a fallback do mark)."""
        if self.mode is CompilationMode.NONE or not self.mark_dynamic:
            return False
        return not isinstance(graph, AotiGraph) or graph.source not in ("loaded", "built")

    def _vary(self, ids: Tensor, positions: Tensor, dim: int) -> None:
        """Mark the dimension that varies between buckets as dynamic: its own symbol, never
        merged with another dimension that happens to have the same size in the first
        compile (torch's "duck sizing" would merge a 64-token chunk with head_dim 64)."""
        torch._dynamo.maybe_mark_dynamic(ids, dim)
        torch._dynamo.maybe_mark_dynamic(positions, dim)

    def _vary_context(self, slots: Tensor) -> None:
        torch._dynamo.maybe_mark_dynamic(slots, 0)  # the context


def load_generative(
    ctx: ModelContext,
    directory: Path,
    limits: GenLimits,
    cache_dir: Path | None = None,
    weights: str = "same",
    weights_why: str = "",
    attention: str = "sdpa",
    linear: str = "torch",
    kv_cache: str = "same",
) -> GenerativeModel:
    """The LM in ``directory``, its linears in ``weights`` (a concrete scheme; ``weights_why``
    is why --lm-weights auto chose it, "" when it was named) run by ``linear`` "torch" or
    "native"; its decode step's ``attention`` "native" (this project's kernel:
    inference_svc/kernels) or "sdpa"; its KV cache in ``kv_cache`` (--kv-cache-dtype)."""
    config, state, tokenizer = load_causal_lm_parts(directory, cache_dir)
    text, state = text_decoder(config, state)  # Gemma 3's text model
    shape = LlamaShape.from_hf(text)  # ValueError for an architecture not supported
    shape.check_length(limits.max_seq_len)  # ValueError naming the limit and the rope type
    if shape.tie_embeddings:
        state.pop("lm_head.weight", None)
    lm, missing = LlamaLM.from_state(shape, state)
    if missing:
        raise ValueError(f"weights do not fit: missing {missing[:5]}")
    del state
    lm = lm.to(device=ctx.device, dtype=ctx.dtype).eval()
    lm.fuse()  # after the state is gone: the loaded parts are freed as they are fused
    if linear == "native":
        _load_kernels("--linear-kernel", "torch")
    convert_linears(lm, weights, linear)
    own_memory(lm)  # the file's mapping unmapped with its last tensor
    if attention == "native":
        _use_native_attention(lm, ctx)
    eos = _eos_ids(directory, (config, text), tokenizer)
    cache = kv_cache_dtype(kv_cache, lm, ctx)
    return GenerativeModel(ctx, lm, tokenizer, limits, eos, weights, weights_why, linear, cache)


def kv_cache_dtype(setting: str, lm: LlamaLM, ctx: ModelContext) -> torch.dtype:
    """--kv-cache-dtype: same (the model's dtype), float16, or auto: float16 where the model
    computes in float32 and its decode step runs on the native attention's fused path (which
    reads a float16 cache as it loads it: half the bytes a step reads and the cache holds;
    AVX-512, head size 64, up to 3 query heads a KV head), else same. Logged with the reason
    for auto."""
    if setting != "auto":
        return torch.float16 if setting == "float16" else ctx.dtype
    s, isa = lm.shape, cpu.capabilities().isa
    group = s.num_heads // s.num_kv_heads
    if lm.decode_attention != "native":
        why, dtype = "decode attention sdpa", ctx.dtype
    elif ctx.dtype != torch.float32:
        why, dtype = f"the model computes in {dtype_name(ctx.dtype)}", ctx.dtype
    elif isa != "AVX512" or s.head_dim != 64 or group > 3:  # decode_attention.cpp's FUSED_*
        # The kernel's other paths convert a float16 block before reading it: 0.66-1.03x
        # the float32 cache's speed, measured on AVX2 (bench/README.md).
        why = (f"capability {isa}, head size {s.head_dim}, {group} query heads a KV head: "
               "not the kernel's fused path")  # fmt: skip
        dtype = ctx.dtype
    else:
        why, dtype = "float32 model, native decode attention on AVX-512", torch.float16
    log.info("model %s: --kv-cache-dtype auto: %s (%s)", ctx.name,
             dtype_name(dtype), why)  # fmt: skip
    return dtype


def _use_native_attention(lm: LlamaLM, ctx: ModelContext) -> None:
    """The decode step on this project's attention kernel, registered here (built once per
    CPU and torch) before any graph is compiled or a kept package calling it is loaded; a
    model the kernel does not cover keeps torch's SDPA, logged."""
    why = lm.native_unsupported(ctx.device, ctx.dtype)
    if why:
        log.info("model %s: decode attention sdpa (native: %s)", ctx.name, why)
        return
    path = _load_kernels("--decode-attention", "sdpa")
    lm.decode_attention = "native"
    log.info("model %s: decode attention native (%s)", ctx.name, path.name)


def _load_kernels(flag: str, without: str) -> Path:
    """This project's ops registered (inference_svc/kernels) for ``flag`` native, or an error
    naming it and ``without``, its setting that runs without them."""
    from inference_svc import kernels

    try:
        return kernels.load()
    except Exception as e:  # a compiler error, an unwritable directory: say which setting
        raise RuntimeError(
            f"{flag} native: this project's ops could not be built or loaded ({e}); "
            f"{flag} {without} runs without them"
        ) from e


def _eos_ids(directory: Path, configs: tuple[object, ...], tokenizer: object) -> frozenset[int]:
    """Every id that ends a sequence: the tokenizer's, the configs' and the generation
    config's (Gemma 3 lists its end-of-turn token there only)."""
    from transformers import GenerationConfig

    found: list[object] = [tokenizer.eos_token_id]
    found += [getattr(c, "eos_token_id", None) for c in configs]
    with contextlib.suppress(OSError):  # no generation_config.json (a GGUF directory)
        generation = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
        found.append(generation.eos_token_id)
    eos: set[int] = set()
    for ids in found:
        if isinstance(ids, int):
            eos.add(ids)
        elif ids is not None:
            eos.update(int(i) for i in ids)
    return frozenset(eos)
