"""moe-data stands alone: no module of it imports the trainer, none imports torch at import
time, and the old `moe_train.data` path still works, with a deprecation warning."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import moe_data

SOURCE = Path(moe_data.__file__).parent
"""The package's files: the source in a clone, the installed wheel in a release check."""


def imported_modules(source: str, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of each import in `source`; with `top_level_only`, those that run when
    the module is imported (not inside a function or an `if TYPE_CHECKING:` block)."""
    tree = ast.parse(source)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def forbidden_imports(root: Path) -> list[str]:
    """`file:line module` of each import of moe_train (anywhere) or of torch (at import time)
    in the Python files under `root`."""
    faults = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for line, module in imported_modules(source):
            if module.split(".")[0] == "moe_train":
                faults.append(f"{path.name}:{line} {module}")
        for line, module in imported_modules(source, top_level_only=True):
            if module.split(".")[0] == "torch":
                faults.append(f"{path.name}:{line} {module}")
    return faults


def test_moe_data_imports_neither_the_trainer_nor_torch_at_import_time():
    assert SOURCE.is_dir(), SOURCE
    assert forbidden_imports(SOURCE) == []


def test_the_scan_finds_a_planted_trainer_or_torch_import(tmp_path):
    (tmp_path / "fine.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
        "def f():\n    import torch\n"
    )
    assert forbidden_imports(tmp_path) == []
    (tmp_path / "planted.py").write_text(
        "import os\nfrom moe_train.errors import ConfigError\nimport torch.nn\n"
        "def g():\n    import moe_train\n"
    )
    assert forbidden_imports(tmp_path) == [
        "planted.py:2 moe_train.errors",
        "planted.py:5 moe_train",
        "planted.py:3 torch.nn",
    ]


def test_importing_moe_data_loads_neither_the_trainer_nor_torch():
    code = (
        "import sys, moe_data\n"
        "loaded = sorted(m for m in ('torch', 'moe_train') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_old_moe_train_data_path_warns_and_gives_the_same_objects():
    pytest.importorskip("moe_train")
    sys.modules.pop("moe_train.data", None)
    with pytest.warns(DeprecationWarning, match="moe_train.data is deprecated: import moe_data"):
        import moe_train.data as old
    from moe_data.labels import IGNORE_INDEX
    from moe_train.data.labels import IGNORE_INDEX as old_ignore_index

    assert old.TokenDataset is moe_data.TokenDataset
    assert sorted(old.__all__) == sorted(moe_data.__all__)
    assert old_ignore_index == IGNORE_INDEX


def test_data_errors_are_the_trainers_user_errors():
    pytest.importorskip("moe_train")
    from moe_data import DataError, PreparationStopped
    from moe_train.errors import DataError as TrainerDataError
    from moe_train.errors import MoeTrainError

    assert TrainerDataError is DataError
    assert issubclass(DataError, MoeTrainError) and DataError.exit_code == 2
    assert issubclass(PreparationStopped, MoeTrainError) and PreparationStopped.exit_code == 75
