"""The sampler as a pure function: each path, seeds, top-k/top-p, logprobs modes."""

from __future__ import annotations

import pytest
import torch

from inference_api.plan import CompilationMode, LogprobsMode
from inference_svc.compile_monitor import CompileMonitor
from inference_svc.sampling import Sampler, SamplingMetadata, processed_logits

pytestmark = pytest.mark.unit

VOCAB = 64


def md(temps, seeds=None, top_k=0, top_p=1.0, logprobs=0, mode=LogprobsMode.RAW):
    n = len(temps)
    gens = {i: torch.Generator().manual_seed(s) for i, s in (seeds or {}).items()}
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_k=torch.full((n,), top_k),
        top_p=torch.full((n,), top_p),
        generators=gens,
        num_logprobs=logprobs,
        logprobs_mode=mode,
    )


def sampler() -> Sampler:
    return Sampler("test", CompilationMode.NONE, CompileMonitor())


def test_greedy_is_argmax():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    out = sampler()(logits, md([0.0, 0.0, 0.0]))
    assert out.tokens.tolist() == logits.argmax(-1).tolist()


def test_seeded_row_ignores_its_neighbours_and_the_global_state():
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    others = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    s = sampler()
    torch.manual_seed(0)
    alone = s(torch.cat([row, others[:1]]), md([1.0, 0.0], {0: 42})).tokens[0].item()
    torch.manual_seed(99)
    batch = torch.cat([others[:2], row, others[2:]])
    batched = s(batch, md([1.0, 1.0, 1.0, 0.0], {2: 42})).tokens[2].item()
    assert alone == batched
    draws = {s(torch.cat([row, row]), md([1.0, 1.0], {0: x})).tokens[0].item() for x in range(20)}
    assert len(draws) > 1  # the seed matters


def test_unseeded_random_follows_the_global_generator():
    logits = torch.zeros(2, VOCAB)  # uniform: the noise decides
    s = sampler()
    torch.manual_seed(3)
    a = s(logits, md([1.0, 1.0])).tokens.tolist()
    torch.manual_seed(3)
    b = s(logits, md([1.0, 1.0])).tokens.tolist()
    assert a == b


