"""The Generate runner: runs what the scheduler planned on the model and the sampler.

It owns the logits buffer (one row per KV-cache row: each row's next distribution), pads
each step to a declared shape (the model's buckets) and reads back only the sampled ids
(and, when asked, their logprobs) as plain numbers for the output stage.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference_api.plan import LogprobsMode
from inference_svc.compile_monitor import Origin
from inference_svc.engine.output import Sampled
from inference_svc.engine.scheduler import Chunk, DecodePlan, Sequence
from inference_svc.engine.types import GenerateParams
from inference_svc.models.generative import GenerativeModel
from inference_svc.sampling import Sampler, SamplerOutput, SamplingMetadata


def request_generator(params: GenerateParams, device: torch.device) -> torch.Generator | None:
    """A seeded request's own generator (it lives as long as the request)."""
    if params.seed is None or params.temperature <= 0:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sampling_metadata(
    params: list[GenerateParams | None],
    generators: dict[int, torch.Generator],
    device: torch.device,
    mode: LogprobsMode,
) -> SamplingMetadata:
    """Metadata for a padded batch; ``None`` rows are padding (greedy, nothing drawn)."""
    real = [p for p in params if p is not None]
    return SamplingMetadata(
        temperature=torch.tensor([p.temperature if p else 0.0 for p in params], device=device),
        top_k=torch.tensor([p.top_k if p else 0 for p in params], device=device),
        top_p=torch.tensor([p.top_p if p else 1.0 for p in params], device=device),
        generators=generators,
        num_logprobs=max((p.logprobs for p in real), default=0),
        logprobs_mode=mode,
    )


def random_logits(batch: int, vocab: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """Logits for sampler warmup: random, not zeros (zeros would tie every token)."""
    return (torch.randn(batch, vocab, generator=gen) * 3).to(device)


class GenerateRunner:
    def __init__(self, model: GenerativeModel, sampler: Sampler, mode: LogprobsMode) -> None:
        self.model = model
        self.sampler = sampler
        self.logprobs_mode = mode
        self._logits: Tensor | None = None  # [rows, vocab]

    def rows(self) -> int:
        """KV-cache rows (0 before PROFILE or --kv-cache-tokens sized the cache)."""
        m = self.model
        if self._logits is None or len(self._logits) != m.cache_rows:
            self._logits = torch.zeros(m.cache_rows, m.lm.shape.vocab_size, device=m.device)
        return m.cache_rows

    def prefill(self, chunk: Chunk) -> None:
        seq = chunk.seq
        logits = self.model.prefill(seq.row, chunk.ids, chunk.start, Origin.REQUEST)
        if chunk.last:
            assert self._logits is not None
            self._logits[seq.row] = logits[0]

    def sample(self, seqs: list[Sequence]) -> list[tuple[Sequence, int, SamplerOutput]]:
        """One sampler call over the rows of ``seqs``, each with its own parameters and,
        when seeded, its own generator (made at its first token)."""
        m = self.model
        assert self._logits is not None
        batch = m.batch_bucket(max(s.row for s in seqs) + 1)
        params: list[GenerateParams | None] = [None] * batch
        gens: dict[int, torch.Generator] = {}
        for s in seqs:
            params[s.row] = s.params
            if s.generated == 0 and s.generator is None:
                s.generator = request_generator(s.params, m.device)
            if s.generator is not None:
                gens[s.row] = s.generator
        md = sampling_metadata(params, gens, m.device, self.logprobs_mode)
        out = self.sampler(self._logits[:batch], md)
        tokens = out.tokens.tolist()
        return [(s, tokens[s.row], out) for s in seqs]

    @staticmethod
    def read_back(seq: Sequence, token: int, out: SamplerOutput) -> Sampled:
        """The numbers the output stage needs for one row (logprobs only when asked)."""
        n = seq.params.logprobs
        if n <= 0 or out.logprobs is None:
            return Sampled(seq, token, seq.finish)
        assert out.top_ids is not None and out.top_logprobs is not None
        ids, lps = out.top_ids[seq.row, :n].tolist(), out.top_logprobs[seq.row, :n].tolist()
        lp = float(out.logprobs[seq.row])
        return Sampled(seq, token, seq.finish, lp, tuple(zip(ids, lps, strict=True)))

    def decode(self, plan: DecodePlan) -> None:
        """One step for the rows that go on; every other row below the batch bucket is
        padding that writes its own next free slot (a prefilling row's next chunk, or a
        free row's slot 0), which nobody attends to before it is written again."""
        m = self.model
        batch = m.batch_bucket(plan.top_row + 1)
        tokens = [m.pad_id] * batch
        positions = [0] * batch
        for row, slot in plan.positions.items():
            if row < batch:
                positions[row] = slot
        for row, token in plan.tokens.items():
            tokens[row] = token
        logits = m.decode(torch.tensor(tokens), positions, Origin.REQUEST)
        assert self._logits is not None
        self._logits[:batch] = logits
