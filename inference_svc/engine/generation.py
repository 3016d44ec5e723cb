"""Generate requests: batched prefill into the static KV cache, then decode steps.

A batch is a group of requests that arrived together (up to the KV cache's
rows), padded to a batch bucket and a prefill-length bucket; prompts are
left-padded so every row's next token lands in the same cache slot, which keeps
one decode graph for every step. New requests wait for the running batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inference_api.plan import LogprobsMode
from inference_svc.compile_monitor import Origin
from inference_svc.engine.rowstate import RowState
from inference_svc.engine.types import GenChunk, GenerateParams, TokenLogprob
from inference_svc.engine.worker import ModelWorker
from inference_svc.errors import InvalidArgument
from inference_svc.models.compile import bucket_for
from inference_svc.models.generative import GenerativeModel
from inference_svc.sampling import Sampler, SamplerOutput, SamplingMetadata


@dataclass
class GenJob:
    prompt_ids: list[int]
    params: GenerateParams
    emit: Callable[[GenChunk | BaseException], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


def sampling_metadata(
    params: list[GenerateParams | None], device: torch.device, mode: LogprobsMode
) -> SamplingMetadata:
    """Metadata for a padded batch; ``None`` rows are padding (greedy)."""
    real = [p for p in params if p is not None]
    gens: dict[int, torch.Generator] = {}
    for row, p in enumerate(params):
        if p is not None and p.seed is not None and p.temperature > 0:
            gens[row] = torch.Generator(device=device).manual_seed(p.seed)
    return SamplingMetadata(
        temperature=torch.tensor([p.temperature if p else 0.0 for p in params], device=device),
        top_k=torch.tensor([p.top_k if p else 0 for p in params], device=device),
        top_p=torch.tensor([p.top_p if p else 1.0 for p in params], device=device),
        generators=gens,
        num_logprobs=max((p.logprobs for p in real), default=0),
        logprobs_mode=mode,
    )


class GenerateWorker(ModelWorker[GenJob]):
    def __init__(
        self, model: GenerativeModel, sampler: Sampler, mode: LogprobsMode, max_queue: int
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.logprobs_mode = mode
        super().__init__(model.name, max_queue)

    def prepare(self, params: GenerateParams) -> list[int]:
        """Tokenize the prompt and check its length; raises InvalidArgument."""
        m = self.model
        messages = [{"role": r, "content": c} for r, c in params.messages]
        ids = m.encode(params.prompt, messages)
        if not ids:
            raise InvalidArgument("prompt: no tokens after tokenization")
        if len(ids) > m.limits.max_input_tokens:
            raise InvalidArgument(
                f"prompt: {len(ids)} tokens; the limit is {m.limits.max_input_tokens} "
                "(--max-input-tokens)"
            )
        return ids

    def capacity(self) -> int:
        return max(self.model.cache_rows, 1)

    def fail(self, job: GenJob, exc: BaseException) -> None:
        job.emit(exc)

    def run_batch(self, jobs: list[GenJob]) -> None:
        m = self.model
        rows = bucket_for(len(jobs), m.usable_batch_buckets())
        longest = max(2, *(len(j.prompt_ids) for j in jobs))
        width = bucket_for(longest, m.prefill_buckets)
        ids = torch.full((rows, width), m.pad_id, dtype=torch.long)
        valid = torch.zeros(rows, width, dtype=torch.bool)
        for i, job in enumerate(jobs):
            n = len(job.prompt_ids)
            ids[i, width - n :] = torch.tensor(job.prompt_ids)
            valid[i, width - n :] = True
        valid[len(jobs) :, -1] = True  # padding rows: one token
        lengths = valid.sum(-1)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        params: list[GenerateParams | None] = [j.params for j in jobs]
        params += [None] * (rows - len(jobs))
        md = sampling_metadata(params, m.device, self.logprobs_mode)
        states = [RowState(j.params, len(j.prompt_ids), m.eos_ids, m.detokenize) for j in jobs]
        d = m.device
        logits = m.prefill(ids.to(d), positions.to(d), valid.to(d), Origin.REQUEST)
        attend = torch.zeros(rows, m.limits.max_seq_len, dtype=torch.bool)
        attend[:, :width] = valid
        for step in range(max(j.params.max_tokens for j in jobs)):
            out = self.sampler(logits, md)
            self._emit(jobs, states, out)
            if all(s.done or j.cancelled.is_set() for s, j in zip(states, jobs, strict=True)):
                return
            slot = width + step
            attend[:, slot] = True
            logits = m.decode(
                out.tokens[:, None],
                (lengths + step)[:, None].to(d),
                torch.tensor([slot], device=d),
                attend.to(d),
                Origin.REQUEST,
            )

    def _emit(self, jobs: list[GenJob], states: list[RowState], out: SamplerOutput) -> None:
        tokens = out.tokens.tolist()
        for row, (job, state) in enumerate(zip(jobs, states, strict=True)):
            if state.done or job.cancelled.is_set():
                continue
            lp = self._logprob(out, row, tokens[row], job.params.logprobs)
            job.emit(state.push(tokens[row], lp))

    def _logprob(self, out: SamplerOutput, row: int, token: int, n: int) -> TokenLogprob | None:
        if n <= 0 or out.logprobs is None:
            return None
        assert out.top_ids is not None and out.top_logprobs is not None
        text = self.model.token_text
        top = zip(out.top_ids[row, :n].tolist(), out.top_logprobs[row, :n].tolist(), strict=True)
        return TokenLogprob(
            token, text(token), float(out.logprobs[row]), tuple((i, text(i), v) for i, v in top)
        )


def random_logits(batch: int, vocab: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """Logits for sampler warmup: random, not zeros (zeros would tie every token)."""
    return (torch.randn(batch, vocab, generator=gen) * 3).to(device)
