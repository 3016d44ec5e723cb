"""Every test module names exactly one tier (tests/README.md) in its module-level
``pytestmark``, so ``-m unit``, ``-m rpc``, ``-m proc`` and ``-m deploy`` split the whole suite
and a new module cannot fall out of the fast tier (or into it) unnoticed."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TIERS = ("unit", "rpc", "proc", "deploy")
TESTS = Path(__file__).resolve().parent
MODULES = sorted(TESTS.glob("test_*.py"))


def marks_of(path: Path) -> list[str]:
    """The ``pytest.mark.<name>`` names in the module-level ``pytestmark`` assignment."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            for sub in ast.walk(node.value):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr == "mark"
                ):
                    names.append(sub.attr)
    return names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_each_module_has_exactly_one_tier(path: Path) -> None:
    tiers = [m for m in marks_of(path) if m in TIERS]
    assert len(tiers) == 1, (
        f"{path.name}: module-level pytestmark names tiers {tiers}; add exactly one of "
        f"pytest.mark.{{{','.join(TIERS)}}} (tests/README.md says which)"
    )


def test_the_tiers_are_registered_markers() -> None:
    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    markers = config["tool"]["pytest"]["ini_options"]["markers"]
    registered = {line.split(":", 1)[0] for line in markers}
    assert set(TIERS) <= registered
