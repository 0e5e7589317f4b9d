"""The launcher's environment variables are read in one place, `moe_train.train.runtime`."""

import re
from pathlib import Path

import pytest

from moe_train.errors import ConfigError
from moe_train.train.runtime import launch_id, launched_local_rank, launched_rank

LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
)
PACKAGES = Path(__file__).resolve().parents[2] / "packages"


def test_launcher_variables_are_read_only_by_the_runtime_module():
    alternatives = "|".join(LAUNCHER_VARIABLES)
    named = re.compile(rf"""["']({alternatives})["']""")
    readers = sorted(
        str(path.relative_to(PACKAGES))
        for path in PACKAGES.glob("*/src/**/*.py")
        if "environ" in (text := path.read_text()) and named.search(text)
    )
    assert readers == ["moe-train/src/moe_train/train/runtime.py"]


def test_rank_and_job_come_from_the_launcher(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert (launched_rank(), launched_local_rank(), launch_id()) == (0, 0, "||")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "node7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert (launched_rank(), launched_local_rank(), launch_id()) == (3, 1, "node7|29500|")
    monkeypatch.setenv("RANK", "first")
    with pytest.raises(ConfigError, match=r"^RANK='first' is not a number$"):
        launched_rank()
