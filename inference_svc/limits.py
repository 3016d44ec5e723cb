"""What a request may ask of a model: the limits ``wire`` checks each request against."""

from __future__ import annotations

from dataclasses import dataclass

# Longest text (an Embed input, a prompt, a chat message) a request may carry, in
# characters: far above any model's token limit (a truncating Embed still gets a long
# document), low enough that tokenizing it stays well under a second.
MAX_TEXT_CHARS = 100_000


@dataclass(frozen=True)
class EmbedLimits:
    """What an Embed request may ask of the embedding model."""

    max_batch: int  # most inputs in one call (--embed-max-batch)
    max_input_tokens: int  # longest input, in tokens (longer: truncated or refused)
    dimensions: int  # the model's embedding width: most dimensions a call may ask
    prompt_names: tuple[str, ...] = ()  # the prompts a call may name


@dataclass(frozen=True)
class GenLimits:
    """What a Generate request may ask of the generative model."""

    max_batch: int = 16  # KV-cache rows: sequences decoded together
    max_input_tokens: int = 512
    max_new_tokens: int = 512
    prefill_chunk: int = 64  # most prompt tokens prefilled between two decode steps

    @property
    def max_seq_len(self) -> int:
        return self.max_input_tokens + self.max_new_tokens
