"""Where a run starts, whether it may go on with the config it has now, what it loads, and
how that is reported: every resume decision of the trainer, in one place.

- `find_start` (rank 0) decides where the run starts: the committed checkpoint that
  checkpoint.resume asks for (`auto`: the newest in the run's checkpoint directory), else the
  model tensors of checkpoint.init_from, else nothing; and in which run directory (a resumed
  run continues in its own; with resume=auto also a run stopped before its first checkpoint).
  It refuses a config change the saved run does not allow (below), and a start whose saves
  would write over committed checkpoints of later steps.
- `load_start` (every rank) loads what the start point holds; `start_rows` are the banner
  rows that report it, printed only once the load succeeded (the run directory too is made
  only then: a start that fails on a bad checkpoint writes nothing).

A resumed run must see the same model and the same samples: changes under `model.` and to
the data keys that decide which tokens a step sees are refused unless
checkpoint.allow_config_change=true, and so is a change of optim.name (the saved optimizer
state does not fit another optimizer; allowed, the new one starts with fresh state); every
other change (steps, layout, optimizer settings, precision, checkpointing, logging) is allowed
and reported. checkpoint.init_from needs the same model, but for how positions are encoded
(model.rope_theta, model.rope_scaling.*).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moe_checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    read_trainer_state,
    resolve_checkpoint,
)
from moe_plan.config import Change, Config, config_changes, resume_refuses
from moe_train.errors import ConfigError, MoeTrainError
from moe_train.train.checkpointing import Checkpoints, checkpoint_root
from moe_train.train.run_dir import choose_run_dir

POSITION_KEYS = ("model.rope_theta", "model.rope_scaling.")
"""Model keys that change how positions are encoded but no weight: checkpoint.init_from
accepts a change of them (how a model continues at a longer context)."""


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

    @property
    def switches_optimizer(self) -> bool:
        """Whether optim.name changed (allowed): the optimizer then starts afresh."""
        return any(c.key == "optim.name" for c in self.changes)


@dataclass(frozen=True)
class StartPoint:
    """Where a run starts: its run directory, and the checkpoint it resumes from or the one
    whose model tensors it starts from (at most one of the two)."""

    run_dir: Path
    resume: ResumePoint | None = None
    init_from: Path | None = None
    already_finished: bool = False
    """The resumed checkpoint is already at train.max_steps: nothing is left to run."""

    @property
    def step(self) -> int:
        """The step the run starts at: the resumed checkpoint's, or 0."""
        return self.resume.step if self.resume else 0

    def saved(self, key: str, default: Any = None) -> Any:
        """`key` of the resumed checkpoint's trainer state (a counter of the loop), else
        `default`."""
        return self.resume.state.get(key, default) if self.resume else default

    def describe(self) -> str:
        """How the run started, for the start banner (once loaded)."""
        if self.init_from is not None:
            return f"a new run, started from the model tensors of {self.init_from}"
        if self.resume is None:
            return "a new run"
        return f"resumed from {self.resume.path} at step {self.resume.step}"


# ---- where the run starts (rank 0) ------------------------------------------------------


def find_start(config: Config) -> StartPoint:
    """The start point of `config`'s run, its changes checked, its run directory chosen (not
    yet made), and its saves checked not to meet later checkpoints (rank 0).

    A relaunch that finds this run's checkpoint continues the run: checkpoint.init_from is
    then moot (and reported as ignored by `start_rows`)."""
    resume = _find_resume_point(config)
    init_from = None
    if config.checkpoint.init_from and resume is None:
        init_from = _find_init_checkpoint(config)
    run_dir = _open_run_dir(config, resume)
    if resume is not None and resume.step >= config.train.max_steps:
        return StartPoint(run_dir, resume, init_from, already_finished=True)
    start = StartPoint(run_dir, resume, init_from)
    if config.checkpoint.enabled:
        _check_no_newer_checkpoints(checkpoint_root(config, run_dir), start.step)
    return start


def _check_no_newer_checkpoints(root: Path, start_step: int) -> None:
    """Refuse to run on from `start_step` when saving would meet committed later steps."""
    newer = [p for p in list_checkpoints(root) if _checkpoint_step(p) > start_step]
    if newer:
        raise ConfigError(
            f"{root} already holds checkpoints after step {start_step} ({newer[-1].name}); "
            f"resuming from step {start_step} would save over that history: set checkpoint.dir "
            f"to another directory, or resume from {newer[-1]}"
        )


def _find_resume_point(config: Config) -> ResumePoint | None:
    """The checkpoint to continue from, with the config changes it allows."""
    path = _find_resume_checkpoint(config)
    if path is None:
        return None
    state = _read_state(path)
    if not isinstance(state.get("config"), dict) or "step" not in state:
        raise MoeTrainError(f"{path}/trainer_state.json holds no step or config to resume")
    allow = config.checkpoint.allow_config_change
    changes = _check_resume_config(state["config"], config.to_dict(), path, allow)
    switch = _optimizer_switch(state["config"], config)
    if switch is not None and not allow:
        raise ConfigError(
            f"optim.name={switch.now} differs from {switch.saved} in {path}: the saved "
            f"optimizer state does not fit it; restore optim.name={switch.saved}, or set "
            "checkpoint.allow_config_change=true to start the new optimizer's state fresh"
        )
    if switch is not None and switch not in changes:
        changes.append(switch)
    return ResumePoint(path, state, changes)


