"""Cold-start benchmark: what the warmup sidecar saves the first request on each path.

Starts inference-svc up to four ways, one after another, each as its own process, and
measures it from the outside over gRPC:

  sidecar     compiled (--compilation-mode default), warmed by `warmup-ctl --once`: a cold
              start, with an empty --compile-cache-dir
  restart     the same again, with the compiled artifacts the sidecar arm kept (a restart,
              a rolling update, a new replica on a filled cache volume)
  no-sidecar  compiled, marked SERVING as soon as its models load: no warmup at all, so every
              compile lands on a request (see serve_ungated below for how)
  none        --compilation-mode none, warmed by `warmup-ctl --once` (PROFILE only)

For each arm: seconds from process start to SERVING (grpc.health.v1 Check of
inference.v1.Inference every 0.2 s), the model load times from the service log, and for each
request path the first request's latency, the median of --repeats more (each after --gap
seconds idle, like the first), and first / median; then Info.late_compile_events and the
service's 'late compile after SERVING' lines.

  .venv/bin/python bench/cold_start.py --out /tmp/bench.md
  .venv/bin/python bench/cold_start.py --arms none sidecar --repeats 5 -- --gen-max-batch 2
  .venv/bin/python bench/cold_start.py --arms sidecar none restart none restart none restart
  .venv/bin/python bench/cold_start.py --quick --embed-model DIR --lm-model DIR  # smoke run:
      the none and no-sidecar arms, both uncompiled; 2 repeats, no idle gap, 4 tokens

An arm named again starts again; the start-to-SERVING ratios use each arm's median.

Arguments after `--` go to every inference-svc. Each arm gets a fresh, empty
TORCHINDUCTOR_CACHE_DIR (a first deploy) unless --warm-cache DIR names one to reuse; the
sidecar and restart arms share one --compile-cache-dir (--compile-cache DIR, else a new one).
A benchmark, not a test: it asserts nothing. A compiled arm takes minutes on a small CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_quick_flags, model_args  # noqa: E402
from harness.procs import POLL_S, Proc, ServiceProc, sidecar, wait_serving  # noqa: E402
from inference_api.stubs.inference.v1 import admin_pb2 as apb  # noqa: E402
from inference_api.stubs.inference.v1 import admin_pb2_grpc, inference_pb2_grpc  # noqa: E402
from inference_api.stubs.inference.v1 import inference_pb2 as pb  # noqa: E402
from inference_svc.config import parse_config  # noqa: E402

ARMS = ("sidecar", "restart", "no-sidecar", "none")
RPC_TIMEOUT = 3600.0  # a cold request compiles several graphs: minutes on 2 cores
EMBED_TEXT = "The quick brown fox jumps over the lazy dog."
PROMPT = "Once upon a time, in a small village by the sea,"
SEED = 1234


@dataclass
class PathTiming:
    first: float
    steady: float  # median of the repeats

    @property
    def ratio(self) -> float:
        return self.first / self.steady


@dataclass
class ArmResult:
    arm: str
    commit: str = "?"  # the code the arm's processes ran
    to_serving: float | None = None
    load: dict[str, float] = field(default_factory=dict)
    paths: dict[str, PathTiming] = field(default_factory=dict)
    late_compiles: int | None = None
    late_lines: list[str] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    error: str | None = None


def serve_ungated(argv: list[str]) -> int:
    """inference-svc with its serving gate's precondition removed: the no-sidecar arm.

    This is the benchmark's deliberate bypass, not a feature of the service. MarkServing is
    normally refused until every required warmup step has run and a Reseed followed it; here
    the check is a no-op, so the benchmark marks the service SERVING the moment its models
    load, which is what a service without a warmup sidecar does. Everything else (loading,
    health, the compile monitor, the late-compile log lines) is the real service.
    """
    from inference_svc.__main__ import main as service_main
    from inference_svc.engine.gate import ServingGate

    ServingGate.check = lambda self, required: None  # type: ignore[method-assign]
    return service_main(argv)


def sampling(**kw: object) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)  # type: ignore[arg-type]


Call = Callable[[inference_pb2_grpc.InferenceStub], object]


def request_paths(max_tokens: int) -> dict[str, Call]:
    """One request per path; the same request every time."""

    def generate(**kw: object) -> Call:
        req = pb.GenerateRequest(prompt=PROMPT, sampling=sampling(max_tokens=max_tokens, **kw))
        return lambda stub: stub.Generate(req, timeout=RPC_TIMEOUT)

    embed = pb.EmbedRequest(inputs=[EMBED_TEXT])
    return {
        "Embed": lambda stub: stub.Embed(embed, timeout=RPC_TIMEOUT),
        "Generate greedy": generate(temperature=0.0),
        "Generate random": generate(temperature=0.8),
        "Generate seeded": generate(temperature=0.8, seed=SEED),
        "Generate logprobs=2": generate(temperature=0.0, logprobs=2),
    }


def timed(call: Callable[[], object], gap: float) -> float:
    """Seconds one call takes, after ``gap`` seconds idle (see --gap)."""
    time.sleep(gap)
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def mark_at_once(admin: admin_pb2_grpc.WarmupAdminStub, svc: Proc, timeout: float) -> None:
    """Reseed and MarkServing as soon as Describe says the models have loaded."""
    deadline = time.monotonic() + timeout
    while not admin.Describe(apb.DescribeRequest(), timeout=10).models_loaded:
        if svc.exited() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"models did not load:\n{svc.tail()}")
        time.sleep(POLL_S)
    admin.Reseed(apb.ReseedRequest(), timeout=10)
    admin.MarkServing(apb.MarkServingRequest(), timeout=10)


def late_compile_lines(log: str) -> list[str]:
    """'late compile after SERVING' causes, counted (compile ids dropped)."""
    found = re.findall(r"late compile after SERVING: (.*?)(?: compile_id=\S*)?$", log, re.M)
    return [f"{n} x {cause}" for cause, n in Counter(found).items()]


def start_arm(
    result: ArmResult,
    opts: argparse.Namespace,
    extra: list[str],
    log_dir: Path,
    tag: str,
    stack: ExitStack,
) -> tuple[ServiceProc, Proc | None]:
    """The arm's service, and its sidecar (None for no-sidecar, marked SERVING at once);
    both stop when ``stack`` closes, the sidecar first."""
    arm = result.arm
    cache = opts.warm_cache or stack.enter_context(
        tempfile.TemporaryDirectory(prefix=f"inductor-{arm}-")
    )
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    mode = "none" if arm == "none" else opts.compiled_mode
    svc_args = [*extra, "--compilation-mode", mode]
    if arm in ("sidecar", "restart"):
        svc_args += ["--compile-cache-dir", str(opts.compile_cache)]
    else:  # nothing kept: every compile of the no-sidecar arm lands on a request
        svc_args += ["--compile-cache-dir", ""]
    program = None
    if arm == "no-sidecar":
        program = [sys.executable, str(Path(__file__).resolve()), "--serve-ungated"]
        svc_args += kv_cache_args(extra)
    print(f"\n== {arm}: {shlex.join([*(program or ['inference-svc']), *svc_args])}", flush=True)
    # Its own session: a Ctrl-C reaches only the benchmark, which stops children in order.
    svc = ServiceProc(log_dir, svc_args, f"{tag}.svc", program, env, own_session=True)
    result.logs.append(svc.log)
    stack.callback(svc.stop)  # callbacks run last-in first-out: the sidecar stops first
    if arm == "no-sidecar":
        admin_channel = stack.enter_context(grpc.insecure_channel(svc.admin_target))
        mark_at_once(admin_pb2_grpc.WarmupAdminStub(admin_channel), svc, opts.timeout)
        return svc, None
    ctl_args = ["--once", *shlex.split(opts.ctl_args)]
    ctl = sidecar(log_dir, svc, *ctl_args, name=f"{tag}.ctl", env=env, own_session=True)
    result.logs.append(ctl.log)
    stack.callback(ctl.stop)
    return svc, ctl


def run_arm(
    result: ArmResult, opts: argparse.Namespace, extra: list[str], log_dir: Path, tag: str
) -> None:
    """Runs one arm, filling ``result`` as it goes (a failure keeps what was measured);
    ``tag`` names its log files (the arm, numbered when --arms repeats it)."""
    result.commit = git_commit()
    with ExitStack() as stack:
        svc, ctl = start_arm(result, opts, extra, log_dir, tag, stack)
        result.to_serving = wait_serving(svc, opts.timeout, ctl)
        print(f"   SERVING after {result.to_serving:.1f} s", flush=True)
        # `warmup-ctl --once` exits right after SERVING; its exit (tens of ms of CPU on a
        # 2-core machine) would land on the first request and be counted as the service's.
        deadline = time.monotonic() + 30
        while ctl is not None and ctl.exited() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        for m in re.finditer(r"loaded model (\S+) in ([\d.]+) s", svc.text()):
            result.load[m[1]] = float(m[2])
        channel = stack.enter_context(grpc.insecure_channel(svc.target))
        # Connected before the first timed call: a channel connects at its first call, and
        # that TCP and HTTP/2 setup (a few ms) is the client's, not the service's cold path.
        grpc.channel_ready_future(channel).result(timeout=30)
        inference = inference_pb2_grpc.InferenceStub(channel)
        for name, call in request_paths(opts.max_tokens).items():
            first = timed(lambda c=call: c(inference), opts.gap)
            steady = statistics.median(
                timed(lambda c=call: c(inference), opts.gap) for _ in range(opts.repeats)
            )
            result.paths[name] = PathTiming(first, steady)
            print(f"   {name}: first {first:.3f} s, median {steady:.3f} s", flush=True)
        result.late_compiles = inference.Info(pb.InfoRequest(), timeout=30).late_compile_events
        result.late_lines = late_compile_lines(svc.text())


def git_commit() -> str:
    """HEAD, marked + when tracked files differ from it."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)  # fmt: skip
    return (head.stdout.strip() or "?") + ("+" if dirty.stdout.strip() else "")