def test_top_k_and_top_p_mask_the_tail():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    x = processed_logits(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(x).tolist() == [[True, True, False, False, False]]
    x = processed_logits(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isfinite(x)[0, 0] and not torch.isfinite(x)[0, 2:].any()
    tokens = {sampler()(logits, md([1.0], {0: s}, top_k=2)).tokens.item() for s in range(50)}
    assert tokens <= {0, 1} and len(tokens) == 2


def test_logprobs_raw_and_processed():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 2)
    s = sampler()
    raw = s(logits, md([0.0, 0.0], logprobs=2))
    want = logits.log_softmax(-1)
    assert torch.allclose(raw.logprobs, want[:, 0])
    assert raw.top_ids[0, :2].tolist() == [0, 1]
    proc = s(logits, md([0.5, 0.5], {0: 1, 1: 2}, top_k=1, logprobs=2, mode=LogprobsMode.PROCESSED))
    assert proc.tokens.tolist() == [0, 0]  # top_k=1 leaves one token
    assert torch.allclose(proc.logprobs, torch.zeros(2))  # all mass on it


def test_unseeded_stream_ignores_padding_and_greedy_rows():
    """The global stream is drawn for sampling rows only: padding a batch changes nothing."""
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    s = sampler()
    torch.manual_seed(11)
    alone = [s(row, md([1.0])).tokens[0].item() for _ in range(6)]
    torch.manual_seed(11)
    padded = [s(torch.cat([row, row]), md([1.0, 0.0])).tokens[0].item() for _ in range(6)]
    assert alone == padded


def test_a_batch_without_top_k_or_top_p_skips_the_sort_and_samples_the_same_tokens():
    """top_k 0 and top_p 1 on every row: temperature only (no sort of the vocabulary); the
    tokens equal those of the full top-k/top-p path, so a seeded request gives the same tokens
    whether or not a neighbour in its batch limits top-p. Peaked logits, where the cumulative
    sum rounds to 1 before the tail: top_p 1 still keeps every token."""
    from inference_svc.sampling import scaled_logits

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    logits[0, 5] = 60.0  # one token holds nearly all the mass
    temps = torch.tensor([0.7, 1.0, 1.3, 0.0])
    full = processed_logits(logits, temps, torch.zeros(4, dtype=torch.long), torch.ones(4))
    assert torch.equal(full, scaled_logits(logits, temps))
    assert not md([1.0, 1.0]).filters
    assert md([1.0], top_p=0.9).filters and md([1.0], top_k=3).filters

    def seeded() -> dict[int, torch.Generator]:
        return {i: torch.Generator().manual_seed(i + 1) for i in range(3)}

    s = sampler()
    fast = md([0.7, 1.0, 1.3, 0.0])
    fast = SamplingMetadata(fast.temperature, fast.top_k, fast.top_p, seeded())
    neighbour = torch.tensor([1.0, 1.0, 1.0, 0.5])  # the greedy row limits top-p
    slow = SamplingMetadata(fast.temperature, fast.top_k, neighbour, seeded())
    assert not fast.filters and slow.filters
    assert s(logits, slow).tokens.tolist() == s(logits, fast).tokens.tolist()


def runner_over(logits: torch.Tensor, mode: CompilationMode = CompilationMode.NONE):
    """A GenerateRunner whose logits buffer is ``logits`` (a model of numbers only: the
    runner's sample() reads nothing else of it)."""
    from types import SimpleNamespace

    from inference_svc.engine.buckets import GenBuckets
    from inference_svc.engine.runner import GenerateRunner
    from inference_svc.limits import GenLimits

    rows, vocab = logits.shape
    lm = SimpleNamespace(shape=SimpleNamespace(vocab_size=vocab))
    model = SimpleNamespace(cache_rows=rows, device=torch.device("cpu"), lm=lm)
    buckets = GenBuckets.plan(GenLimits(rows, 8, 8, 8), CompilationMode.NONE)
    runner = GenerateRunner(model, Sampler("t", mode, CompileMonitor()), LogprobsMode.RAW, buckets)
    runner.rows()
    runner._logits.copy_(logits)
    return runner


def seq_at(row: int, **params):
    from inference_svc.engine.scheduler import Sequence
    from inference_svc.engine.types import GenerateParams

    seq = Sequence([1], GenerateParams("p", (), **params), lambda chunk: None)
    seq.row = row
    return seq


def test_greedy_rows_take_the_argmax_with_or_without_the_sampler_call():
    """A batch of greedy rows asking for no logprobs skips the sampler (mode none): the
    same tokens as the sampler's greedy path; logprobs, or a sampling row, still call it."""
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3))
    want = logits.argmax(-1).tolist()
    fast = runner_over(logits)
    assert fast._plain_argmax
    greedy = [seq_at(r) for r in (0, 2, 5)]
    drawn = fast.sample(greedy)
    assert [(s.row, t) for s, t, _ in drawn] == [(r, want[r]) for r in (0, 2, 5)]
    slow = runner_over(logits)
    slow._plain_argmax = False
    assert [t for _, t, _ in slow.sample(greedy)] == [t for _, t, _ in drawn]
    # logprobs asked: the sampler runs and reads them back
    asks = seq_at(1, logprobs=2)
    (seq, token, out), *_ = fast.sample([asks, seq_at(4)])
    assert token == want[1]
    sampled = fast.read_back(seq, token, out)
    assert sampled.logprob is not None and len(sampled.top) == 2
    # a sampling row beside a greedy one: the greedy row's token is the argmax still
    mixed = fast.sample([seq_at(6), seq_at(7, temperature=1.0, seed=5)])
    assert mixed[0][1] == want[6]
