"""Two commits of the service side by side: a bench script run against each, in turns.

    .venv/bin/python bench/ab.py --base REV [--rounds 2] [--keys REGEX] -- throughput.py ARGS

The bench script is this tree's; only the service it starts changes: the base arm's
`inference-svc` and `warmup-ctl` import REV's code (a `git worktree` on PYTHONPATH), the head
arm's this tree's. Arms alternate (base, head, base, head, ...) so that a machine that drifts
over the run drifts both. Every number in the script's JSON results is compared: the median
over rounds for each arm and head / base, one row per number (--keys narrows them). What the
contract (inference_api) or the bench itself changed between the two is not compared.

    .venv/bin/python bench/ab.py --quick --lm-model DIR   # smoke run (what CI runs): HEAD
        against HEAD, throughput.py --quick

A benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import add_quick_flags, model_args, results_dir  # noqa: E402


def worktree(rev: str, parent: Path) -> Path:
    path = parent / f"base-{rev[:12]}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev],
                   check=True, capture_output=True)  # fmt: skip
    return path


def leaves(data: object, prefix: str = "") -> dict[str, float]:
    """Every number in a JSON value, by its path (``curve.none.8.tokens_per_s``)."""
    if isinstance(data, bool):
        return {}
    if isinstance(data, int | float):
        return {prefix: float(data)}
    items = (
        data.items()
        if isinstance(data, dict)
        else enumerate(data)
        if isinstance(data, list)
        else ()
    )
    out: dict[str, float] = {}
    for key, value in items:
        out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def run_arm(tree: Path, script: list[str], results: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    which = subprocess.run(
        [sys.executable, "-c", "import inference_svc.engine.core as c; print(c.__file__)"],
        env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    print(f"--- {tree.name}: the service's code is {which}", flush=True)
    argv = [sys.executable, str(ROOT / "bench" / script[0]), *script[1:], "--results", str(results)]
    subprocess.run(argv, env=env, cwd=ROOT, check=True)
    found: dict[str, float] = {}
    for path in sorted(results.glob("*.json")):
        found.update(leaves(json.loads(path.read_text()), path.stem))
    return found


def median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(run[key] for run in runs if key in run)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default="HEAD", help="the commit to compare this tree against")
    p.add_argument("--rounds", type=int, default=2, help="runs of each arm, alternating")
    p.add_argument("--keys", default="", help="compare only the numbers whose path matches")
    add_quick_flags(p)
    p.add_argument("script", nargs="*", help="the bench script and its arguments (after --)")
    a = p.parse_args()
    script = a.script or ["throughput.py", "--modes", "none", "--no-peers"]
    if a.quick:  # HEAD against this tree, one round, the script's own smoke run
        script = ["throughput.py", "--quick", *model_args(a)]
        a.rounds = 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    # The head arm imports this tree's files at each of its rounds: an edit made while the
    # rounds run lands in some of them (seen once: a head arm that was two changes at once).
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "inference_svc"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    if dirty:
        print("note: inference_svc/ has uncommitted changes: the head arm runs them, and any "
              "edit made while the rounds run", file=sys.stderr)  # fmt: skip
    base = worktree(a.base, tmp)
    try:
        runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
        for r in range(a.rounds):
            for arm, tree in (("base", base), ("head", ROOT)):
                runs[arm].append(run_arm(tree, script, tmp / f"{arm}-{r}"))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                       check=False, capture_output=True)  # fmt: skip
    keys = sorted(set(runs["base"][0]) & set(runs["head"][0]))
    keys = [k for k in keys if re.search(a.keys, k)]
    table = {k: (median(runs["base"], k), median(runs["head"], k)) for k in keys}
    (results_dir(a) / "ab.json").write_text(json.dumps({"base": a.base, "script": script,
                                                        "numbers": table}, indent=1))  # fmt: skip
    print(f"\n{' '.join(script)}: base {a.base}, head this tree, median of {a.rounds} rounds")
    print(f"{'number':<56} {'base':>11} {'head':>11} {'head/base':>9}")
    for k, (b, h) in table.items():
        ratio = f"{h / b:9.2f}" if b else f"{'-':>9}"
        print(f"{k[:56]:<56} {b:11.4g} {h:11.4g} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
