"""The planner and the config import and run without torch: the planner's answer with torch
blocked is the answer with it, none of the torch packages below (moe-dispatch, moe-parallel)
is imported, and of the trainer's rooms only the config, its errors and the CLI's front."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

from moe_train.cli import main

ROOT = Path(__file__).resolve().parents[2]
PLANS = (
    ("configs/tiny.yaml", "--gpus", "8", "--gpu", "b300"),
    ("configs/published-47b-a3b.yaml", "--gpus", "8", "--gpu", "b300"),
)
SEPARATOR = "\n=== next plan ===\n"
ROOMS = {"moe_train.cli", "moe_train.config", "moe_train.errors", "moe_train.plan"}
"""The parts of moe_train the planner may import."""

# Runs in a fresh interpreter: torch is blocked before anything is imported, so any import
# of it (direct or through a package below) raises ImportError.
WITHOUT_TORCH = f"""
import contextlib, io, sys
sys.modules["torch"] = None
import moe_train.config
import moe_train.plan
import moe_train.plan.serve
from moe_train.cli import main
outs = []
for args in {PLANS!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *args])
    outs.append(f"{{code}}\\n{{out.getvalue()}}")
below = sorted(
    name for name, module in sys.modules.items()
    if module is not None and name.split(".")[0] in ("torch", "moe_dispatch", "moe_parallel")
)
assert not below, below
rooms = set(".".join(name.split(".")[:2]) for name in sys.modules if name.startswith("moe_train."))
assert rooms <= set({sorted(ROOMS)!r}), sorted(rooms)
sys.stdout.write({SEPARATOR!r}.join(outs))
"""


def _with_torch(args: tuple[str, ...]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *args])
    return f"{code}\n{out.getvalue()}"


def test_the_planner_runs_without_torch_and_answers_the_same() -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split(SEPARATOR) == [_with_torch(args) for args in PLANS]
