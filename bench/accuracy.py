"""Accuracy of each numerics option against the float32 model, in process.

Generate: top-1 agreement. The float32 model (eager) writes a greedy continuation of
each reference prompt; the option is teacher-forced along that continuation and its
argmax compared with float32's at every position (prompt's last token included).
Embed: cosine between the option's and float32's embedding of each reference text.

    python bench/accuracy.py                 # eager options
    python bench/accuracy.py --compiled      # the same through the compiled graphs
    python bench/accuracy.py --quick --embed-model DIR --lm-model DIR   # smoke run: 3 prompts,
                                             4 tokens, results in a temp dir
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_quick_flags, results_dir
from inference_api.plan import CompilationMode, LogprobsMode
from inference_svc.compile_monitor import CompileMonitor, Origin
from inference_svc.engine.buckets import GenBuckets
from inference_svc.engine.runner import GenerateRunner
from inference_svc.limits import GenLimits
from inference_svc.models.compile import ModelContext
from inference_svc.models.embedding import EmbeddingModel, load_embedding
from inference_svc.models.generative import load_generative
from inference_svc.models.loading import resolve_embed_dir, resolve_lm_dir
from inference_svc.sampling import Sampler

PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "def fibonacci(n):",
    "List three prime numbers:",
    "Translate 'good morning' into Spanish.",
    "Once upon a time, in a small village,",
    "What is 12 times 7?",
    "The best way to learn a new language is",
    "Summarise the plot of Romeo and Juliet.",
    "Give one tip for writing clear code.",
    "Why is the sky blue?",
)
TEXTS = (
    "A man is eating food.",
    "A cheetah is running behind its prey.",
    "The new movie is awesome and the actors were great.",
    "Gradient descent minimises a loss function step by step.",
    "Il pleut depuis ce matin sur Paris.",
    "def add(a, b): return a + b",
    "Kubernetes restarts the container when its liveness probe fails.",
    "short",
    "The quick brown fox jumps over the lazy dog " * 12,
    "Quarterly revenue grew 4 % while operating costs stayed flat.",
)
# (--dtype, --lm-weights) against float32 with its own weights
LM_OPTIONS = (
    ("bfloat16", "same"), ("float32", "bfloat16"), ("float32", "int4"), ("float32", "int4:native"),
    ("float32", "same+kv16"), ("float32", "int4:native+kv16"),
)  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_lm(
    dtype: str, weights: str, mode: CompilationMode, model_spec: str = "default"
) -> GenerateRunner:
    """The LM with a 2-row cache behind the service's own runner (its padding, its shapes);
    ``weights`` a --lm-weights scheme, "int4:native" for int4 on this project's linear kernel,
    "+kv16" after it for a float16 KV cache (--kv-cache-dtype float16; native attention)."""
    weights, kv16, _ = weights.partition("+kv16")
    weights, _, linear = weights.partition(":")
    limits = GenLimits(max_batch=2, max_input_tokens=128, max_new_tokens=128, prefill_chunk=64)
    monitor = CompileMonitor()
    ctx = ModelContext("lm", mode, monitor, torch.device("cpu"), DTYPES[dtype])
    cache = Path("~/.cache/inference-svc/models").expanduser()
    model = load_generative(
        ctx, resolve_lm_dir(model_spec), limits, cache, weights, linear=linear or "torch",
        attention="native" if kv16 else "sdpa", kv_cache="float16" if kv16 else "same",
    )  # fmt: skip
    buckets = GenBuckets.plan(limits, mode)
    model.allocate_cache(buckets.rows_for(2 * limits.max_seq_len))
    return GenerateRunner(model, Sampler("lm", mode, monitor), LogprobsMode.RAW, buckets)


def prompt_ids(lm: GenerateRunner, prompt: str) -> list[int]:
    return lm.model.encode("", [{"role": "user", "content": prompt}])


def prefill(lm: GenerateRunner, ids: list[int]) -> torch.Tensor:
    """The whole prompt into row 0, chunk by chunk; logits after its last token."""
    chunk = lm.buckets.chunk[-1]
    for start in range(0, len(ids), chunk):
        logits = lm.pad_prefill(0, ids[start : start + chunk], start, Origin.WARMUP)
    return logits


def forced_argmax(lm: GenerateRunner, ids: list[int], continuation: list[int]) -> list[int]:
    """Argmax after the prompt and after each token of ``continuation`` (teacher forcing)."""
    out = [int(prefill(lm, ids)[0].argmax())]
    for t, token in enumerate(continuation[:-1]):
        logits = lm.pad_decode([token], [len(ids) + t], Origin.WARMUP)
        out.append(int(logits[0].argmax()))
    return out


def greedy(lm: GenerateRunner, ids: list[int], tokens: int) -> list[int]:
    out = [int(prefill(lm, ids)[0].argmax())]
    while len(out) < tokens and out[-1] not in lm.model.eos_ids:
        logits = lm.pad_decode([out[-1]], [len(ids) + len(out) - 1], Origin.WARMUP)
        out.append(int(logits[0].argmax()))
    return out


# The reference's greedy continuations, per (prompt, tokens): written once, compared with
# every option.
_continuations: weakref.WeakKeyDictionary[GenerateRunner, dict[tuple[str, int], list[int]]] = (
    weakref.WeakKeyDictionary()
)


def lm_agreement(
    reference: GenerateRunner, option: GenerateRunner, prompts: tuple[str, ...], tokens: int
) -> float:
    """Share of positions where ``option``'s top-1 token equals ``reference``'s."""
    same = total = 0
    written = _continuations.setdefault(reference, {})
    for prompt in prompts:
        ids = prompt_ids(reference, prompt)
        if (prompt, tokens) not in written:
            written[(prompt, tokens)] = greedy(reference, ids, tokens)
        want = written[(prompt, tokens)]
        got = forced_argmax(option, ids, want)
        same += sum(a == b for a, b in zip(want, got, strict=True))
        total += len(want)
    return same / total


def load_embed(dtype: str, mode: CompilationMode, model_spec: str = "default") -> EmbeddingModel:
    ctx = ModelContext("e", mode, CompileMonitor(), torch.device("cpu"), DTYPES[dtype])
    return load_embedding(ctx, resolve_embed_dir(model_spec))


def embed(model: EmbeddingModel, texts: tuple[str, ...]) -> torch.Tensor:
    rows = model.tokenize(list(texts), truncate=True)
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), model.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return model.forward(ids, mask, Origin.WARMUP)


def embed_cosines(reference: EmbeddingModel, option: EmbeddingModel) -> list[float]:
    return F.cosine_similarity(embed(reference, TEXTS), embed(option, TEXTS)).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compiled", action="store_true", help="options through compiled graphs")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    add_quick_flags(p)
    a = p.parse_args()
    prompts, lm, em = PROMPTS, a.lm_model or "default", a.embed_model or "default"
    if a.quick:
        prompts, a.tokens = PROMPTS[:3], 4
    mode = CompilationMode.DEFAULT if a.compiled else CompilationMode.NONE
    results: dict[str, dict] = {}
    ref = load_lm("float32", "same", CompilationMode.NONE, lm)
    arms = [("float32", "same")] * a.compiled + list(LM_OPTIONS)
    for dtype, weights in arms:
        t0 = time.time()
        option = load_lm(dtype, weights, mode, lm)
        agree = lm_agreement(ref, option, prompts, a.tokens)
        name = option.model.numerics
        results[f"generate {name} {mode.value}"] = {"top1_agreement": agree}
        print(f"Generate {name:>15} ({mode.value}): top-1 agreement {agree:.4f} "
              f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
    eref = load_embed("float32", CompilationMode.NONE, em)
    for dtype in ("float32", "bfloat16")[1 - a.compiled :]:
        cos = embed_cosines(eref, load_embed(dtype, mode, em))
        results[f"embed {dtype} {mode.value}"] = {"cosine_min": min(cos),
                                                   "cosine_mean": sum(cos) / len(cos)}  # fmt: skip
        print(f"Embed {dtype:>17} ({mode.value}): cosine min {min(cos):.5f} "
              f"mean {sum(cos) / len(cos):.5f}", flush=True)  # fmt: skip
    out = results_dir(a) / "accuracy.json"
    old = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**old, **results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
