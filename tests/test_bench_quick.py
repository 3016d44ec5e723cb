"""Every benchmark still runs: each bench/*.py script with a __main__ runs in --quick mode, as
its own process, on the tiny models (real service processes, real gRPC), exits 0 and prints
its table. A bench script this file does not list fails the suite: give it a --quick mode
(bench/common.py's flags) and an entry in EXPECTED."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.proc, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
NUM = r"[\d.]+"
# Each script, and what its output must show: its table rows, with figures in them.
EXPECTED: dict[str, list[str]] = {
    "ab.py": [r"head/base", rf"curve\.0\.tok_s\s+{NUM}\s+{NUM}\s+{NUM}"],
    "accuracy.py": [rf"top-1 agreement {NUM}", rf"cosine min {NUM}"],
    "batch_wait.py": [r"wait 0\s+wait 20", rf"none\s+32\s+{NUM}\s+{NUM}"],
    "cold_start.py": [
        rf"\| none \| \S+ \| {NUM} \| embedding {NUM}, generative {NUM} \| 0 \|",
        rf"\| no-sidecar \| Generate logprobs=2 \| {NUM} \| {NUM} \| {NUM} \|",
    ],
    "compiled.py": [rf"float32\s+32\s+{NUM}", rf"float32\s+8\s+{NUM}"],
    "decode_attention.py": [rf"\s+1\s+64\s+{NUM}\s+{NUM}", r"max diff"],
    "decode_step.py": [
        r"memory read bandwidth",
        rf"int4\s+aoti\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}",
        r"--lm-weights auto here: \S+ \(",
    ],
    "embed_step.py": [rf"float32\s+eager\s+{NUM}\s+{NUM}", r"--embed-dtype auto here: \S+ \("],
    "embed_load.py": [rf"\| 4 \| {NUM} \| {NUM} \| {NUM} \|"],
    "latency.py": [
        rf"\| Embed, one short text: median latency \| {NUM} ms \| {NUM} ms \| {NUM} ms \|",
        rf"\| Generate greedy, 8 tokens: median tokens/s \| {NUM} \| {NUM} \| {NUM} \|",
    ],
    "load.py": [r"\| Embed \| \d+ \| OK \d+", r"queue depth 0, rows in use 0, late compiles 0"],
    "throughput.py": [
        rf"service \(none\)\s+{NUM}\s+{NUM}",
        rf"transformers\s+{NUM}\s+{NUM}",
        rf"TTFT mid-generation / idle:\s+{NUM}",
    ],
}


def has_main(path: Path) -> bool:
    """Whether the script has an ``if __name__ == "__main__":`` block."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def results_snapshot() -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in (BENCH / "results").rglob("*") if p.is_file()}


def test_every_bench_script_has_a_quick_run() -> None:
    scripts = sorted(p.name for p in BENCH.glob("*.py") if has_main(p))
    assert scripts == sorted(EXPECTED), "a bench script without a --quick run here, or gone"


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_bench_script_runs_quick(
    script: str, tiny_embed_dir: Path, tiny_lm_dir: Path, tmp_path: Path
) -> None:
    before = results_snapshot()
    argv = [sys.executable, str(BENCH / script), "--quick", "--results", str(tmp_path),
            "--embed-model", str(tiny_embed_dir), "--lm-model", str(tiny_lm_dir)]  # fmt: skip
    # The environment as conftest left it: offline, no compile cache kept.
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    missing = [pattern for pattern in EXPECTED[script] if not re.search(pattern, out)]
    assert not missing, f"{script}: no {missing} in its output:\n{run.stdout[-4000:]}"
    assert results_snapshot() == before, "a --quick run wrote into bench/results"