def kv_cache_args(extra: list[str]) -> list[str]:
    """An explicit KV-cache size for the no-sidecar arm, since no PROFILE step sizes it.

    Same size PROFILE gives when memory is plentiful (every batch row, whole sequences), so
    the compiled shapes match the sidecar arm's.
    """
    cfg = parse_config(extra)
    if cfg.kv_cache_tokens is not None or cfg.lm_model == "none":
        return []
    tokens = cfg.gen_max_batch * (cfg.max_input_tokens + cfg.max_new_tokens)
    return ["--kv-cache-tokens", str(tokens)]


def table(results: list[ArmResult], opts: argparse.Namespace, extra: list[str]) -> str:
    cache = f"warm ({opts.warm_cache})" if opts.warm_cache else "cold (fresh per arm)"
    args = f"; service args: {shlex.join(extra)}" if extra else ""
    lines = [
        f"Cold start, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs; compiled arms: "
        f"--compilation-mode {opts.compiled_mode}; median of {opts.repeats} repeats, each "
        f"(and the first) after {opts.gap:g} s idle; "
        f"max_tokens {opts.max_tokens}; inductor cache {cache}{args}",
        "",
        "| arm | commit | start to SERVING (s) | model load (s) | late compile events |",
        "|---|---|---:|---|---:|",
    ]
    for r in results:
        load = ", ".join(f"{k} {v:.1f}" for k, v in r.load.items()) or "-"
        serving = "-" if r.to_serving is None else f"{r.to_serving:.1f}"
        late = "-" if r.late_compiles is None else str(r.late_compiles)
        lines.append(f"| {r.arm} | {r.commit} | {serving} | {load} | {late} |")
    starts: dict[str, list[float]] = {}
    for r in results:
        if r.to_serving:
            starts.setdefault(r.arm, []).append(r.to_serving)
    serving = {arm: statistics.median(times) for arm, times in starts.items()}
    if "restart" in serving:
        ratios = [f"restart / {arm} {serving['restart'] / serving[arm]:.2f}"
                  for arm in ("sidecar", "none") if arm in serving]  # fmt: skip
        n = ", ".join(f"{arm} {len(times)}" for arm, times in starts.items())
        lines += ["", f"Start to SERVING: {', '.join(ratios)} (medians; starts: {n})"]
    lines += ["", "| arm | path | first (s) | steady median (s) | first / median |"]
    lines.append("|---|---|---:|---:|---:|")
    for r in results:
        for name, t in r.paths.items():
            lines.append(f"| {r.arm} | {name} | {t.first:.3f} | {t.steady:.3f} | {t.ratio:.2f} |")
    for r in results:
        if r.error:
            lines += ["", f"{r.arm} failed: {r.error.splitlines()[0]}"]
        if r.late_lines:
            lines += ["", f"{r.arm}: late compile after SERVING (service log):"]
            lines += [f"- {line}" for line in r.late_lines]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog="bench/cold_start.py",
        description="Time to SERVING and first-request / steady latency per request path, "
        "compiled with and without the warmup sidecar, and in mode none. "
        "Arguments after -- go to inference-svc.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add(
        "--arms",
        nargs="+",
        choices=ARMS,
        default=list(ARMS),
        help="arms to run, in order; an arm named again starts again (e.g. none restart "
        "none restart: the ratios use each arm's median start)",
    )
    add("--repeats", type=int, default=10, help="steady requests per path after the first")
    add("--max-tokens", type=int, default=8, help="max_tokens of each Generate")
    add(
        "--gap",
        type=float,
        default=1.0,
        help="seconds idle before every timed request, the first included: the first "
        "request follows an idle spell, and on a shared VM the next forward after an idle "
        "second is slower (Embed's forward in mode none: 9.5 against 5.8 ms back to back), "
        "so steady requests are timed after the same spell, or first / median measures "
        "idleness instead of cold paths",
    )
    add("--compiled-mode", choices=["default", "max-autotune"], default="default")
    add("--warm-cache", metavar="DIR", help="reuse this TORCHINDUCTOR_CACHE_DIR in every arm")
    add(
        "--compile-cache",
        type=Path,
        metavar="DIR",
        help="the sidecar and restart arms' --compile-cache-dir (default: a new empty one)",
    )
    add("--ctl-args", default="", help="extra warmup-ctl flags, as one string")
    add("--timeout", type=float, default=3600.0, help="seconds to SERVING, per arm")
    add("--log-dir", type=Path, help="where the logs go (default: a new temp dir)")
    add("--out", type=Path, help="also write the markdown tables here")
    add_quick_flags(p)  # --results: the log dir, unless --log-dir
    opts = p.parse_args(ours)
    if opts.quick:
        # the none arm, and no-sidecar uncompiled: the ungated path without minutes of compiles
        opts.arms, opts.compiled_mode = ["none", "no-sidecar"], "none"
        opts.repeats, opts.gap, opts.max_tokens = 2, 0.0, 4
    extra = [*model_args(opts), *extra]  # after --: those win
    if opts.arms.count("sidecar") > 1:
        p.error("sidecar is a cold start: it runs once (what it keeps makes a later one a restart)")
    if opts.repeats < 1 or opts.max_tokens < 1:
        p.error("--repeats and --max-tokens must be at least 1")
    return opts, extra


