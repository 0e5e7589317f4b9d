"""Rules about the packages' sources that hold across packages, checked by reading them (the
repository's sources: these tests do not run against an installed wheel)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).parents[1] / "packages"


def _torchao_imports_outside_the_block(tree: ast.AST) -> list[int]:
    """Lines that import torchao outside a `with quiet_torchao_import():` block."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
            isinstance(item.context_expr, ast.Call)
            and getattr(item.context_expr.func, "id", None) == "quiet_torchao_import"
            for item in node.items
        ):
            inside |= {id(child) for child in ast.walk(node)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        if any(n.split(".")[0] == "torchao" for n in names) and id(node) not in inside:
            lines.append(node.lineno)
    return lines


def test_every_torchao_import_of_the_packages_runs_in_the_quiet_block():
    sources = sorted(PACKAGES.glob("*/src/**/*.py"))
    assert sources
    loud = {
        f"{path.relative_to(PACKAGES)}:{line}"
        for path in sources
        for line in _torchao_imports_outside_the_block(ast.parse(path.read_text()))
    }
    assert not loud, f"torchao imported outside quiet_torchao_import(): {sorted(loud)}"
