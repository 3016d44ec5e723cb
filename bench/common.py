"""What the benchmarks share besides the process harness (harness.procs): the --quick flags
every bench script takes, where results go, and plots."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def add_quick_flags(p: argparse.ArgumentParser) -> None:
    """--quick, the models and --results: the same flags in every bench script."""
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run in seconds (what CI runs): tiny loads and durations, peers skipped, "
        "results in a new temp dir unless --results; pair with --embed-model/--lm-model "
        "(tiny models) to stay fast",
    )
    p.add_argument("--embed-model", help="the embedding model (default: the packaged one)")
    p.add_argument("--lm-model", help="the generative model (default: the packaged one)")
    p.add_argument("--results", type=Path, help="where JSON and plots go (default: bench/results)")


def model_args(a: argparse.Namespace) -> list[str]:
    """The service flags for --embed-model/--lm-model; put them first, so that a later
    ``--embed-model none`` of an arm wins."""
    args = []
    if a.embed_model:
        args += ["--embed-model", a.embed_model]
    if a.lm_model:
        args += ["--lm-model", a.lm_model]
    return args


def results_dir(a: argparse.Namespace) -> Path:
    """--results, else a new temp dir with --quick (never bench/results), else bench/results."""
    path = a.results or (Path(tempfile.mkdtemp(prefix="bench-quick-")) if a.quick else RESULTS)
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_plot(plot: Callable[[dict, Path], None], results: dict, path: Path) -> None:
    """``plot(results, path)``, or a note when matplotlib is missing."""
    try:
        plot(results, path)
        print(f"\nwrote {path} and {path.with_suffix('.json').name}")
    except ImportError:
        print("\nmatplotlib not installed (pip install '.[bench]'): no plot")