def _optimizer_switch(saved: dict[str, Any], config: Config) -> Change | None:
    """The change of optim.name from the saved config (one saved before the key existed ran
    AdamW), or None."""
    saved_optim = saved.get("optim")
    before = saved_optim.get("name", "adamw") if isinstance(saved_optim, dict) else "adamw"
    return None if before == config.optim.name else Change("optim.name", before, config.optim.name)


def _find_resume_checkpoint(config: Config) -> Path | None:
    """The committed checkpoint that checkpoint.resume asks for, or None to start afresh."""
    resume = config.checkpoint.resume
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoint_root(config, config.train.run_dir))
    try:
        return resolve_checkpoint(resume)
    except CheckpointError as e:
        raise ConfigError(
            f"checkpoint.resume={resume} is not a committed checkpoint (no COMMITTED marker) "
            f"nor a directory holding one; use auto, never or a checkpoint path"
        ) from e


def _find_init_checkpoint(config: Config) -> Path:
    """The committed checkpoint checkpoint.init_from names, after checking that its model
    config is this run's unless checkpoint.allow_config_change."""
    source = config.checkpoint.init_from
    try:
        path = resolve_checkpoint(source)
    except CheckpointError as e:
        raise ConfigError(
            f"checkpoint.init_from={source} is not a committed checkpoint (no COMMITTED marker) "
            f"nor a directory holding one"
        ) from e
    saved = _read_state(path).get("config")
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise MoeTrainError(f"{path}/trainer_state.json holds no model config")
    changes = config_changes({"model": saved["model"]}, {"model": config.to_dict()["model"]})
    differing = [
        c for c in changes if c.key.startswith("model.") and not c.key.startswith(POSITION_KEYS)
    ]
    if differing and not config.checkpoint.allow_config_change:
        first = differing[0]
        raise ConfigError(
            f"{first.key}={first.now!r} differs from {first.saved!r} in checkpoint.init_from="
            f"{path}: its weights fit only the model they were saved with; set "
            f"{first.key}={first.saved!r}, or checkpoint.allow_config_change=true"
        )
    return path


def _open_run_dir(config: Config, resume: ResumePoint | None) -> Path:
    """The run directory (not yet made). With resume=auto it is train.run_dir itself, also when a job was
    stopped before its first checkpoint, as long as it holds the same run."""
    auto = config.checkpoint.resume == "auto"
    saved_config = Path(config.train.run_dir) / "config.yaml"
    if auto and resume is None and saved_config.is_file():
        try:
            saved = yaml.safe_load(saved_config.read_text())
        except yaml.YAMLError as e:
            raise MoeTrainError(f"{saved_config} is not valid YAML; move it away") from e
        if isinstance(saved, dict):
            _check_resume_config(
                saved, config.to_dict(), saved_config, config.checkpoint.allow_config_change
            )
    return choose_run_dir(config.train.run_dir, reuse=auto or resume is not None)


def _read_state(path: Path) -> dict[str, Any]:
    """trainer_state.json of a checkpoint to start from (errors as MoeTrainError)."""
    try:
        return read_trainer_state(path)
    except CheckpointError as e:
        raise MoeTrainError(str(e)) from e


def _checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


# ---- which config changes a resumed run accepts ------------------------------------------


def _check_resume_config(
    saved: dict[str, Any], now: dict[str, Any], source: Path, allow: bool
) -> list[Change]:
    """The changes from the config saved in `source` (a checkpoint, or a run directory's
    config.yaml) that a resumed run may go on with; raises ConfigError on a refused one unless
    `allow`. Returns every change (refused ones too when allowed), for the report."""
    changes = config_changes(saved, now)
    refused = [c for c in changes if resume_refuses(c.key)]
    if refused and not allow:
        first = refused[0]
        what = "the model" if first.key.startswith("model.") else "which samples a step sees"
        more = f" (also changed: {', '.join(c.key for c in refused[1:])})" if refused[1:] else ""
        raise ConfigError(
            f"{first.key}={first.now!r} differs from {first.saved!r} in {source}: it "
            f"changes {what}{more}; restore it, or set checkpoint.allow_config_change=true"
        )
    return changes


# ---- what is loaded, and how it is reported (every rank) ---------------------------------


def load_start(start: StartPoint, checkpoints: Checkpoints) -> None:
    """Fill this rank's model (with the optimizer and RNG when resuming) from where the run
    starts; nothing for a new run."""
    if start.resume is not None:
        switched = start.resume.switches_optimizer
        checkpoints.load(start.resume.path, start.resume.state, with_optimizer=not switched)
    elif start.init_from is not None:
        checkpoints.load_model(start.init_from)


def start_rows(start: StartPoint, config: Config, layout: str) -> list[tuple[str, str]]:
    """The banner rows that say how the run started (after `load_start` succeeded): the run
    directory and where it started, and for a resumed run what differs from its checkpoint
    (config keys, the layout, an ignored checkpoint.init_from)."""
    rows = [("run", f"{start.run_dir} ({start.describe()})")]
    resume = start.resume
    if resume is None:
        return rows
    notes = [c.describe() for c in resume.changes]
    saved_layout = resume.state.get("topology")
    if saved_layout not in (None, layout):
        notes.append(f"layout {saved_layout} -> {layout}")
    if resume.switches_optimizer:
        notes.append(f"{config.optim.name} starts with fresh optimizer state")
    if config.checkpoint.init_from:
        notes.append(f"checkpoint.init_from={config.checkpoint.init_from} ignored (resuming)")
    if notes:
        rows.append(("changed", ", ".join(notes)))
    return rows
