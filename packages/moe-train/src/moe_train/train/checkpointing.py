"""The trainer's checkpoints: where they live, when they are written, and what resume loads.

Everything the loop does with checkpoints goes through `Checkpoints`: `read_state` and `load`
on resume, `due_by_time` after each step, `save`, and `finish` at the end (which steps are
saved by count is the cadence's). The tensors themselves
(which rank writes and reads which piece) are `state_slices`' business.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from moe_checkpoint import (
    CheckpointError,
    OwnedSlice,
    SaveHandle,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    read_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
)
from moe_parallel import TrainingOptimizer
from moe_train.config import Config
from moe_train.data import TokenDataset
from moe_train.errors import ConfigError, MoeTrainError, TrainingDiverged
from moe_train.model import Transformer
from moe_train.train.config_changes import config_changes
from moe_train.train.runtime import Runtime
from moe_train.train.state_slices import (
    category_of,
    encode_rng_state,
    load_model_state,
    load_training_state,
    restore_rng_state,
    saved_slices,
)


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
    try:
        return resolve_checkpoint(resume)
    except CheckpointError as e:
        raise ConfigError(
            f"checkpoint.resume={resume} is not a committed checkpoint (no COMMITTED marker) "
            f"nor a directory holding one; use auto, never or a checkpoint path"
        ) from e


def find_init_checkpoint(config: Config) -> Path:
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
    saved = read_resume_state(path).get("config")
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise MoeTrainError(f"{path}/trainer_state.json holds no model config")
    changes = config_changes({"model": saved["model"]}, {"model": config.to_dict()["model"]})
    differing = [c for c in changes if c.key.startswith("model.")]
    if differing and not config.checkpoint.allow_config_change:
        first = differing[0]
        raise ConfigError(
            f"{first.key}={first.now!r} differs from {first.saved!r} in checkpoint.init_from="
            f"{path}: its weights fit only the model they were saved with; set "
            f"{first.key}={first.saved!r}, or checkpoint.allow_config_change=true"
        )
    return path


def check_no_newer_checkpoints(root: Path, start_step: int) -> None:
    """Refuse to run on from `start_step` when saving would meet committed later steps."""
    newer = [p for p in list_checkpoints(root) if _checkpoint_step(p) > start_step]
    if newer:
        raise ConfigError(
            f"{root} already holds checkpoints after step {start_step} ({newer[-1].name}); "
            f"resuming from step {start_step} would save over that history: set checkpoint.dir "
            f"to another directory, or resume from {newer[-1]}"
        )


def _checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def read_resume_state(path: Path) -> dict[str, Any]:
    """trainer_state.json of a checkpoint to resume from (errors as MoeTrainError)."""
    try:
        return read_trainer_state(path)
    except CheckpointError as e:
        raise MoeTrainError(str(e)) from e


class Checkpoints:
    """Saves and loads this rank's part of the training state under `root`.

    Saves when the loop asks (see cadence.py), and tells when checkpoint.interval_minutes have
    passed since the last save; keeps checkpoint.keep_last.
    Never writes a checkpoint that holds a non-finite value.
    """

    def __init__(
        self,
        config: Config,
        root: Path,
        model: Transformer,
        optimizer: TrainingOptimizer,
        dataset: TokenDataset,
        runtime: Runtime,
    ) -> None:
        self.config = config
        self.root = root
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        self.runtime = runtime
        self.last_committed: Path | None = None
        """The newest committed checkpoint this run saved or resumed from."""
        self._pending: SaveHandle | None = None
        self._last_save_time = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.config.checkpoint.enabled

    def load(self, path: Path, trainer_state: dict[str, Any]) -> None:
        """Fill the model, optimizer and RNG from `path` (its `trainer_state`, read once by
        rank 0, holds the RNG state), checking every byte read; a failure on any rank raises
        the same one-line error on every rank."""
        error = load_training_state(path, self.model, self.optimizer, self.runtime.layout)
        self.runtime.raise_if_any(error)
        restore_rng_state(trainer_state["rng"])
        self.last_committed = path
        self._last_save_time = time.monotonic()

    def load_model(self, path: Path) -> None:
        """Fill the model from the model tensors of `path` (any saving layout), with a fresh
        optimizer at step 0 whose master weights are those tensors; a failure on any rank
        raises the same one-line error on every rank."""
        error = load_model_state(path, self.model, self.optimizer, self.runtime.layout)
        self.runtime.raise_if_any(error)

    def due_by_time(self) -> bool:
        """Whether checkpoint.interval_minutes have passed since the last save (this rank's
        clock: the loop takes rank 0's answer)."""
        minutes = self.config.checkpoint.interval_minutes
        return bool(minutes) and time.monotonic() - self._last_save_time >= 60 * minutes

    def save(self, step: int, loop_state: dict[str, Any]) -> Path:
        """Checkpoint the state after `step` optimizer steps (every rank calls this).

        `loop_state` (JSON-able) is stored in trainer_state.json with the step, data
        position, RNG state, config and topology."""
        self._complete_pending()
        data, layout = self.config.data, self.runtime.layout
        slices = saved_slices(self.model, self.optimizer, layout)
        self._check_finite(slices, step)
        trainer_state = {
            "step": step,
            "data": self.dataset.state(step, data.global_batch_size),
            "rng": encode_rng_state(),
            "config": self.config.to_dict(),
            "topology": layout.describe(),
            "saved_at": time.time(),
            **loop_state,
        }
        try:
            handle = save_checkpoint(
                self.root,
                step,
                slices,
                category_of,
                trainer_state,
                asynchronous=self.config.checkpoint.async_save,
            )
        except CheckpointError as e:  # raised alike on every rank
            raise MoeTrainError(f"saving the checkpoint of step {step} failed: {e}") from e
        self._last_save_time = time.monotonic()
        path = self.root / f"step_{step:08d}"
        if self.config.checkpoint.async_save:
            self._pending = handle
        else:
            self.last_committed = path
            self._prune()
        return path

    def finish(self) -> None:
        """Commit a save still in flight (every rank calls this)."""
        self._complete_pending()

    def _check_finite(self, slices: list[OwnedSlice], step: int) -> None:
        """Raise on every rank if any rank's state to be saved holds a NaN or infinity (one
        device-to-host copy of a flag per tensor, not a sync per tensor)."""
        floats = [piece for piece in slices if piece.data.is_floating_point()]
        finite = [torch.isfinite(piece.data).all() for piece in floats]
        error = None
        if finite and not bool(torch.stack(finite).all()):
            name = next(p.name for p, ok in zip(floats, finite, strict=True) if not ok)
            error = (
                f"tensor {name} holds non-finite values after step {step}; "
                f"not saving it (the newest good checkpoint stays as it is): lower optim.lr "
                f"(now {self.config.optim.lr}) or set optim.grad_clip"
            )
        self.runtime.raise_if_any(error, TrainingDiverged)

    def _complete_pending(self) -> None:
        if self._pending is not None:
            handle, self._pending = self._pending, None
            try:
                self.last_committed = handle.wait()
            except CheckpointError as e:  # raised alike on every rank
                raise MoeTrainError(f"saving a checkpoint failed: {e}") from e
            self._prune()

    def _prune(self) -> None:
        if self.runtime.is_main:
            try:
                prune_checkpoints(self.root, self.config.checkpoint.keep_last)
            except (CheckpointError, OSError) as e:  # never fatal: the new one is committed
                print(f"warning: could not remove old checkpoints in {self.root}: {e}")
