"""`MixedDataset`: training sequences drawn from several sources in fixed shares of the tokens.

Sample positions (p = step * global_batch_size + row) go to the sources in the order of the
keys (k + 1/2) / w_s, k = 0, 1, ... of every source s with weight w_s (ties to the earlier
source): the Sainte-Laguë divisor sequence. Its first n positions hold each source's share
of n, rounded, for every n, so every step and every stretch of steps is mixed as asked. The
k-th sample of a source is window k of that source's own shuffled epochs. Both depend only
on (seed, step): a resumed run, and every layout, read the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moe_data.dataset import TokenDataset, check_batch_args, read_windows
from moe_data.errors import DataError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture, as the trainer's config gives it."""

    name: str
    """Its label in metrics and checkpoints."""
    paths: Sequence[str]
    """Its data paths (the forms `TokenDataset` opens)."""
    weight: float
    """Its share of the tokens, relative to the other sources' weights."""


def samples_before(n: int, weights: np.ndarray) -> np.ndarray:
    """[sources] int64: how many of the first `n` sample positions each source holds, for
    `weights` summing to 1 (the first n keys of the merged divisor sequence)."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    sources = len(weights)
    # Keys of index below `low` lie below n - sources - 1/2 and keys from `high` on above
    # n + sources + 1/2, while about t keys of all sources lie below any t: so the first n
    # keys are those below `low`, and the smallest of the candidates in between.
    guess = np.floor(n * weights).astype(np.int64)
    low = np.maximum(guess - sources - 1, 0)
    high = guess + sources + 2
    owners = np.concatenate(
        [np.full(h - lo, s) for s, (lo, h) in enumerate(zip(low, high, strict=True))]
    )
    ks = np.concatenate([np.arange(lo, h) for lo, h in zip(low, high, strict=True)])
    keys = (ks + 0.5) / weights[owners]
    order = np.lexsort((owners, keys))
    taken = n - int(low.sum())
    if not 0 <= taken <= len(order):
        raise AssertionError(f"mixture apportionment of {n} samples out of range")
    return low + np.bincount(owners[order[:taken]], minlength=sources)


def positions_in_order(start: int, stop: int, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The source of each sample position start .. stop-1, and which of that source's
    samples it is (its k): two int64 arrays [stop - start]."""
    before, after = samples_before(start, weights), samples_before(stop, weights)
    owners = np.concatenate(
        [np.full(a - b, s) for s, (b, a) in enumerate(zip(before, after, strict=True))]
    )
    ks = np.concatenate([np.arange(b, a) for b, a in zip(before, after, strict=True)])
    keys = (ks + 0.5) / weights[owners]
    order = np.lexsort((owners, keys))
    return owners[order].astype(np.int64), ks[order].astype(np.int64)


