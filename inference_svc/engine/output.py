"""The Generate output stage: sampled token ids become text chunks, off the compute thread.

Detokenizing is incremental (vLLM's and TGI's prefix/read offsets): each token decodes a
short window of the ids before it, not the whole output, and a window that ends inside a
UTF-8 character waits for the next token. Stop strings are searched only in the text not
sent yet: text that might be the start of a stop string is held back until it is known,
so a stop can only start in the held text, and each token's cost stays flat in the
output's length. A stop string found here ends the request (``Sequence.stopped``); the
scheduler frees its row on its next iteration and any token sampled meanwhile is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from inference_svc.engine.scheduler import Sequence
from inference_svc.engine.types import FinishReason, GenChunk, GenerateParams, TokenLogprob

log = logging.getLogger(__name__)
Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class Sampled:
    """What the runner drew for one row: plain numbers, read back from the sampler."""

    seq: Sequence
    token: int
    finish: FinishReason | None  # EOS or LENGTH, decided by the scheduler
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # the top alternatives: (id, logprob)


class TextState:
    """One request's text: decoded incrementally, held back while a stop string may start."""

    def __init__(self, params: GenerateParams, prompt_tokens: int, decode: Decode) -> None:
        self.params = params
        self.prompt_tokens = prompt_tokens
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] is the window the next token's text is cut from
        self.read = 0
        self.held = ""  # decoded, not sent: it might be the start of a stop string
        self.done = False

    def push(self, token: int, finish: FinishReason | None) -> GenChunk:
        """The chunk for one sampled token (``finish``: EOS for an end token, LENGTH for the
        last one allowed); a stop string found ends the request with STOP."""
        if finish is FinishReason.EOS:
            return self._final(FinishReason.EOS, self.held + self._new_text(flush=True), [])
        self.ids.append(token)
        text = self.held + self._new_text(flush=finish is not None)
        cut = self._stop_index(text)
        if cut is not None:
            return self._final(FinishReason.STOP, text[:cut], [token])
        if finish is not None:
            return self._final(finish, text, [token])
        hold = self._holdback(text)
        self.held = text[len(text) - hold :] if hold else ""
        return GenChunk(text=text[: len(text) - hold], token_ids=[token])

    def _new_text(self, flush: bool) -> str:
        """The text the ids after the read offset add (all of it when ``flush``)."""
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) > len(before) and (flush or not after.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def _stop_index(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        """The longest end of ``text`` that is the start of a stop string."""
        hold = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _final(self, reason: FinishReason, text: str, ids: list[int]) -> GenChunk:
        self.done, self.held = True, ""
        return GenChunk(
            text=text,
            token_ids=ids,
            finish=reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.ids),
        )


class OutputStage:
    """Runs on ``executor`` (the model's text thread, one worker: chunks stay in order and
    the tokenizer is never called from two threads at once)."""

    def __init__(self, executor: Executor, decode: Decode, token_text: Callable[[int], str]):
        self.executor = executor
        self.decode = decode
        self.token_text = token_text

    def push(self, sampled: list[Sampled]) -> None:
        """Hand one step's tokens over (from the compute thread; returns at once)."""
        if sampled:
            self.executor.submit(self._process, sampled)

    def fail(self, seqs: list[Sequence], exc: BaseException) -> None:
        """Answer ``seqs`` with ``exc``, after any chunk already handed over."""
        if seqs:
            self.executor.submit(self._fail, seqs, exc)

    def _process(self, sampled: list[Sampled]) -> None:
        for s in sampled:
            seq = s.seq
            if seq.stopped:
                continue  # answered already (a stop string, or a failure)
            try:
                chunk = self._chunk(seq, s)
            except Exception as exc:  # a tokenizer fault ends this request only
                log.exception("model output: request failed in the output stage")
                seq.stopped = True
                seq.emit(exc)
                continue
            if chunk.finish is not None:
                seq.stopped = True
            seq.emit(chunk)

    def _chunk(self, seq: Sequence, s: Sampled) -> GenChunk:
        if seq.text is None:
            seq.text = TextState(seq.params, len(seq.prompt_ids), self.decode)
        chunk = seq.text.push(s.token, s.finish)
        if s.logprob is not None and s.finish is not FinishReason.EOS:
            text = self.token_text
            top = tuple((i, text(i), v) for i, v in s.top)
            chunk.logprobs = [TokenLogprob(s.token, text(s.token), s.logprob, top)]
        return chunk

    @staticmethod
    def _fail(seqs: list[Sequence], exc: BaseException) -> None:
        for seq in seqs:
            if not seq.stopped:
                seq.stopped = True
                seq.emit(exc)
