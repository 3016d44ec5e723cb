"""Embed requests: validated, tokenized, batched into padded buckets, pooled."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from inference_svc.engine.types import EmbedParams, EmbedResult
from inference_svc.engine.worker import ModelWorker
from inference_svc.errors import InvalidArgument
from inference_svc.models.compile import bucket_for
from inference_svc.models.embedding import EmbeddingModel


@dataclass
class EmbedJob:
    ids: list[list[int]]
    params: EmbedParams
    future: Future[EmbedResult] = field(default_factory=Future)


class EmbedWorker(ModelWorker[EmbedJob]):
    def __init__(self, model: EmbeddingModel, max_queue: int) -> None:
        self.model = model
        super().__init__(model.name, max_queue)

    def prepare(self, params: EmbedParams) -> EmbedJob:
        """Tokenize and check the limits; raises InvalidArgument."""
        m = self.model
        if params.dimensions > m.dimensions:
            raise InvalidArgument(
                f"dimensions: {params.dimensions}; the model has {m.dimensions} (0 keeps all)"
            )
        ids = m.tokenize(list(params.inputs))
        for i, row in enumerate(ids):
            if len(row) <= m.max_input_tokens:
                continue
            if not params.truncate:
                raise InvalidArgument(
                    f"inputs[{i}]: {len(row)} tokens; the limit is {m.max_input_tokens} "
                    "(set truncate=true to cut longer inputs)"
                )
            ids[i] = m.truncate(row)
        return EmbedJob(ids, params)

    def warm_request(self) -> None:
        """One request through the whole path (tokenize, batch, forward, normalise),
        run on this thread by the warmup: nothing of it is left for a client to run first."""
        job = self.prepare(EmbedParams(("warm up the request path",), True, False, 0))
        self.run_batch([job])
        job.future.result()

    def batch_size_of(self, job: EmbedJob) -> int:
        return len(job.ids)

    def capacity(self) -> int:
        return self.model.max_batch

    def fail(self, job: EmbedJob, exc: BaseException) -> None:
        if not job.future.done():
            job.future.set_exception(exc)

    def run_batch(self, jobs: list[EmbedJob]) -> None:
        m = self.model
        rows = [r for job in jobs for r in job.ids]
        batch = bucket_for(len(rows), m.batch_buckets)
        length = bucket_for(max(2, *(len(r) for r in rows)), m.length_buckets)
        ids = torch.full((batch, length), m.pad_id, dtype=torch.long)
        mask = torch.zeros(batch, length, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        mask[len(rows) :, 0] = 1  # pad rows: one visible token, never read back
        pooled = m.forward(ids, mask)
        start = 0
        for job in jobs:
            vecs = pooled[start : start + len(job.ids)]
            start += len(job.ids)
            if job.params.dimensions:
                vecs = vecs[:, : job.params.dimensions]
            if job.params.normalize:
                vecs = F.normalize(vecs, p=2, dim=-1)
            tokens = sum(len(r) for r in job.ids)
            job.future.set_result(EmbedResult(vecs.tolist(), tokens))
