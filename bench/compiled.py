"""Does compiled mode pay? The same load against the service in eager and compiled mode,
for each numerics option, against in-process peers.

One system after another (never two at once: they would share the CPU):
  - Embed services (--lm-model none), each mode x {float32, --dtype bfloat16}: N clients
    over gRPC, each one short text per call in a closed loop (1 and 32 clients);
  - Generate services (--embed-model none), each mode x --lm-weights {same, bfloat16,
    int4}: greedy GenerateStream, 64 new tokens, 1 stream and 8 concurrent streams;
  - sentence-transformers in this process at batch 32 on the same texts, and llama.cpp's
    own HTTP server (llama-server, continuous batching; bench/peer_server.py, built by
    bench/build_llama_server.sh) on the same GGUF file and threads, at the same stream
    counts as the Generate services (when built).
Prints the table and the goals' ratios, writes bench/results/compiled.json and
compiled.png. bench/accuracy.py measures what each option costs in accuracy.

  .venv/bin/python bench/compiled.py [--modes none,default] [--seconds 15] [--no-peers]
      [--freeze-weights on]   (the compiled services frozen; results in compiled-frozen.*)
      [--kinds embed]         (only the Embed arms and their peer; the Generate figures
                               stay those of the last run, which the report says)
      [--options bf16-linear] (only these numerics options)
      [--name compiled-autotune] (results in bench/results/NAME.*; c/e is the last mode
                               against the first, e.g. --modes none,default,max-autotune)
      [--quick --embed-model DIR --lm-model DIR] (smoke run: mode none, float32, 1 s
                               per Embed point, 8 tokens, no peers, results in a temp dir)

A benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_quick_flags, model_args, results_dir, save_plot  # noqa: E402
from bench.embed_load import clients, sentence_transformers_batch  # noqa: E402
from bench.peer_server import PEER, cpu_threads, llama_server_arm  # noqa: E402
from bench.throughput import concurrency, stream  # noqa: E402
from harness.procs import running_service  # noqa: E402
from inference_api.stubs.inference.v1 import inference_pb2 as pb  # noqa: E402
from inference_api.stubs.inference.v1 import inference_pb2_grpc  # noqa: E402

EMBED_OPTIONS = {"float32": [], "bfloat16": ["--dtype", "bfloat16"]}
LM_OPTIONS = {"float32": [], "bf16-linear": ["--lm-weights", "bfloat16"],
              "int4-linear": ["--lm-weights", "int4"]}  # fmt: skip


def arm_args(
    models: list[str] | None, off: str, mode: str, option: list[str], compiled: list[str]
) -> list[str]:
    """A one-model service: ``--OFF none``, the mode, the option, and (compiled modes)
    the ``compiled`` flags (--freeze-weights, --compile-backend)."""
    flags = compiled if mode != "none" else []
    return [*(models or []), f"--{off}", "none", "--compilation-mode", mode, *option, *flags]


def embed_arm(
    mode: str, option: str, seconds: float, compiled: list[str], models: list[str] | None = None
) -> dict:
    args = arm_args(models, "lm-model", mode, EMBED_OPTIONS[option], compiled)
    with tempfile.TemporaryDirectory() as tmp, running_service(args, Path(tmp)) as svc:
        out = {"warm_s": svc.warm_s}
        for n in (1, 32):
            out[f"clients_{n}"] = asyncio.run(clients(svc.target, n, seconds))
            print(f"[embed {mode} {option}] {n:>2} clients: "
                  f"{out[f'clients_{n}']['texts_s']:.0f} texts/s", flush=True)  # fmt: skip
        out["late_compiles"] = late_compiles(svc.target)
        return out


def late_compiles(target: str) -> int:
    """Info.late_compile_events after the load: compiles after SERVING (0 expected)."""
    with grpc.insecure_channel(target) as channel:
        info = inference_pb2_grpc.InferenceStub(channel).Info(pb.InfoRequest(), timeout=30)
    if info.late_compile_events:
        print(f"   {info.late_compile_events} late compile events", flush=True)
    return info.late_compile_events


def generate_arm(
    mode: str,
    option: str,
    tokens: int,
    compiled: list[str],
    models: list[str] | None = None,
    streams: tuple[int, ...] = (1, 8),
) -> dict:
    args = arm_args(models, "embed-model", mode, LM_OPTIONS[option], compiled)
    with tempfile.TemporaryDirectory() as tmp, running_service(args, Path(tmp)) as svc:

        async def run() -> dict:
            async with grpc.aio.insecure_channel(svc.target) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                await stream(stub, 0, 8)  # not measured
                rows = {}
                for n in streams:
                    runs = [await concurrency(stub, n, tokens) for _ in range(2)]
                    rows[f"streams_{n}"] = max(runs, key=lambda r: r["tok_s"])
                    print(f"[generate {mode} {option}] {n} streams: "
                          f"{rows[f'streams_{n}']['tok_s']:.1f} tok/s", flush=True)  # fmt: skip
                return rows

        return {
            "warm_s": svc.warm_s,
            **asyncio.run(run()),
            "late_compiles": late_compiles(svc.target),
        }


def commit() -> str:
    git = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True).stdout.strip() or "?"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def peer_tok_s(r: dict) -> dict[int, float]:
    """The Generate peer's tokens/s by stream count: llama-server, or (results from before
    it) the in-process llama-cpp-python, one stream."""
    if r.get("llama_server"):
        return {row["streams"]: row["tok_s"] for row in r["llama_server"]["curve"]}
    return {1: r["llama_cpp_1"]} if r.get("llama_cpp_1") else {}


def table(
    r: dict,
    kind: str,
    options: dict,
    key: str,
    counts: tuple[int, ...],
    unit: str,
    peer: dict[int, float] | None = None,
) -> None:
    """One row per option and load: the figure in each mode, then compiled / eager; with a
    ``peer`` (figure by load), the peer's figure and each mode / the peer."""
    modes = r["modes"]
    head = f"{'option':<14}{key:>8}" + "".join(f"{m:>13}" for m in modes) + f"{'c/e':>7}"
    if peer:
        head += f"{PEER:>14}" + "".join(f"{m + '/peer':>14}" for m in modes)
    print(head)
    for option in options:
        for n in counts:
            v = [r[kind].get(f"{m} {option}", {}).get(f"{key}_{n}", {}).get(unit) for m in modes]
            if not any(v):  # not measured in this run (--options)
                continue
            row = f"{option:<14}{n:>8}" + "".join(f"{x or 0:>13.1f}" for x in v)
            row += f"{ratio(v[-1], v[0]):>7}"
            if peer:
                row += f"{peer.get(n, 0):>14.1f}" + "".join(
                    f"{ratio(x, peer.get(n)):>14}" for x in v
                )
            print(row)


