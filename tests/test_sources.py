"""Rules about the packages' sources that hold across packages, checked by reading them (the
repository's sources: these tests do not run against an installed wheel)."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
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


def _imported_modules(tree: ast.AST) -> set[str]:
    """Every module `tree` imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_trainer_loop_and_hf_import_nothing_from_the_rooms_above_them():
    """moe_train.train does not import generate or hf (which sit above it), and hf does not
    import train: no upward edge, and no lazy cycle train -> generate -> hf -> train."""
    root = PACKAGES / "moe-train" / "src" / "moe_train"
    upward = {"train": ("moe_train.generate", "moe_train.hf"), "hf": ("moe_train.train",)}
    found = {
        f"{path.relative_to(root)} imports {module}"
        for room, above in upward.items()
        for path in sorted((root / room).glob("*.py"))
        for module in _imported_modules(ast.parse(path.read_text()))
        if module.startswith(above)
    }
    assert not found, sorted(found)


def _bash_words(script: Path, array: str) -> set[str]:
    """The keys (`[name]=...` entries) or words of the bash array `array` in `script`."""
    text = script.read_text()
    start = text.index(f"{array}=(")
    body = text[start + len(array) + 2 : text.index(")", start)]
    keys = re.findall(r"\[([\w-]+)\]=", body)
    return set(keys) if keys else set(body.split())


def test_the_release_and_wheel_scripts_know_every_package():
    """A new package under packages/ is built, checked and releasable: scripts/packages.sh
    lists it (with its module and siblings) and scripts/release.sh has its test extras."""
    names = {
        tomllib.loads(p.read_text())["project"]["name"] for p in PACKAGES.glob("*/pyproject.toml")
    }
    scripts = PACKAGES.parent / "scripts"
    for script, array in [
        ("packages.sh", "packages"),
        ("packages.sh", "declare -A module_of"),
        ("packages.sh", "declare -A wheel_deps"),
        ("release.sh", "declare -A test_deps"),
    ]:
        assert _bash_words(scripts / script, array) == names, f"{script}: {array}"


def _imports(source: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import statement of the Python file `source`."""
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def _rooms_imported(room: Path, rooms: set[str]) -> set[str]:
    """The other rooms of moe_train that the module or folder `room` imports."""
    found = set()
    for source in [room] if room.is_file() else room.rglob("*.py"):
        for _line, name in _imports(source):
            parts = name.split(".")
            if parts[0] == "moe_train" and len(parts) > 1 and parts[1] in rooms:
                found.add(parts[1])
    return found - {room.stem}


def test_the_rooms_of_moe_train_import_what_docs_packages_says():
    """docs/packages.md's table of moe_train's rooms lists, for each, the rooms it imports."""
    text = (PACKAGES.parent / "docs" / "packages.md").read_text()
    table = text.split("<!-- rooms -->\n```\n", 1)[1].split("```", 1)[0]
    said = {}
    for line in table.splitlines():
        if line and not line[0].isspace():  # a room's first line; its arrow may come later
            room = line.split()[0].removesuffix("/").removesuffix(".py")
        if "->" in line:
            arrows = line.split("->", 1)[1].strip()
            said[room] = set() if arrows == "(none)" else set(arrows.split(", "))
    source = PACKAGES / "moe-train" / "src" / "moe_train"
    paths = {
        room: source / room if (source / room).is_dir() else source / f"{room}.py" for room in said
    }
    assert all(path.exists() for path in paths.values()), paths
    imported = {room: _rooms_imported(path, set(said)) for room, path in paths.items()}
    assert imported == said


PUBLIC_SUBMODULES = {"moe_plan.config", "moe_plan.cli"}
"""Modules of a package that other packages may import besides its `__init__`: the typed
config every package above the planner reads, and the `moe-plan` command `moe-train plan` runs."""


def test_packages_use_only_each_others_public_api():
    """An import of another moe-stack package names the package (its `__init__`) or one of
    PUBLIC_SUBMODULES, never a private module of it."""
    private = []
    for source in PACKAGES.glob("*/src/*/**/*.py"):
        own = source.relative_to(PACKAGES).parts[2]
        for line, name in _imports(source):
            top = name.split(".")[0]
            outside = top.startswith("moe_") and top != own and name != top
            if outside and name not in PUBLIC_SUBMODULES:
                private.append(f"{source.relative_to(PACKAGES)}:{line} {name}")
    assert private == []
