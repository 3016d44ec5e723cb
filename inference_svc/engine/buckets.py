"""The shapes a model runs at: one frozen value per model owns them all.

Padding (the runner, Embed's batch), PROFILE, COMPILE and Describe read the same value, so
the scheduler can only ever produce a shape that COMPILE ran and Describe listed.

- Embed: a batch size and a padded length, powers of two.
- Generate: a decode step runs over cache rows [0, B) for a batch bucket B against a
  context bucket (slots attended); a prefill chunk is one row, padded to a chunk bucket,
  against a context bucket. Chunk buckets step by 16 tokens, not by powers of two: prefill
  costs what it computes, and a 38-token prompt padded to 64 would pay 68 % more than at 48.
- Batch buckets, compiled by torch.compile: powers of two from 2 (a batch of 1 is padded to
  2, so no size-1 specialisation is left to compile later). Eager and AOTInductor packages
  (exported with the batch dynamic from 1, no specialisation): Generate's decode steps run
  at every size from 1, the rows they have (nothing is compiled per size, and a padding row
  costs what a real one does: eager int4 steps of 9 / 12 rows took 35.7 / 39.6 ms against
  46.5 padded to 16; 2026-12-07, 2-core AMD EPYC); Embed's batches at powers of two from 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from inference_api.plan import Bucket, CompilationMode, Phase
from inference_svc.limits import GenLimits


def powers_of_two(limit: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to ``limit`` (``limit`` itself last)."""
    out: list[int] = []
    n = smallest
    while n < limit:
        out.append(n)
        n *= 2
    out.append(limit)
    return tuple(out)


def batch_sizes(limit: int, mode: CompilationMode, aoti: bool = False) -> tuple[int, ...]:
    if mode is CompilationMode.NONE or aoti:
        return powers_of_two(limit, smallest=1)
    return powers_of_two(max(limit, 2), smallest=2)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class EmbedBuckets:
    batch: tuple[int, ...]
    length: tuple[int, ...]

    @classmethod
    def plan(
        cls, max_batch: int, max_input_tokens: int, mode: CompilationMode, aoti: bool = False
    ) -> EmbedBuckets:
        return cls(batch_sizes(max_batch, mode, aoti), powers_of_two(max_input_tokens))

    def shape(self, rows: int, longest: int) -> Bucket:
        """The padded shape of ``rows`` inputs whose longest has ``longest`` tokens."""
        return Bucket(
            Phase.EMBED, bucket_for(rows, self.batch), bucket_for(max(2, longest), self.length)
        )

    def all(self) -> tuple[Bucket, ...]:
        return tuple(Bucket(Phase.EMBED, b, n) for b, n in product(self.batch, self.length))

    def ranges(self) -> dict[str, tuple[int, int]]:
        """The span of each dimension over every bucket: what a package is exported for."""
        return {
            "batch": (self.batch[0], self.batch[-1]),
            "length": (self.length[0], self.length[-1]),
        }


