"""moe-plan stands alone: none of its modules imports the trainer, its page's files ship with
it, and the old paths `moe_train.config` and `moe_train.plan` still work, with a deprecation
warning naming the new import."""

from __future__ import annotations

import ast
import sys
from importlib import resources
from pathlib import Path

import pytest

import moe_plan
import moe_plan.config

SOURCE = Path(moe_plan.__file__).parent
"""The package's files: the source in a clone, the installed wheel in a release check."""


def trainer_imports(root: Path) -> list[str]:
    """`file:line module` of each import of moe_train (anywhere) in the Python files under
    `root`."""
    faults = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            faults += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names]
    return [fault for fault in faults if fault.split()[-1].split(".")[0] == "moe_train"]


def test_moe_plan_imports_nothing_of_the_trainer(tmp_path):
    assert SOURCE.is_dir(), SOURCE
    assert trainer_imports(SOURCE) == []
    (tmp_path / "planted.py").write_text("import os\ndef f():\n    from moe_train import cli\n")
    assert trainer_imports(tmp_path) == ["planted.py:3 moe_train"]


def test_the_page_ships_with_the_package():
    page = resources.files("moe_plan").joinpath("page")
    assert {name: page.joinpath(name).is_file() for name in ("index.html", "page.js", "page.css")}
    assert b"page.js" in page.joinpath("index.html").read_bytes()


@pytest.mark.parametrize(
    ("old", "new", "submodule", "name"),
    [
        ("moe_train.config", moe_plan.config, "model", "ModelConfig"),
        ("moe_train.plan", moe_plan, "serve", "make_server"),
    ],
)
def test_an_old_path_warns_and_gives_the_same_objects(old, new, submodule, name):
    pytest.importorskip("moe_train")
    for module in [m for m in sys.modules if m == old or m.startswith(f"{old}.")]:
        del sys.modules[module]
    with pytest.warns(DeprecationWarning, match=rf"^{old} is deprecated: import {new.__name__} "):
        old_module = __import__(old, fromlist=["_"])
    assert sorted(old_module.__all__) == sorted(new.__all__)
    assert all(getattr(old_module, n) is getattr(new, n) for n in new.__all__)
    new_submodule = sys.modules[f"{new.__name__}.{submodule}"]
    old_submodule = __import__(f"{old}.{submodule}", fromlist=[name])
    assert old_submodule is new_submodule and getattr(old_submodule, name)


def test_config_errors_are_the_trainers_user_errors():
    pytest.importorskip("moe_train")
    from moe_train.errors import ConfigError, MoeTrainError

    assert ConfigError is moe_plan.ConfigError
    assert issubclass(ConfigError, MoeTrainError) and ConfigError.exit_code == 2
