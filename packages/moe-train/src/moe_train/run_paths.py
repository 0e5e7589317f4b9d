"""Where a run's files go, as its config says: one rule for the trainer, resume and export."""

from __future__ import annotations

from pathlib import Path

from moe_plan.config import Config


def checkpoint_root(config: Config, run_dir: Path | str) -> Path:
    """Where checkpoints go: checkpoint.dir, or RUN_DIR/checkpoints."""
    return Path(config.checkpoint.dir) if config.checkpoint.dir else Path(run_dir) / "checkpoints"
