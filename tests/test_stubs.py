"""The committed Python stubs are exactly what tools/gen_protos.py makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "inference_api" / "stubs"


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*.py*")}
    committed = {p.relative_to(COMMITTED): p.read_text() for p in COMMITTED.rglob("*.py*")}
    assert sorted(fresh) == sorted(committed), "stub files differ: run tools/gen_protos.py"
    stale = [str(name) for name, text in fresh.items() if committed[name] != text]
    assert not stale, f"stale stubs {stale}: run python tools/gen_protos.py"