def report(r: dict) -> None:
    modes = r["modes"]
    print("\nEmbed, texts/s (one short text per call)")
    table(r, "embed", EMBED_OPTIONS, "clients", (1, 32), "texts_s")
    print(f"\nGenerate, tokens/s (greedy, {r.get('tokens', 64)} new tokens per stream)"
          + (f" (from {r['generate_from']})" if r.get("generate_from") else ""))  # fmt: skip
    counts = tuple(sorted({int(k.split("_")[1]) for g in r["generate"].values()
                           for k in g if k.startswith("streams_")})) or (1, 8)  # fmt: skip
    peer = peer_tok_s(r)
    table(r, "generate", LM_OPTIONS, "streams", counts, "tok_s", peer)
    st, llama = r.get("sentence_transformers_b32"), peer.get(1)
    print(f"\nsentence-transformers in process, batch 32: {st or 0:.0f} texts/s")
    if r.get("llama_server"):
        print(f"{PEER} ({r['llama_server']['binary']}): "
              + ", ".join(f"{n} streams {v:.1f}" for n, v in peer.items()) + " tok/s")  # fmt: skip
    else:
        print(f"llama.cpp, 1 stream: {llama or 0:.1f} tok/s")
    best = max(((k, v["clients_32"]["texts_s"]) for k, v in r["embed"].items()),
               key=lambda kv: kv[1], default=(None, None))  # fmt: skip
    print(f"Embed 32 clients (best: {best[0]}) / sentence-transformers: {ratio(best[1], st)}"
          "  (goal >= 0.8)")  # fmt: skip
    int4 = r["generate"].get(f"{modes[-1]} int4-linear", {}).get("streams_1", {}).get("tok_s")
    name = PEER if r.get("llama_server") else "llama.cpp"
    print(f"Generate 1 stream ({modes[-1]} int4-linear) / {name} 1 stream: "
          f"{ratio(int4, llama)}  (goal >= 0.5)")  # fmt: skip


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    panels = [
        ("embed", "clients_32", "texts_s", "Embed, 32 clients: texts/s", EMBED_OPTIONS),
        ("generate", "streams_8", "tok_s", "Generate, 8 streams: tokens/s", LM_OPTIONS),
        ("generate", "streams_1", "tok_s", "Generate, 1 stream: tokens/s", LM_OPTIONS),
    ]
    generate_peer, peer_name = peer_tok_s(r), PEER if r.get("llama_server") else "llama.cpp"
    peers = [("sentence-transformers b32", r.get("sentence_transformers_b32")),
             (peer_name, generate_peer.get(8)), (peer_name, generate_peer.get(1))]  # fmt: skip
    width = 0.8 / len(r["modes"])
    for ax, (kind, key, unit, title, options), (name, peer) in zip(
        axes, panels, peers, strict=True
    ):
        for j, mode in enumerate(r["modes"]):
            ys = [r[kind].get(f"{mode} {o}", {}).get(key, {}).get(unit, 0) for o in options]
            ax.bar([i + j * width for i in range(len(options))], ys, width, label=mode)
        ax.set_xticks([i + width * (len(r["modes"]) - 1) / 2 for i in range(len(options))],
                      list(options))  # fmt: skip
        if peer:
            ax.axhline(peer, linestyle="--", color="grey", label=name)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"compilation modes {', '.join(r['modes'])}, {r['threads']} CPU threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="none,default", help="compilation modes, eager first")
    p.add_argument("--seconds", type=float, default=15.0, help="Embed load per point")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per stream")
    p.add_argument("--no-peers", action="store_true", help="the service only")
    p.add_argument("--replot", action="store_true", help="table and plot of the last results")
    p.add_argument("--kinds", default="embed,generate", help="which arms to run (embed, generate)")
    p.add_argument("--options", default="", help="only these numerics options (e.g. bf16-linear)")
    p.add_argument("--name", default="", help="results file stem (default: compiled[-frozen])")
    p.add_argument(
        "--freeze-weights", choices=("off", "on"), default="off",
        help="the compiled services' --freeze-weights (on: results in compiled-frozen.*)",
    )  # fmt: skip
    p.add_argument(
        "--backend", choices=("auto", "torch-compile", "aoti"), default="auto",
        help="the compiled services' --compile-backend (auto, the service's default: aoti "
        "on a CPU)",
    )  # fmt: skip
    p.add_argument("--streams", default="1,8", help="Generate concurrencies measured")
    add_quick_flags(p)
    a = p.parse_args(argv)
    compiled = ["--freeze-weights", a.freeze_weights, "--compile-backend", a.backend]
    streams = tuple(int(n) for n in a.streams.split(","))
    if a.quick:
        a.modes, a.seconds, a.tokens, a.no_peers, a.options = "none", 1.0, 8, True, "float32"
    stem = a.name or ("compiled" if a.freeze_weights == "off" else "compiled-frozen")
    out, models = results_dir(a), model_args(a)
    path = out / f"{stem}.json"
    if a.replot:
        r = json.loads(path.read_text())
    else:
        modes, kinds = a.modes.split(","), a.kinds.split(",")
        r = {"modes": modes, "threads": cpu_threads(), "embed": {}, "generate": {}}
        r["tokens"] = a.tokens
        r["freeze_weights"], r["commit"] = a.freeze_weights, commit()
        r["backend"] = a.backend
        if "generate" not in kinds and path.exists():  # keep the last run's Generate figures
            last = json.loads(path.read_text())
            r["generate"], r["llama_server"] = last["generate"], last.get("llama_server")
            r["llama_cpp_1"] = last.get("llama_cpp_1")  # results from before llama-server
            r["generate_from"] = last.get("generate_from") or f"commit {last.get('commit')}"
        if not a.no_peers and "embed" in kinds:
            r["sentence_transformers_b32"] = sentence_transformers_batch(32, a.seconds)
        if not a.no_peers and "generate" in kinds:
            r["llama_server"] = llama_server_arm(list(streams), a.tokens)
        wanted = set(a.options.split(",")) if a.options else set(EMBED_OPTIONS) | set(LM_OPTIONS)
        for option in [o for o in EMBED_OPTIONS if o in wanted] if "embed" in kinds else ():
            for mode in modes:
                r["embed"][f"{mode} {option}"] = embed_arm(
                    mode, option, a.seconds, compiled, models
                )
                path.write_text(json.dumps(r, indent=1))
        for option in [o for o in LM_OPTIONS if o in wanted] if "generate" in kinds else ():
            for mode in modes:
                r["generate"][f"{mode} {option}"] = generate_arm(
                    mode, option, a.tokens, compiled, models, streams
                )
                path.write_text(json.dumps(r, indent=1))
    report(r)
    save_plot(plot, r, out / f"{stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
