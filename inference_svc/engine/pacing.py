"""How many prompt tokens the next prefill chunk may take while other rows decode.

A joining request's prompt is prefilled one chunk per iteration, between two decode steps of
the rows already generating, so each chunk lengthens their gap between two tokens by its own
time. A chunk of the full ``--prefill-chunk-tokens`` (64) costs several decode steps once the
step is fast (int4 AOTInductor packages, 8 rows, AVX-512 EPYC: a 12 ms step stalled 50-70 ms,
inter-token p99 / p50 4.6 while others joined), yet on an idle service it is the fastest way
to a first token. So, as in Sarathi-Serve's stall-free batching:

- no row decoding, or no more rows decoding than prompts waiting for their first token (a
  burst of arrivals: stalling the few running streams gets the many waiting ones going
  soonest): the widest chunk;
- more rows decoding: the widest chunk bucket whose measured cost is at most ``stall`` decode
  iterations at that many rows (2: a running stream's gap stays within about three steps,
  the continuous-batching goal in bench/README.md), never less than the narrowest bucket, so
  a prompt always moves on.

The chunk and the step are two forwards here (no mixed batch), so a narrower chunk is not
free: a prompt cut in two costs one more decode iteration (whose rows do generate) and
prefills less efficiently (a 16-token chunk costs ~1.3x a 48-token one per token, int4
eager, AVX-512 EPYC). A budget of one step cut every joiner to 16-token chunks and cost
8 simultaneous streams a quarter of their tokens/s; two keeps the stall bounded and most
of the throughput (bench/README.md).

Costs are measured here while serving, not assumed per CPU: an exponential average of the
iteration without a chunk per number of decoding rows, and per chunk width of the chunk's
own cost (its iteration less a plain one at as many rows). A width never measured is
estimated from the nearest measured one, in proportion to its tokens; before any chunk ran,
the widest. Only widths that are multiples of 16 are chosen below the limit, so every chunk
but a prompt's last starts on a multiple of 16 and its padded end stays within the context
buckets COMPILE warmed (tests/test_pacing.py).
"""

from __future__ import annotations

STALL = 2.0  # a chunk may cost this many decode iterations: a gap of at most ~3 steps
WEIGHT = 0.25  # the newest measurement's weight in each average


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


class ChunkPacer:
    """The chunk limit for the scheduler (``limit``), from iteration times (``observe``)."""

    def __init__(self, widths: tuple[int, ...], stall: float = STALL) -> None:
        self.widths = widths  # the chunk buckets, narrowest first
        self.stall = stall
        self.paced = tuple(w for w in widths if w % 16 == 0) or widths[:1]
        self._plain: dict[int, float] = {}  # decoding rows -> seconds: an iteration, no chunk
        self._cost: dict[int, float] = {}  # width -> seconds a chunk of it adds

    def limit(self, rows: int, prompts: int = 1) -> int:
        """Most prompt tokens for the next chunk while ``rows`` rows decode (0: none) and
        ``prompts`` requests wait for their first token (this chunk's included)."""
        plain = self.plain(rows)
        if rows <= prompts or plain is None or not self._cost:
            return self.widths[-1]
        fits = [w for w in self.paced if self.cost(w) <= self.stall * plain]
        return fits[-1] if fits else self.paced[0]

    def plain(self, rows: int) -> float | None:
        """An iteration's time without a chunk at ``rows`` decoding rows: measured at that
        many, else at the nearest fewer measured (a step costs no less with more rows)."""
        fewer = [r for r in self._plain if r <= rows]
        return self._plain[max(fewer)] if fewer else None

    def cost(self, width: int) -> float:
        """A chunk of ``width``'s cost: measured, else scaled from the nearest measured."""
        if width in self._cost:
            return self._cost[width]
        near = min(self._cost, key=lambda w: abs(w - width))
        return self._cost[near] * width / near

    def observe(self, width: int, rows: int, seconds: float) -> None:
        """One iteration took ``seconds``: a chunk padded to ``width`` (0: none) beside a
        decode step of ``rows`` rows (0: none)."""
        if not width:
            if rows:
                self._plain[rows] = _average(self._plain.get(rows), seconds)
            return
        own = seconds - (self.plain(rows) or 0.0) if rows else seconds
        if own > 0:
            self._cost[width] = _average(self._cost.get(width), own)
