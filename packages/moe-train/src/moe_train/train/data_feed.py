"""The training data of a run: the dataset its config names, each rank's rows of a step
read one step ahead (`BatchFeed`), and the tokens seen per source (`TokenCounts`: per data
path for checkpoints, where the model card reads them; per data.paths entry or data.mixture
source for metrics.jsonl).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_data import MixedDataset, MixtureSource, TokenDataset, open_training_data
from moe_plan.config import Config, DataConfig
from moe_train.errors import DataError


def open_dataset(config: Config) -> TokenDataset | MixedDataset:
    """The dataset of `config.data` (a mixture when data.mixture has sources), checked
    against model.vocab_size."""
    data = config.data
    mixture = [MixtureSource(s.label, s.paths, float(s.weight or 0)) for s in data.mixture]
    dataset = open_training_data(
        data.paths,
        mixture,
        data.seq_len,
        cache_dir=Path(data.cache_dir) if data.cache_dir else None,
        label_mask=data.label_mask,
        split_long_examples=data.split_long_examples,
    )
    if dataset.vocab_size > config.model.vocab_size:
        raise DataError(
            f"data.paths hold token ids up to {dataset.vocab_size - 1} but "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size >= "
            f"{dataset.vocab_size}"
        )
    data.validate_end_of_document(dataset.eos_id)
    return dataset


class TokenCounts:
    """Target tokens trained on from each data path so far."""

    def __init__(self, dataset: TokenDataset | MixedDataset, per_path: np.ndarray) -> None:
        self.dataset = dataset
        self.per_path = per_path
        """[paths] int64, in the order of `dataset.source_names`."""

    @classmethod
    def before(
        cls, dataset: TokenDataset | MixedDataset, config: Config, step: int, saved: Any
    ) -> TokenCounts:
        """The counts of the steps before `step`: as a resumed checkpoint saved them
        (`saved`), or counted again (a checkpoint of an earlier release, or another data
        order)."""
        names = dataset.source_names
        if isinstance(saved, dict) and list(saved) == names:
            return cls(dataset, np.array([saved[name] for name in names], dtype=np.int64))
        counts = dataset.tokens_before(step, config.data.global_batch_size, config.train.seed)
        return cls(dataset, counts)

    def add(self, tokens_per_path: np.ndarray) -> None:
        """Count a step's tokens (as `dataset.tokens_per_source` gives them)."""
        self.per_path = self.per_path + tokens_per_path

    def for_checkpoint(self) -> dict[str, int]:
        """Per data path, as checkpoints keep them."""
        return dict(zip(self.dataset.source_names, self.per_path.tolist(), strict=True))

    def for_metrics(self) -> dict[str, int]:
        """Per mixture source for a mixture, else per data path."""
        if isinstance(self.dataset, MixedDataset):
            return self.dataset.per_mixture_source(self.per_path)
        return self.for_checkpoint()


class BatchFeed:
    """This rank's rows of each step's global batch, the next step's read in a thread.

    Batch `index` (0-based) is the one step `index + 1` trains on; its rows depend only on
    (seed, index), so reading ahead changes when they are read, never what. `get(index)`
    returns them and starts reading batch index + 1 (when that is below `end_step`);
    `close` stops the thread, after an error or a stop signal too (the loop's `finally`).
    """

    def __init__(
        self,
        dataset: TokenDataset | MixedDataset,
        rows: tuple[int, int],
        global_batch_size: int,
        seed: int,
        end_step: int,
        *,
        prefetch: bool,
        pin_memory: bool,
    ) -> None:
        """`rows`: (start, stop) of the global batch to read; `pin_memory` for a fast copy to
        a GPU; `prefetch`: read ahead in a background thread."""
        self.dataset, self.rows = dataset, rows
        self.global_batch_size, self.seed, self.end_step = global_batch_size, seed, end_step
        self.pin_memory = pin_memory
        # The executor starts its thread on the first submit: nothing runs before `get`.
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-train-data")
            if prefetch
            else None
        )
        self._pending: tuple[int, Future[torch.Tensor]] | None = None
        self.wait_s = 0.0
        """Seconds the last `get` waited for its rows."""

    def read(self, index: int) -> torch.Tensor:
        """This rank's rows of batch `index` ([stop - start, seq_len + 1] int64), read now."""
        start, stop = self.rows
        rows = self.dataset.rows(index, self.global_batch_size, self.seed, start, stop)
        return rows.pin_memory() if self.pin_memory else rows

    def get(self, index: int) -> torch.Tensor:
        """Batch `index`'s rows (read ahead when the previous call asked for index - 1)."""
        began = time.perf_counter()
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == index:
            rows = pending[1].result()
        else:
            if pending is not None:
                pending[1].cancel()
            rows = self.read(index)
        self.wait_s = time.perf_counter() - began
        if self._executor is not None and index + 1 < self.end_step:
            self._pending = (index + 1, self._executor.submit(self.read, index + 1))
        return rows

    def close(self) -> None:
        """Drop the read ahead and stop the thread (waits for a read under way). Idempotent."""
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


def describe_sources(data: DataConfig) -> str:
    """data.paths, or the mixture's sources with their weights."""
    if not data.mixture:
        return ", ".join(data.paths)
    return ", ".join(f"{s.label} (weight {s.weight:g})" for s in data.mixture)
