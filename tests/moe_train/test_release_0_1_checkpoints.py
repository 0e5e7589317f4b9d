"""A run written by release 0.1 (before the planner and the typed config left moe-train for
moe-plan) still verifies and resumes: its checkpoints, trainer state and manifest are read by
today's code and give the same numbers.

The files under data/release_0_1_run were written by `moe-train train config.yaml` at that
release (commit 2c6570c): a 1-layer MoE on `tokens.npy`, checkpoints after steps 1 and 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from launch import run_cli

WRITTEN = Path(__file__).parent / "data" / "release_0_1_run"


def _losses(metrics: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def test_a_release_0_1_run_verifies_and_resumes_to_the_same_numbers(tmp_path):
    shutil.copytree(WRITTEN, tmp_path, dirs_exist_ok=True)
    checkpoints = tmp_path / "run" / "checkpoints"
    outcome = run_cli(
        "verify",
        str(checkpoints / "step_00000001"),
        str(checkpoints / "step_00000002"),
        cwd=tmp_path,
    )
    assert outcome.returncode == 0, outcome.stderr
    assert "every tensor is identical" in outcome.stdout

    outcome = run_cli(
        "train",
        "config.yaml",
        "--checkpoint.resume=run/checkpoints/step_00000001",
        "--train.run_dir=resumed",
        cwd=tmp_path,
    )
    assert outcome.returncode == 0, outcome.stderr
    assert (
        _losses(tmp_path / "resumed" / "metrics.jsonl")[2]
        == _losses(tmp_path / "run" / "metrics.jsonl")[2]
    )
    resumed = tmp_path / "resumed" / "checkpoints" / "step_00000002"
    written = checkpoints / "step_00000002"
    for name in ("model-00001-of-00001.safetensors", "optim-00001-of-00001.safetensors"):
        assert (resumed / name).read_bytes() == (written / name).read_bytes(), name
