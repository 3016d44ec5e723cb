"""Per-request decoding state: tokens so far, stop strings, streamed text."""

from __future__ import annotations

from collections.abc import Callable

from inference_svc.engine.types import FinishReason, GenChunk, GenerateParams, TokenLogprob


class RowState:
    """Turns sampled tokens into chunks whose text concatenates to the final text.

    Text that might be the start of a stop string, or an incomplete UTF-8
    character, is held back until it is known.
    """

    def __init__(
        self,
        params: GenerateParams,
        prompt_tokens: int,
        eos_ids: frozenset[int],
        detokenize: Callable[[list[int]], str],
    ) -> None:
        self.params = params
        self.prompt_tokens = prompt_tokens
        self.eos_ids = eos_ids
        self.detokenize = detokenize
        self.ids: list[int] = []
        self.emitted = 0  # characters of text already sent
        self.finish: FinishReason | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    def push(self, token: int, logprob: TokenLogprob | None) -> GenChunk:
        if token in self.eos_ids:
            return self._final(FinishReason.EOS, self.detokenize(self.ids))
        self.ids.append(token)
        text = self.detokenize(self.ids)
        cut = self._stop_index(text)
        if cut is not None:
            chunk = self._final(FinishReason.STOP, text[:cut])
        elif len(self.ids) >= self.params.max_tokens:
            chunk = self._final(FinishReason.LENGTH, text)
        else:
            chunk = self._chunk(text[: len(text) - self._holdback(text)])
        chunk.token_ids = [token]
        if logprob is not None:
            chunk.logprobs = [logprob]
        return chunk

    def _stop_index(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        hold = 1 if text.endswith("\ufffd") else 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def _chunk(self, visible: str) -> GenChunk:
        delta = visible[self.emitted :] if len(visible) > self.emitted else ""
        self.emitted = max(self.emitted, len(visible))
        return GenChunk(text=delta)

    def _final(self, reason: FinishReason, text: str) -> GenChunk:
        chunk = self._chunk(text)
        self.finish = reason
        chunk.finish = reason
        chunk.prompt_tokens = self.prompt_tokens
        chunk.completion_tokens = len(self.ids)
        return chunk
