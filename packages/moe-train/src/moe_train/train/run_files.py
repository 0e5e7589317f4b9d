"""What a run leaves on disk: its directory, its metrics file and its checkpoints."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from moe_checkpoint import (
    CheckpointError,
    SaveHandle,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    save_checkpoint,
)
from moe_train.config import Config
from moe_train.data import TokenDataset
from moe_train.errors import ConfigError
from moe_train.model import Transformer
from moe_train.train.checkpointing import (
    Optimizer,
    category_of,
    encode_rng_state,
    training_slices,
)
from moe_train.train.runtime import Runtime


def checkpoint_root(config: Config, run_dir: Path | str) -> Path:
    """Where checkpoints go: checkpoint.dir, or RUN_DIR/checkpoints."""
    return Path(config.checkpoint.dir) if config.checkpoint.dir else Path(run_dir) / "checkpoints"


def find_resume_checkpoint(config: Config) -> Path | None:
    """The committed checkpoint that checkpoint.resume asks for, or None to start afresh."""
    resume = config.checkpoint.resume
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoint_root(config, config.train.run_dir))
    path = Path(resume)
    if (path / "COMMITTED").is_file():
        return path
    if path.is_dir() and (found := latest_checkpoint(path)) is not None:
        return found
    raise ConfigError(
        f"checkpoint.resume={resume} is not a committed checkpoint (no COMMITTED marker) "
        f"nor a directory holding one; use auto, never or a checkpoint path"
    )


def check_no_newer_checkpoints(root: Path, start_step: int, interval: int) -> None:
    """Refuse to run on from `start_step` when saving would meet committed later steps."""
    if not interval:
        return
    newer = [p for p in list_checkpoints(root) if _checkpoint_step(p) > start_step]
    if newer:
        raise ConfigError(
            f"{root} already holds checkpoints after step {start_step} ({newer[-1].name}); "
            f"resuming from step {start_step} would save over that history: set checkpoint.dir "
            f"to another directory, or resume from {newer[-1]}"
        )


def _checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def prepare_run_dir(requested: str, *, resuming: bool) -> Path:
    """The run directory: `requested` when resuming into it or when it is free, else the
    first free `requested.N` (a finished run is never overwritten)."""
    path = Path(requested)
    candidate, n = path, 1
    while not resuming and candidate.exists() and any(candidate.iterdir()):
        candidate = path.with_name(f"{path.name}.{n}")
        n += 1
    try:
        candidate.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"train.run_dir={requested} cannot be created: {e.strerror}") from e
    return candidate


def truncate_metrics(path: Path, start_step: int) -> None:
    """Keep only the records of steps before `start_step` (a resumed run rewrites the rest)."""
    if not path.exists():
        return
    kept = [
        line for line in path.read_text().splitlines(keepends=True) if _step_of(line) < start_step
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # an unreadable line (a crash mid-write) is dropped


class PeriodicSaver:
    """Saves every checkpoint.interval steps and after the last one; keeps checkpoint.keep_last."""

    def __init__(
        self,
        config: Config,
        root: Path,
        model: Transformer,
        optimizer: Optimizer,
        dataset: TokenDataset,
        runtime: Runtime,
    ) -> None:
        self.config = config
        self.root = root
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        self.runtime = runtime
        self._pending: SaveHandle | None = None

    def after_step(self, step: int) -> None:
        interval = self.config.checkpoint.interval
        done = step + 1
        if interval and (done % interval == 0 or done == self.config.train.max_steps):
            self.save(done)

    def save(self, next_step: int) -> None:
        """Checkpoint the state in which step `next_step` starts."""
        self._complete_pending()
        data, layout = self.config.data, self.runtime.layout
        trainer_state = {
            "step": next_step,
            "data": self.dataset.state(next_step, data.global_batch_size),
            "rng": encode_rng_state(),
            "config": self.config.to_dict(),
            "topology": layout.describe(),
            "saved_at": time.time(),
        }
        handle = save_checkpoint(
            self.root,
            next_step,
            training_slices(self.model, self.optimizer, layout, owned_only=True),
            category_of,
            trainer_state,
            asynchronous=self.config.checkpoint.async_save,
        )
        if self.config.checkpoint.async_save:
            self._pending = handle
        else:
            self._prune()

    def finish(self) -> None:
        """Commit a save still in flight (every rank calls this)."""
        self._complete_pending()

    def _complete_pending(self) -> None:
        if self._pending is not None:
            handle, self._pending = self._pending, None
            handle.wait()
            self._prune()

    def _prune(self) -> None:
        if self.runtime.is_main:
            try:
                prune_checkpoints(self.root, self.config.checkpoint.keep_last)
            except (CheckpointError, OSError) as e:  # never fatal: the new one is committed
                print(f"warning: could not remove old checkpoints in {self.root}: {e}")