class MixedDataset:
    """Windows of `seq_len + 1` tokens from several sources, each a `TokenDataset`, mixed by
    weight; the same reading interface as `TokenDataset`."""

    def __init__(
        self,
        sources: Sequence[MixtureSource],
        seq_len: int,
        *,
        cache_dir: Path | None = None,
        label_mask: bool = False,
        split_long_examples: bool = False,
    ) -> None:
        """Open every source's paths; `cache_dir`, `label_mask` and `split_long_examples` as
        for `TokenDataset`."""
        if not sources:
            raise DataError("data.mixture is empty; give at least one source")
        self.seq_len = seq_len
        self.mixture = list(sources)
        self.parts = [
            TokenDataset(
                source.paths,
                seq_len,
                cache_dir=cache_dir,
                stream=index + 1,
                label_mask=label_mask,
                split_long_examples=split_long_examples,
            )
            for index, source in enumerate(sources)
        ]
        weights = np.array([s.weight for s in sources], dtype=np.float64)
        if not (np.isfinite(weights).all() and (weights > 0).all()):
            raise DataError(f"data.mixture weights {weights.tolist()} must all be positive")
        self.weights = weights / weights.sum()
        """Each source's share of the sequences (and of the tokens), summing to 1."""
        eos_ids = sorted({part.eos_id for part in self.parts if part.eos_id is not None})
        if len(eos_ids) > 1:
            listing = ", ".join(
                f"{source.name} (eos_id={part.eos_id})"
                for source, part in zip(sources, self.parts, strict=True)
            )
            raise DataError(
                f"data.mixture sources were prepared with different tokenizers: {listing}; "
                "prepare them all with the same tokenizer"
            )
        self.eos_id: int | None = eos_ids[0] if eos_ids else None
        """End-of-document id, when any source declares one."""

    @property
    def source_names(self) -> list[str]:
        """Every data path of the sources, in order: what `tokens_per_source` counts."""
        return [name for part in self.parts for name in part.source_names]

    @property
    def mixture_names(self) -> list[str]:
        """The mixture's sources, in order."""
        return [source.name for source in self.mixture]

    def per_mixture_source(self, tokens_per_path: np.ndarray) -> dict[str, int]:
        """Counts per data path (as `tokens_per_source` gives them) summed per source."""
        ends = np.cumsum([len(part.sources) for part in self.parts])
        sums = np.add.reduceat(tokens_per_path, ends - ends[0]) if len(ends) else []
        return {name: int(total) for name, total in zip(self.mixture_names, sums, strict=True)}

    @property
    def skipped_long(self) -> int:
        """Documents left out of packed windows for being longer than one."""
        return sum(part.skipped_long for part in self.parts)

    @property
    def split_long(self) -> int:
        """Documents cut into pieces for being longer than a packed window."""
        return sum(part.split_long for part in self.parts)

    @property
    def vocab_size(self) -> int:
        """The largest vocab_size over the sources."""
        return max(part.vocab_size for part in self.parts)

    @property
    def num_tokens(self) -> int:
        """Tokens over all sources."""
        return sum(part.num_tokens for part in self.parts)

    def __repr__(self) -> str:
        shares = ", ".join(
            f"{name}: {share:.3g}"
            for name, share in zip(self.mixture_names, self.weights, strict=True)
        )
        return f"MixedDataset({{{shares}}}, seq_len={self.seq_len})"

    def tokens_per_source(self, step: int, global_batch_size: int, seed: int) -> np.ndarray:
        """[paths] int64: the target tokens step `step`'s global batch takes from each data
        path of the sources (see `source_names`)."""
        check_batch_args(step, global_batch_size, seed)
        first = step * global_batch_size
        owners, ks = positions_in_order(first, first + global_batch_size, self.weights)
        return np.concatenate(
            [
                part.tokens_of_windows(part.windows_at(ks[owners == index], seed))
                for index, part in enumerate(self.parts)
            ]
        )

    def tokens_before(self, step: int, global_batch_size: int, seed: int) -> np.ndarray:
        """[paths] int64: the target tokens steps 0 .. step-1 took from each data path."""
        check_batch_args(step, global_batch_size, seed)
        taken = samples_before(step * global_batch_size, self.weights)
        return np.concatenate(
            [part.tokens_in_first(int(k), seed) for part, k in zip(self.parts, taken, strict=True)]
        )

    def batch(self, step: int, global_batch_size: int, seed: int) -> torch.Tensor:
        """Step `step`'s global batch: a LongTensor [global_batch_size, seq_len + 1]."""
        return self.rows(step, global_batch_size, seed, 0, global_batch_size)

    def rows(
        self, step: int, global_batch_size: int, seed: int, start: int, stop: int
    ) -> torch.Tensor:
        """Rows start .. stop-1 of step `step`'s global batch (a LongTensor
        [stop - start, seq_len + 1]), reading only those sequences."""
        import torch

        check_batch_args(step, global_batch_size, seed)
        first = step * global_batch_size
        owners, ks = positions_in_order(first + start, first + stop, self.weights)
        batch = torch.empty((stop - start, self.seq_len + 1), dtype=torch.int64)
        for index, part in enumerate(self.parts):
            mine = np.flatnonzero(owners == index)
            if len(mine):
                batch[torch.from_numpy(mine)] = read_windows(part, part.windows_at(ks[mine], seed))
        return batch

    def state(self, step: int, global_batch_size: int) -> dict[str, object]:
        """Data position after `step` steps, for checkpoints: overall and per source."""
        samples_consumed = step * global_batch_size
        per_source = samples_before(samples_consumed, self.weights)
        return {
            "samples_consumed": samples_consumed,
            "seq_len": self.seq_len,
            "sources": {
                source.name: {
                    "samples_consumed": int(taken),
                    "epoch": int(taken) // part.num_sequences,
                    "num_sequences": part.num_sequences,
                }
                for source, part, taken in zip(self.mixture, self.parts, per_source, strict=True)
            },
        }


def open_training_data(
    paths: Sequence[str],
    mixture: Sequence[MixtureSource],
    seq_len: int,
    *,
    cache_dir: Path | None = None,
    label_mask: bool = False,
    split_long_examples: bool = False,
) -> TokenDataset | MixedDataset:
    """The training data: the `mixture` when it has sources, else `paths` shuffled as one;
    `label_mask` and `split_long_examples` as for `TokenDataset`."""
    masking = {"label_mask": label_mask, "split_long_examples": split_long_examples}
    if mixture:
        return MixedDataset(mixture, seq_len, cache_dir=cache_dir, **masking)
    return TokenDataset(paths, seq_len, cache_dir=cache_dir, **masking)
