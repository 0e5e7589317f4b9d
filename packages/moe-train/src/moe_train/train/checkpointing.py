"""The trainer's checkpoints: when they are written, and loading them (where they live is
`moe_train.run_paths`).

Everything the loop does with checkpoints goes through `Checkpoints`: `load` or `load_model`
at the start (which checkpoint, and whether it may be loaded, is `resume`'s business),
`due_by_time` after each step, `save`, and `finish` at the end (which steps are saved by count
is the cadence's). The tensors themselves (which rank writes and reads which piece) are
`state_slices`' business.
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
    prune_checkpoints,
    save_checkpoint,
)
from moe_data import TokenDataset
from moe_parallel import TrainingOptimizer
from moe_plan.config import Config
from moe_train.errors import MoeTrainError, TrainingDiverged
from moe_train.model import Transformer
from moe_train.run_paths import checkpoint_root
from moe_train.train.runtime import Runtime
from moe_train.train.state_slices import (
    category_of,
    encode_rng_state,
    load_model_state,
    load_training_state,
    restore_rng_state,
    saved_slices,
)

# checkpoint_root lives in moe_train.run_paths (export reads it too); named here for resume.
__all__ = ["Checkpoints", "checkpoint_root"]


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

    def load(
        self, path: Path, trainer_state: dict[str, Any], *, with_optimizer: bool = True
    ) -> None:
        """Fill the model, optimizer and RNG from `path` (its `trainer_state`, read once by
        rank 0, holds the RNG state), checking every byte read; a failure on any rank raises
        the same one-line error on every rank. Without `with_optimizer` the optimizer starts
        at step 0 with fresh state (master weights from the model tensors)."""
        load = load_training_state if with_optimizer else load_model_state
        error = load(path, self.model, self.optimizer, self.runtime.layout)
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
