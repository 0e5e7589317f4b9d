"""Experiment trackers: every metrics row also to TensorBoard and/or Weights & Biases.

Both are optional extras, imported only when asked for: `moestack-train[tensorboard]` and
`moestack-train[wandb]`. Only rank 0 opens trackers, as only rank 0 writes metrics.jsonl. A scalar
is named by its metrics key ("loss", "eval_loss", "lr", ...) and plotted over the row's "step";
values that are not numbers (null, lists, strings) and the row's "time" are left out.

- TensorBoard: event files in RUN_DIR/tensorboard (scalars are stored as float32). A resumed
  run hides the events of the steps it rewrites (SummaryWriter's `purge_step`).
- W&B: the run is named after the run directory, keeps its files in RUN_DIR/wandb and gets the
  run's config as its config. Its id is kept in RUN_DIR/wandb_run_id, so a resumed run
  continues the same W&B run; steps the W&B run already holds are not sent again.
"""

from __future__ import annotations

import numbers
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moe_train.errors import ConfigError, MoeTrainError

TENSORBOARD_DIR = "tensorboard"
"""The folder of the run directory that holds the TensorBoard event files."""
WANDB_RUN_ID_FILE = "wandb_run_id"
"""The file of the run directory that holds the W&B run id, for a resume to continue it."""

NOT_SCALARS = ("step", "time")
"""Metrics keys that are not plotted: the x-axis, and the wall clock each tracker records."""

_WANDB_PROJECT_FORBIDDEN = "/\\#?%:"
_WANDB_PROJECT_MAX_CHARS = 128


def check_tracking_available(tensorboard: bool, wandb_project: str | None) -> None:
    """Raise ConfigError (one line, naming the extra to install) when a tracker that is asked
    for cannot run here. Called at start-up, before anything is trained or written."""
    if tensorboard:
        _summary_writer_class()
    if wandb_project is not None:
        _check_wandb_project(wandb_project)
        _wandb(wandb_project)


def scalars(row: Mapping[str, Any]) -> dict[str, int | float]:
    """The numbers of a metrics row, by key, without "step" (the x-axis) and "time" (each
    tracker keeps its own clock): null, booleans, strings, lists and other nested values are
    left out."""
    values: dict[str, int | float] = {}
    for key, value in row.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        values[key] = int(value) if isinstance(value, numbers.Integral) else float(value)
    return values


class Trackers:
    """The trackers of one run (TensorBoard, W&B, both or neither): `log` each metrics row,
    `close` at the end. Open with `Trackers.open`."""

    def __init__(self, tensorboard_writer: Any = None, wandb_run: Any = None) -> None:
        self.tensorboard_writer = tensorboard_writer
        """A torch.utils.tensorboard SummaryWriter, or None."""
        self.wandb_run = wandb_run
        """A wandb Run, or None."""
        self._wandb_first_step = int(getattr(wandb_run, "starting_step", 0) or 0)
        # A resumed W&B run refuses steps below the one it stopped at; those rows are not sent.

    @classmethod
    def open(
        cls,
        run_dir: Path,
        config: Mapping[str, Any],
        *,
        tensorboard: bool,
        wandb_project: str | None,
        resumed_from_step: int = 0,
    ) -> Trackers:
        """The trackers asked for, writing under `run_dir`.

        `config` (plain values, e.g. `Config.to_dict()`) becomes the W&B run's config.
        `resumed_from_step` is the step this run starts from: rows of later steps are written
        again, so TensorBoard hides the ones an earlier run wrote; at 0 (a new run,
        also in a reused directory) W&B starts a new run, later it continues the stored one.
        """
        run_dir = Path(run_dir)
        check_tracking_available(tensorboard, wandb_project)
        wandb_run = None
        if wandb_project is not None:
            wandb_run = _open_wandb_run(run_dir, config, wandb_project, resumed_from_step)
        writer = None
        if tensorboard:
            try:
                writer = _open_summary_writer(run_dir / TENSORBOARD_DIR, resumed_from_step)
            except BaseException:
                if wandb_run is not None:
                    wandb_run.finish(exit_code=1)
                raise
        return cls(writer, wandb_run)

    def log(self, row: Mapping[str, Any]) -> None:
        """Write the numbers of one metrics row at step row["step"]."""
        step = int(row["step"])
        values = scalars(row)
        if not values:
            return
        if self.tensorboard_writer is not None:
            for key, value in values.items():
                self.tensorboard_writer.add_scalar(key, value, global_step=step)
        if self.wandb_run is not None and step >= self._wandb_first_step:
            self.wandb_run.log(values, step=step)

    def close(self, *, failed: bool = False) -> None:
        """Flush and close every tracker; `failed` marks the W&B run as failed (exit code 1).
        Closing twice does nothing."""
        writer, run = self.tensorboard_writer, self.wandb_run
        self.tensorboard_writer = self.wandb_run = None
        try:
            if writer is not None:
                writer.close()
        finally:
            if run is not None:
                run.finish(exit_code=1 if failed else 0)


def _summary_writer_class() -> Any:
    try:
        # torch.utils.tensorboard needs the tensorboard package; it is imported first because
        # an already imported torch.utils.tensorboard would hide its absence.
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            "train.tensorboard=true needs the tensorboard package: "
            "pip install 'moestack-train[tensorboard]'"
        ) from e
    return SummaryWriter


def _wandb(project: str) -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            f"train.wandb_project={project} needs the wandb package: pip install 'moestack-train[wandb]'"
        ) from e
    return wandb


def _check_wandb_project(project: str) -> None:
    """W&B's own rule for project names, checked before anything is written."""
    found = sorted({c for c in project if c in _WANDB_PROJECT_FORBIDDEN})
    problem = None
    if not project.strip():
        problem = "is empty"
    elif len(project) > _WANDB_PROJECT_MAX_CHARS:
        problem = f"has {len(project)} characters"
    elif found:
        problem = f"holds {' '.join(found)}"
    if problem:
        raise ConfigError(
            f"train.wandb_project={project!r} {problem}: a W&B project name has 1 to "
            f"{_WANDB_PROJECT_MAX_CHARS} characters and none of {' '.join(_WANDB_PROJECT_FORBIDDEN)}"
            "; or set it to null to turn W&B off"
        )


def _open_summary_writer(log_dir: Path, resumed_from_step: int) -> Any:
    summary_writer = _summary_writer_class()
    # purge_step hides, when the directory is read, the events an earlier writer wrote at
    # that step or later: the steps after the one this run starts from, which it writes again.
    purge_step = resumed_from_step + 1 if log_dir.is_dir() else None
    return summary_writer(log_dir=str(log_dir), purge_step=purge_step, flush_secs=10)


def _open_wandb_run(
    run_dir: Path, config: Mapping[str, Any], project: str, resumed_from_step: int
) -> Any:
    wandb = _wandb(project)
    id_file = run_dir / WANDB_RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    if resumed_from_step == 0 or not run_id:
        run_id = secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
    try:
        run = wandb.init(
            project=project,
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=dict(config),
        )
    except wandb.errors.Error as e:
        raise MoeTrainError(
            f"train.wandb_project={project}: W&B could not start run {run_id}: "
            f"{' '.join(str(e).split())} (log in with `wandb login`, or set WANDB_MODE=offline "
            f"to keep the run in {run_dir / 'wandb'} and upload it later with `wandb sync`)"
        ) from e
    if run.resumed:
        # A resumed W&B run takes back its stored config; this run's (a resume may change
        # steps, optimizer or layout) replaces it.
        run.config.update(dict(config), allow_val_change=True)
    return run
