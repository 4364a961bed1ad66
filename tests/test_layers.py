"""The package layers: imports point down only, and no two top-level packages import each other.

    protocol  ->  runtime  ->  producer | consumer  ->  inferq (the CLI)
    loadgen: an outside client; of the product it may use only protocol (the wire contract,
    option declarations and exit statuses)

Every import counts, lazy ones inside functions and ``TYPE_CHECKING`` blocks included: a lazy
import still couples the packages, it only hides the cycle until run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAY_IMPORT: dict[str, frozenset[str]] = {
    "protocol": frozenset(),
    "runtime": frozenset({"protocol"}),
    "producer": frozenset({"protocol", "runtime"}),
    "consumer": frozenset({"protocol", "runtime"}),
    "loadgen": frozenset({"protocol"}),
    "inferq": frozenset({"protocol", "runtime", "producer", "consumer", "loadgen"}),
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import in the file."""
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name.split(".")[0], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


def edges() -> list[tuple[str, str, str]]:
    """(importing package, imported package, 'file:line') between different product packages."""
    out = []
    for package in MAY_IMPORT:
        for path in sorted((ROOT / package).rglob("*.py")):
            for target, line in imported_packages(path):
                if target in MAY_IMPORT and target != package:
                    out.append((package, target, f"{path.relative_to(ROOT)}:{line}"))
    return out


def test_every_product_package_is_declared_in_the_layers() -> None:
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages - {"bench", "tests", "models"} == set(MAY_IMPORT)


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_imports_point_down_only(package: str) -> None:
    upward = [
        f"{where} imports {target}"
        for source, target, where in edges()
        if source == package and target not in MAY_IMPORT[package]
    ]
    assert upward == [], f"{package} may import only {sorted(MAY_IMPORT[package])}"


def test_no_cycle_between_top_level_packages() -> None:
    graph: dict[str, set[str]] = {p: set() for p in MAY_IMPORT}
    for source, target, _ in edges():
        graph[source].add(target)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start]
        )

    cycles = sorted(p for p in graph if reaches(p, p, {p}))
    assert cycles == []
