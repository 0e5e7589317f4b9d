"""torchao is imported without the deprecation notices torch prints about torchao's enums."""

from __future__ import annotations

import ast
import enum
import io
import logging
from pathlib import Path

import torch.utils._pytree as pytree

from moe_kernels import quiet_torchao_import

PACKAGES = Path(__file__).parents[2] / "packages"


def _logged_while_registering(make_enum, quiet: bool) -> str:
    """What torch logs while registering a fresh enum as a pytree constant, as torchao's
    import does for KernelPreference."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("torch.utils._pytree")
    logger.addHandler(handler)
    try:
        if quiet:
            with quiet_torchao_import():
                pytree.register_constant(make_enum())
        else:
            pytree.register_constant(make_enum())
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def _fresh_enum() -> type[enum.Enum]:
    return enum.Enum("Preference", {"AUTO": "auto"}, type=str)


def test_the_enum_registration_notice_is_dropped_inside_the_block_only():
    loud = _logged_while_registering(_fresh_enum, quiet=False)
    if "is an Enum subclass" not in loud:  # torch before enums were opaque: no notice at all
        return
    assert _logged_while_registering(_fresh_enum, quiet=True) == ""
    assert not logging.getLogger("torch.utils._pytree").filters  # removed after the block


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
