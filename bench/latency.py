"""Steady-state latency in mode NONE: the service over gRPC against the same model in-process.

In one run, one after another (never two at once, so they do not share the CPU):
  1. the service as its own process (packaged models, --compilation-mode none), warmed by
     `warmup-ctl --once`, called over gRPC on loopback;
  2. the same code in this process, without gRPC: the service's Engine, warmed the same way;
  3. the same weights through stock transformers: BertModel + mean pooling for Embed,
     LlamaForCausalLM.generate (greedy, its own KV cache) for Generate.
For each: Embed of one short text (median latency) and greedy Generate (median tokens/s),
and the ratios against (2) and (3). Also the model load times from the service's log.

  .venv/bin/python bench/latency.py [--repeats 30] [--tokens 64] [--out FILE]
  .venv/bin/python bench/latency.py --quick --embed-model DIR --lm-model DIR   # smoke run

A benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_api.stubs.inference.v1 import inference_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import add_quick_flags, model_args  # noqa: E402
from harness.procs import running_service  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog."
PROMPT = "Write a long story about a lighthouse keeper and the sea."  # sent as a chat message


def median_of(fn: Callable[[], object], repeats: int) -> float:
    fn()  # not timed: the first call is not steady state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tokens_per_s(fn: Callable[[], int], repeats: int) -> float:
    fn()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


def over_grpc(repeats: int, tokens: int, tmp: Path, models: list[str]) -> dict[str, float]:
    with running_service(models, tmp) as svc:
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(svc.target))
        embed = median_of(lambda: stub.Embed(pb.EmbedRequest(inputs=[TEXT])), repeats)
        chat = [pb.ChatMessage(role="user", content=PROMPT)]
        req = pb.GenerateRequest(messages=chat, sampling=pb.SamplingParams(max_tokens=tokens))
        rate = tokens_per_s(
            lambda: stub.Generate(req).usage.completion_tokens, max(3, repeats // 6)
        )
        loads = re.findall(r"loaded model (\w+) in ([\d.]+) s", svc.log.read_text())
        out = {"embed_s": embed, "gen_tok_s": rate}
        out.update({f"load_{name}_s": float(sec) for name, sec in loads})
        return out


def in_process(repeats: int, tokens: int, models: list[str]) -> dict[str, float]:
    from inference_api.plan import StepKind
    from inference_svc.config import parse_config
    from inference_svc.engine.core import Engine
    from inference_svc.engine.types import EmbedParams, GenerateParams

    engine = Engine(parse_config(["--port", "0", "--admin-port", "0", *models]))
    engine.load()

    async def warm() -> None:  # what `warmup-ctl --once` does, in process
        for step in engine.required_steps():
            if step.kind not in (StepKind.RESEED, StepKind.MARK_SERVING):
                await engine.warmup(step)
        engine.reseed(None)
        await engine.mark_serving()

    loop = asyncio.new_event_loop()
    loop.run_until_complete(warm())
    e_params = EmbedParams((TEXT,), True, False, 0)
    g_params = GenerateParams(prompt="", messages=(("user", PROMPT),), max_tokens=tokens)

    async def generate() -> int:
        n = 0
        async for chunk in engine.serving("Generate").serve(g_params):
            n += len(chunk.token_ids)
        return n

    embed = median_of(
        lambda: loop.run_until_complete(anext(engine.serving("Embed").serve(e_params))), repeats
    )
    rate = tokens_per_s(lambda: loop.run_until_complete(generate()), max(3, repeats // 6))
    engine.close()
    loop.close()
    return {"embed_s": embed, "gen_tok_s": rate}


def stock_transformers(
    repeats: int, tokens: int, embed_model: str, lm_model: str
) -> dict[str, float]:
    from transformers import AutoModel, AutoTokenizer

    from inference_svc.models.loading import load_hf_causal_lm, resolve_embed_dir, resolve_lm_dir

    d = str(resolve_embed_dir(embed_model))
    tok, bert = AutoTokenizer.from_pretrained(d), AutoModel.from_pretrained(d).eval()

    @torch.inference_mode()
    def embed() -> torch.Tensor:
        batch = tok([TEXT], return_tensors="pt")
        hidden = bert(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    lm, lm_tok = load_hf_causal_lm(resolve_lm_dir(lm_model), torch.float32)
    chat = [{"role": "user", "content": PROMPT}]
    ids = lm_tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids

    @torch.inference_mode()
    def generate() -> int:
        out = lm.generate(ids, max_new_tokens=tokens, do_sample=False)
        return out.shape[1] - ids.shape[1]

    return {
        "embed_s": median_of(embed, repeats),
        "gen_tok_s": tokens_per_s(generate, max(3, repeats // 6)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of the Generate calls")
    ap.add_argument("--out", type=Path)
    add_quick_flags(ap)
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.tokens = 3, 8
    os.environ["HF_HUB_OFFLINE"] = "1"
    models = model_args(a)
    with tempfile.TemporaryDirectory() as tmp:
        g = over_grpc(a.repeats, a.tokens, Path(tmp), models)
    e = in_process(a.repeats, a.tokens, models)
    s = stock_transformers(a.repeats, a.tokens, a.embed_model or "default", a.lm_model or "default")
    lines = [
        f"model load (service log): embedding {g.get('load_embedding_s', 0):.1f} s, "
        f"generative {g.get('load_generative_s', 0):.1f} s",
        "",
        "| path | gRPC service | in-process engine | stock transformers | "
        "gRPC / engine | gRPC / transformers |",
        "|---|---|---|---|---|---|",
        f"| Embed, one short text: median latency | {g['embed_s'] * 1e3:.1f} ms | "
        f"{e['embed_s'] * 1e3:.1f} ms | {s['embed_s'] * 1e3:.1f} ms | "
        f"{g['embed_s'] / e['embed_s']:.2f} | {g['embed_s'] / s['embed_s']:.2f} |",
        f"| Generate greedy, {a.tokens} tokens: median tokens/s | {g['gen_tok_s']:.1f} | "
        f"{e['gen_tok_s']:.1f} | {s['gen_tok_s']:.1f} | "
        f"{g['gen_tok_s'] / e['gen_tok_s']:.2f} | {g['gen_tok_s'] / s['gen_tok_s']:.2f} |",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