def describe_error(e: Exception) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
    return str(e) or type(e).__name__


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve-ungated"]:
        return serve_ungated(argv[1:])
    opts, extra = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # either stops the children cleanly
        signal.signal(sig, _raise_interrupt)
    log_dir = opts.log_dir or opts.results or Path(tempfile.mkdtemp(prefix="cold_start-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {log_dir}", flush=True)
    opts.compile_cache = opts.compile_cache or log_dir / "compile-cache"
    results: list[ArmResult] = []
    status = 0
    try:
        for k, arm in enumerate(opts.arms):
            results.append(result := ArmResult(arm))
            runs = opts.arms.count(arm)
            tag = f"{arm}-{opts.arms[: k + 1].count(arm)}" if runs > 1 else arm
            try:
                run_arm(result, opts, extra, log_dir, tag)
            except KeyboardInterrupt:
                result.error = "interrupted"
                raise
            except Exception as e:  # report it and go on with the next arm
                result.error = describe_error(e)
                print(f"   {arm} failed: {result.error}", flush=True)
                status = 1
    except KeyboardInterrupt:
        print("\ninterrupted: children stopped; partial results below", flush=True)
        status = 130
    text = table(results, opts, extra)
    print("\n" + text, end="")
    if opts.out:
        opts.out.write_text(text)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
