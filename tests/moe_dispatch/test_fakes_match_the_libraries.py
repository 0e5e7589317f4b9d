"""The fake nvshmem4py of fake_nvshmem.py against the real package: every name that
``moe_dispatch.transport_nvshmem`` reads from ``nvshmem.core`` and ``cuda.core`` exists in the
installed nvshmem4py and cuda-core with the fake's parameters (names, kinds and defaults), and
every call the transport makes binds to the real signature. nvshmem4py imports without a GPU;
the dev group installs the version the fake follows.

DeepEP is not checked this way: no build of it installs on a machine without CUDA. PyPI holds
only deep_ep 1.0.0, a source distribution that compiles CUDA kernels, and it is DeepEP V1's
``Buffer``, not the V2 ``ElasticBuffer`` that ``moe_dispatch.deepep`` calls; fake_deep_ep.py
names the commit of DeepEP's sources it follows.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import sys
from pathlib import Path
from typing import Any

import fake_nvshmem
import pytest

import moe_dispatch.transport_nvshmem as transport_nvshmem

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="nvshmem4py has Linux wheels only")

LIBRARY_NAMES = {"nvshmem_core": "nvshmem.core", "cuda_core": "cuda.core"}
"""The transport's local names for the libraries (``self._nvshmem`` is nvshmem.core too)."""


def _library_path(node: ast.expr) -> tuple[str, ...] | None:
    """('nvshmem.core', 'Teams', 'TEAM_WORLD') for ``nvshmem_core.Teams.TEAM_WORLD``, else None."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr == "_nvshmem":
            return ("nvshmem.core", *reversed(names)) if names else None
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in LIBRARY_NAMES and names:
        return (LIBRARY_NAMES[node.id], *reversed(names))
    return None


def used_names(source: str) -> tuple[set[tuple[str, ...]], list[tuple[tuple[str, ...], ast.Call]]]:
    """Every library name the source reads (longest chains only) and every call of one."""
    tree = ast.parse(source)
    inner = {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
    }  # an attribute that is the value of a longer chain
    paths = {
        path
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and id(node) not in inner
        if (path := _library_path(node))
    }
    calls = [
        (path, node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and (path := _library_path(node.func))
    ]
    return paths, calls


def real_object(path: tuple[str, ...]) -> Any:
    found = importlib.import_module(path[0])
    for name in path[1:]:
        found = getattr(found, name)
    return found


def fake_object(path: tuple[str, ...]) -> Any:
    assert path[1] in fake_nvshmem.MODULES[path[0]], f"the fake's {path[0]} lacks {path[1]}"
    found = getattr(fake_nvshmem, path[1])
    for name in path[2:]:
        found = getattr(found, name)
    return found


def parameters(thing: Any) -> list[tuple[str, Any, Any]] | None:
    """(name, kind, default) of each parameter, or None where there is no signature."""
    try:
        signature = inspect.signature(thing)
    except (TypeError, ValueError):
        return None
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def mismatches(source: str) -> list[str]:
    """What the source uses that the real libraries lack, or the fake models otherwise."""
    paths, calls = used_names(source)
    problems = []
    for path in sorted(paths | {path for path, _ in calls}):
        dotted = ".".join(path)
        try:
            real = real_object(path)
        except AttributeError:
            problems.append(f"{dotted}: not in the installed library")
            continue
        fake = fake_object(path)
        if callable(real) or callable(fake):
            if parameters(real) != parameters(fake):
                problems.append(f"{dotted}: real {parameters(real)} but fake {parameters(fake)}")
        elif real != fake:
            problems.append(f"{dotted}: real {real!r} but fake {fake!r}")
    for path, call in calls:
        if any(isinstance(arg, ast.Starred) for arg in call.args) or any(
            keyword.arg is None for keyword in call.keywords
        ):
            problems.append(f"{'.'.join(path)}: a call with * or ** cannot be checked")
            continue
        arguments = [object()] * len(call.args)
        keywords = {keyword.arg: object() for keyword in call.keywords}
        try:
            inspect.signature(real_object(path)).bind(*arguments, **keywords)
        except (TypeError, AttributeError) as error:
            problems.append(f"{'.'.join(path)} at line {call.lineno}: {error}")
    return problems


SOURCE = Path(transport_nvshmem.__file__).read_text()


def test_the_installed_nvshmem4py_is_the_version_the_fake_follows():
    version = importlib.metadata.version("nvshmem4py-cu13")
    assert version == fake_nvshmem.FOLLOWS_VERSION, (
        f"nvshmem4py-cu13 {version} is installed but the fake follows "
        f"{fake_nvshmem.FOLLOWS_VERSION}: read the new version's API, update fake_nvshmem.py"
    )


def test_every_library_name_the_transport_uses_is_real_and_faked_alike():
    paths, calls = used_names(SOURCE)
    assert {".".join(p) for p in paths} >= {
        "nvshmem.core.init",
        "nvshmem.core.put",
        "nvshmem.core.Teams.TEAM_WORLD",
        "cuda.core.Buffer.from_handle",
    }, "the transport's use of the libraries was not found: fix used_names"
    assert len(calls) >= 7
    assert mismatches(SOURCE) == []


def test_a_name_or_argument_the_library_lacks_is_found():
    renamed = SOURCE.replace("remote_pe=pe", "remote=pe").replace(".get_unique_id(", ".unique_id(")
    problems = mismatches(renamed)
    assert any("nvshmem.core.unique_id: not in the installed library" in p for p in problems)
    assert any(p.startswith("nvshmem.core.put at line") and "remote" in p for p in problems)
