"""What --embed-batch-wait-ms buys: Embed services with the wait off (0) and on (the
default), one after another, in each compilation mode, under 1 and 32 closed-loop clients.

For each: texts/s, median and p99 latency, and the mean rows per batch (from the service's
inference_batches metric). A lone client must not lose; 32 clients should gain.

  .venv/bin/python bench/batch_wait.py [--modes none,default] [--dtype bfloat16]
      [--waits 0,20] [--seconds 10] [--freeze-weights on]
  .venv/bin/python bench/batch_wait.py --quick --embed-model DIR   # smoke run: mode none,
      1 s per point, results in a temp dir

A benchmark, not a test: it prints figures (and bench/results/batch_wait.json), asserts
nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_quick_flags, model_args, results_dir  # noqa: E402
from bench.compiled import commit  # noqa: E402
from bench.embed_load import clients  # noqa: E402
from harness.procs import running_service  # noqa: E402

BATCHES = re.compile(r'inference_batches_total\{model="embedding",rows="(\d+)"\} (\S+)')


def batches(metrics_port: int) -> tuple[float, float]:
    """(batches run, rows run) by the embedding model so far."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    pairs = [(int(m[1]), float(m[2])) for m in BATCHES.finditer(text)]
    return sum(n for _, n in pairs), sum(rows * n for rows, n in pairs)


def arm(mode: str, wait: str, a: argparse.Namespace) -> dict:
    args = [*model_args(a), "--lm-model", "none", "--compilation-mode", mode, "--dtype", a.dtype,
            "--embed-batch-wait-ms", wait, "--metrics-port", "0"]  # fmt: skip
    if mode != "none":
        args += ["--freeze-weights", a.freeze_weights]
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, running_service(args, Path(tmp)) as svc:
        assert svc.metrics_port is not None
        for n in (1, 32):
            before = batches(svc.metrics_port)
            r = asyncio.run(clients(svc.target, n, a.seconds))
            after = batches(svc.metrics_port)
            r["rows_per_batch"] = (after[1] - before[1]) / max(1.0, after[0] - before[0])
            out[f"clients_{n}"] = r
            print(f"[{mode} wait {wait} ms] {n:>2} clients: {r['texts_s']:.0f} texts/s, "
                  f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
                  f"{r['rows_per_batch']:.1f} rows/batch", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="none,default")
    p.add_argument("--waits", default="0,20", help="--embed-batch-wait-ms values, off first")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--freeze-weights", choices=("off", "on"), default="on")
    add_quick_flags(p)
    a = p.parse_args(argv)
    if a.quick:
        a.modes, a.seconds = "none", 1.0
    waits = a.waits.split(",")
    r: dict = {"commit": commit(), "dtype": a.dtype, "freeze_weights": a.freeze_weights}
    for mode in a.modes.split(","):
        for wait in waits:
            r[f"{mode} {wait}"] = arm(mode, wait, a)
    print(f"\n{'mode':<10}{'clients':>8}" + "".join(f"{'wait ' + w:>12}" for w in waits)
          + f"{'on/off':>8}{'rows/batch':>14}")  # fmt: skip
    for mode in a.modes.split(","):
        for n in (1, 32):
            v = [r[f"{mode} {w}"][f"clients_{n}"] for w in waits]
            rows = " / ".join(f"{x['rows_per_batch']:.1f}" for x in v)
            print(f"{mode:<10}{n:>8}" + "".join(f"{x['texts_s']:>12.1f}" for x in v)
                  + f"{v[-1]['texts_s'] / v[0]['texts_s']:>8.2f}{rows:>14}")  # fmt: skip
    out = results_dir(a) / "batch_wait.json"
    out.write_text(json.dumps(r, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
