"""Where a run starts: the checkpoint it resumes from, and its run directory (rank 0)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moe_train.config import Config
from moe_train.errors import MoeTrainError
from moe_train.train.checkpointing import find_resume_checkpoint, read_resume_state
from moe_train.train.config_changes import Change, check_resume_config
from moe_train.train.run_dir import prepare_run_dir


@dataclass(frozen=True)
class ResumePoint:
    """A committed checkpoint to continue from, read and checked on rank 0."""

    path: Path
    state: dict[str, Any]
    """Its trainer_state.json."""
    changes: list[Change]
    """Config keys that differ from the checkpoint's (all allowed)."""

    @property
    def step(self) -> int:
        return int(self.state["step"])


def find_resume_point(config: Config) -> ResumePoint | None:
    """The checkpoint to continue from, with the config changes it allows (rank 0)."""
    path = find_resume_checkpoint(config)
    if path is None:
        return None
    state = read_resume_state(path)
    if not isinstance(state.get("config"), dict) or "step" not in state:
        raise MoeTrainError(f"{path}/trainer_state.json holds no step or config to resume")
    changes = check_resume_config(
        state["config"], config.to_dict(), path, config.checkpoint.allow_config_change
    )
    return ResumePoint(path, state, changes)


def open_run_dir(config: Config, resume: ResumePoint | None) -> Path:
    """The run directory (rank 0). With resume=auto it is train.run_dir itself, also when a
    job was stopped before its first checkpoint, as long as it holds the same run."""
    auto = config.checkpoint.resume == "auto"
    saved_config = Path(config.train.run_dir) / "config.yaml"
    if auto and resume is None and saved_config.is_file():
        try:
            saved = yaml.safe_load(saved_config.read_text())
        except yaml.YAMLError as e:
            raise MoeTrainError(f"{saved_config} is not valid YAML; move it away") from e
        if isinstance(saved, dict):
            check_resume_config(
                saved, config.to_dict(), saved_config, config.checkpoint.allow_config_change
            )
    return prepare_run_dir(config.train.run_dir, reuse=auto or resume is not None)
