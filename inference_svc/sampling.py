"""The sampler: a pure function of (logits, SamplingMetadata), with distinct paths.

Paths (each warmed separately, see inference_api.plan.sampler_paths):
- greedy: argmax of the raw logits;
- random, unseeded: temperature / top-k / top-p (temperature only when no row of the
  batch limits top-k or top-p: the sort over the vocabulary is most of a sampled step's
  cost), then the exponential race
  ``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn for the whole batch at once
  from the global generator;
- random, seeded: the same race, but each seeded row draws its ``q`` from its
  own ``torch.Generator``, so its tokens do not depend on the rest of the batch;
- logprobs: the chosen token's logprob and the top alternatives, of the raw
  logits (mode RAW) or of the processed distribution (mode PROCESSED).

Under LogprobsMode.PROCESSED the sampler takes its native per-row path: every
random row draws its own ``q`` (from its generator, or the global one), so the
seeded path and the random path are the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from inference_api.plan import CompilationMode, LogprobsMode
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.models.compile import compile_fn

# Most alternatives a request may ask for; always computed at this width so the
# number asked for never changes a compiled shape.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingMetadata:
    temperature: Tensor  # [B] float; 0 = greedy row
    top_k: Tensor  # [B] long; 0 = no limit
    top_p: Tensor  # [B] float; 1 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    num_logprobs: int = 0  # most alternatives any row asked for; 0 = none
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    # Rows that sample (temperature > 0); None: read them off ``temperature``.
    random_rows: tuple[int, ...] | None = None
    # Whether any row limits top-k or top-p; None: read it off ``top_k`` and ``top_p``.
    filters: bool | None = None

    def __post_init__(self) -> None:
        if self.random_rows is None:
            rows = tuple(i for i, t in enumerate(self.temperature.tolist()) if t > 0)
            object.__setattr__(self, "random_rows", rows)
        if self.filters is None:
            limited = bool((self.top_k > 0).any()) or bool((self.top_p < 1.0).any())
            object.__setattr__(self, "filters", limited)

    @property
    def all_greedy(self) -> bool:
        return not self.random_rows


@dataclass(frozen=True)
class SamplerOutput:
    tokens: Tensor  # [B] long
    logprobs: Tensor | None = None  # [B] logprob of the chosen token
    top_ids: Tensor | None = None  # [B, MAX_LOGPROBS]
    top_logprobs: Tensor | None = None  # [B, MAX_LOGPROBS]


def greedy_tokens(logits: Tensor) -> Tensor:
    return logits.argmax(dim=-1)


def scaled_logits(logits: Tensor, temperature: Tensor) -> Tensor:
    """Temperature only: what ``processed_logits`` gives, bit for bit, when no row limits
    top-k or top-p (no sort of the vocabulary)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / t[:, None]


def processed_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Temperature, then top-k, then top-p; masked tokens get -inf. A row with top_p 1
    keeps every token (a cumulative sum that rounds to 1 before the tail drops nothing)."""
    vocab = logits.shape[-1]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = logits / t[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    ranks = torch.arange(vocab, device=x.device)[None, :]
    sorted_x = sorted_x.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first stays).
    drop_sorted = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop_sorted |= ranks >= k[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def exponential_race(processed: Tensor, q: Tensor) -> Tensor:
    return (processed.softmax(dim=-1) / q).argmax(dim=-1)


def top_logprobs(x: Tensor, chosen: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    lp = x.float().log_softmax(dim=-1)
    top = lp.topk(min(MAX_LOGPROBS, lp.shape[-1]), dim=-1)
    return lp.gather(1, chosen[:, None])[:, 0], top.indices, top.values


class Sampler:
    """Compiles each piece once (in a compiled mode) and picks the path per batch."""

    def __init__(self, model: str, mode: CompilationMode, monitor: CompileMonitor) -> None:
        self.model = model
        self.monitor = monitor
        self.compiled_greedy = mode is not CompilationMode.NONE  # else eager argmax
        self._greedy = compile_fn(greedy_tokens, mode)
        self._process = compile_fn(processed_logits, mode)
        self._scale = compile_fn(scaled_logits, mode)
        self._race = compile_fn(exponential_race, mode)
        self._logprobs = compile_fn(top_logprobs, mode)

    @torch.inference_mode()
    def __call__(self, logits: Tensor, md: SamplingMetadata) -> SamplerOutput:
        shapes = f"batch={logits.shape[0]}"
        ctx = self.monitor.context
        with ctx(self.model, "sampler/greedy", shapes):
            tokens = greedy = self._greedy(logits)
        processed = logits
        if not md.all_greedy:
            site = "sampler/seeded" if md.generators else "sampler/random"
            with ctx(self.model, site, shapes):
                if md.filters:
                    processed = self._process(logits, md.temperature, md.top_k, md.top_p)
                else:
                    processed = self._scale(logits, md.temperature)
                sampled = self._race(processed, self._noise(processed, md))
            tokens = torch.where(md.temperature > 0, sampled, greedy)
        if md.num_logprobs <= 0:
            return SamplerOutput(tokens)
        source = processed if md.logprobs_mode is LogprobsMode.PROCESSED else logits
        with ctx(self.model, f"sampler/logprobs-{md.logprobs_mode.value}", shapes):
            chosen, ids, values = self._logprobs(source, tokens)
        return SamplerOutput(tokens, chosen, ids, values)

    @staticmethod
    def _noise(processed: Tensor, md: SamplingMetadata) -> Tensor:
        """Exp(1) noise for the sampling rows only: greedy and padding rows draw nothing,
        so the global random stream depends on the requests, not on how they were padded."""
        q = torch.ones(processed.shape, dtype=torch.float32, device=processed.device)
        rows = md.random_rows or ()
        if md.logprobs_mode is LogprobsMode.PROCESSED:
            for row in rows:
                q[row].exponential_(generator=md.generators.get(row))
            return q.clamp_(min=1e-10)
        unseeded = [row for row in rows if row not in md.generators]
        if unseeded:  # the batched fast path: one draw from the global generator
            q[unseeded] = torch.empty(len(unseeded), q.shape[1], device=q.device).exponential_()
        for row, gen in md.generators.items():
            q[row].exponential_(generator=gen)
        return q.clamp_(min=1e-10)
