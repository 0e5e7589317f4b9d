"""The planner and the config import and run without torch: the planner's answer with torch
blocked is the answer with it, and neither the trainer nor any torch package (moe-dispatch,
moe-parallel) is imported."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

from moe_plan.cli import main

ROOT = Path(__file__).resolve().parents[2]
PLANS = (
    ("configs/tiny.yaml", "--gpus", "8", "--gpu", "b300"),
    ("configs/published-47b-a3b.yaml", "--gpus", "8", "--gpu", "b300"),
)
SEPARATOR = "\n=== next plan ===\n"

# Runs in a fresh interpreter: torch is blocked before anything is imported, so any import
# of it (direct or through a package below) raises ImportError.
WITHOUT_TORCH = f"""
import contextlib, io, sys
sys.modules["torch"] = None
import moe_plan.config
import moe_plan
import moe_plan.serve
from moe_plan.cli import main
outs = []
for args in {PLANS!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    outs.append(f"{{code}}\\n{{out.getvalue()}}")
below = sorted(
    name for name, module in sys.modules.items()
    if module is not None
    and name.split(".")[0] in ("torch", "moe_dispatch", "moe_parallel", "moe_train")
)
assert not below, below
sys.stdout.write({SEPARATOR!r}.join(outs))
"""


def _with_torch(args: tuple[str, ...]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
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