@dataclass(frozen=True)
class GenBuckets:
    batch: tuple[int, ...]  # decode batch sizes up to --gen-max-batch
    chunk: tuple[int, ...]  # prefill chunk widths
    context: tuple[int, ...]  # KV-cache slots attended
    max_seq_len: int  # slots per row: longest prompt + most new tokens
    max_input_tokens: int
    rows: int = 0  # KV-cache rows; 0 until the cache is sized
    # The sampler's smallest batch: 2 when torch.compile compiles it (no size-1 graph to
    # compile apart), even when the step ran one row.
    sampler_from: int = 1

    @classmethod
    def plan(cls, limits: GenLimits, mode: CompilationMode, aoti: bool = False) -> GenBuckets:
        chunk = min(limits.prefill_chunk, limits.max_input_tokens)
        eager = mode is CompilationMode.NONE or aoti  # nothing compiled per batch size
        return cls(
            sampler_from=1 if eager else 2,  # aoti: eager sampler
            batch=tuple(range(1, limits.max_batch + 1))
            if eager
            else batch_sizes(limits.max_batch, mode),
            chunk=tuple(sorted({*range(16, chunk, 16), chunk})),
            context=powers_of_two(limits.max_seq_len, smallest=32),
            max_seq_len=limits.max_seq_len,
            max_input_tokens=limits.max_input_tokens,
        )

    # -- the KV cache's rows -------------------------------------------------------------
    def rows_for(self, tokens: int) -> int:
        """Rows a cache of ``tokens`` slots holds: whole batch buckets only, so that every
        row is reachable by a decode bucket. Raises ValueError below 2 rows."""
        fits = min(tokens // self.max_seq_len, self.batch[-1])
        rows = max((b for b in self.batch if b <= fits), default=fits)
        if rows < 2:
            raise ValueError(
                f"a KV cache of {tokens} tokens holds fewer than 2 sequences of "
                f"{self.max_seq_len} tokens; give at least {2 * self.max_seq_len} "
                "(--kv-cache-tokens) or lower --max-input-tokens/--max-new-tokens"
            )
        return rows

    def with_rows(self, rows: int) -> GenBuckets:
        return self if rows == self.rows else replace(self, rows=rows)

    @property
    def decode_batch(self) -> tuple[int, ...]:
        """The batch buckets a step can run at: up to the cache's rows once it is sized."""
        if not self.rows:
            return self.batch
        return tuple(b for b in self.batch if b <= max(self.rows, 2))

    # -- padding -------------------------------------------------------------------------
    def batch_for(self, rows: int) -> int:
        """The batch a step over cache rows [0, rows) runs at."""
        return bucket_for(rows, self.decode_batch)

    def sampler_batch(self, rows: int) -> int:
        """The batch the sampler runs at after a step over cache rows [0, rows)."""
        return max(self.batch_for(rows), self.sampler_from)

    @property
    def sampler_batches(self) -> tuple[int, ...]:
        """What SAMPLER warms: every batch a compiled sampler runs at. An eager one (beside
        packages) compiles nothing per size: its powers of two and the largest, as before
        every size was a decode batch (all 16 took the packaged vocabulary's SAMPLER step
        from 0.5 to 2.0 s, a quarter of a restart)."""
        if self.sampler_from == 1:
            return powers_of_two(self.decode_batch[-1], smallest=1)
        return tuple(sorted({max(b, self.sampler_from) for b in self.decode_batch}))

    def chunk_width(self, n: int) -> int:
        """The width a prefill chunk of ``n`` tokens is padded to."""
        return bucket_for(n, self.chunk)

    def chunk_shape(self, start: int, n: int) -> Bucket:
        """The padded shape of a prefill chunk of ``n`` tokens written from slot ``start``."""
        width = self.chunk_width(n)
        context = bucket_for(min(start + width, self.max_seq_len), self.context)
        return Bucket(Phase.PREFILL, 1, width, context)

    def decode_shape(self, rows: int, top: int) -> Bucket:
        """A decode step over cache rows [0, rows) whose highest written slot is ``top``."""
        return Bucket(Phase.DECODE, self.batch_for(rows), 1, bucket_for(top + 1, self.context))

    # -- every shape ---------------------------------------------------------------------
    def prefill(self) -> tuple[Bucket, ...]:
        """A chunk of each width against each context bucket that can hold it and that a
        prompt can reach (a chunk starts at a multiple of the chunk limit)."""
        slots, limit = self.max_seq_len, self.chunk[-1]
        furthest = bucket_for(min(-(-self.max_input_tokens // limit) * limit, slots), self.context)
        return tuple(
            Bucket(Phase.PREFILL, 1, c, ctx)
            for c, ctx in product(self.chunk, self.context)
            if bucket_for(min(c, slots), self.context) <= ctx <= furthest
        )

    def decode(self) -> tuple[Bucket, ...]:
        return tuple(
            Bucket(Phase.DECODE, b, 1, ctx) for b, ctx in product(self.decode_batch, self.context)
        )

    def all(self) -> tuple[Bucket, ...]:
        return (*self.prefill(), *self.decode())

    def ranges(self) -> dict[str, tuple[int, int]]:
        """The span of each dimension over every bucket: what a package is exported for."""
        return {
            "batch": (self.batch[0], self.batch[-1]),
            "chunk": (self.chunk[0], self.chunk[-1]),
            "context": (self.context[0], self.context[-1]),
        }

    def largest(self) -> tuple[Bucket, Bucket]:
        """What PROFILE measures: a decode step over every row at full context, and the
        widest chunk at the furthest context a prompt reaches."""
        decode = Bucket(Phase.DECODE, self.batch[-1], 1, self.context[-1])
        return decode, self.prefill()[-1]
