"""`TokenDataset`: fixed-length training sequences from token memmaps, shuffled per epoch.

A step's batch depends only on (seed, step), so a resumed run reads the same data without
replaying earlier steps, whatever the parallel layout.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_train.data.builtin import BUILTIN_STDLIB, builtin_dataset_dir
from moe_train.data.prepare import (
    FORMAT,
    META_FILE,
    TOKENS_FILE,
    open_token_array,
    token_array_max,
)
from moe_train.errors import DataError

if TYPE_CHECKING:
    import torch

_VALID_PATHS = (
    "a prepared data directory (meta.json + tokens.bin), a 1-D .npy id array or builtin:stdlib"
)
_CACHED_PERMUTATIONS = 2


@dataclass(frozen=True)
class TokenSource:
    """One entry of `data.paths`, opened read-only."""

    path: str
    """The entry as given (a directory, a .npy file, or builtin:stdlib)."""
    tokens: np.ndarray
    """All its token ids, memory-mapped."""
    vocab_size: int
    """Declared by meta.json, or the largest id + 1 for a .npy file."""
    eos_id: int | None
    """End-of-document id when known (prepared directories)."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)


class TokenDataset:
    """Windows of `seq_len + 1` tokens (inputs and shifted targets) over one or more sources.

    Windows start every `seq_len` tokens inside each source and never cross a source boundary.
    """

    def __init__(
        self, paths: Sequence[str | Path], seq_len: int, *, cache_dir: Path | None = None
    ) -> None:
        """Open each of `paths`; `cache_dir` is where builtin:stdlib is prepared on first use."""
        if isinstance(paths, str | Path):
            paths = [paths]
        if seq_len < 1:
            raise DataError(f"data.seq_len={seq_len} must be >= 1")
        if not paths:
            raise DataError(f"data.paths is empty; give {_VALID_PATHS}")
        self.seq_len = seq_len
        self.sources = [_open_source(path, cache_dir) for path in paths]

        eos_ids = sorted({s.eos_id for s in self.sources if s.eos_id is not None})
        if len(eos_ids) > 1:
            listing = ", ".join(f"{s.path} (eos_id={s.eos_id})" for s in self.sources)
            raise DataError(
                f"data.paths were prepared with different tokenizers: {listing}; "
                "prepare them all with the same tokenizer"
            )
        self.eos_id: int | None = eos_ids[0] if eos_ids else None
        """End-of-document id, when any source declares one."""

        windows_per_source = np.array(
            [max(0, (s.num_tokens - 1) // seq_len) for s in self.sources], dtype=np.int64
        )
        self._window_ends = np.cumsum(windows_per_source)
        self._window_starts = self._window_ends - windows_per_source
        self.num_sequences = int(self._window_ends[-1])
        """Windows in one epoch."""
        if self.num_sequences == 0:
            raise DataError(
                f"data.paths hold {self.num_tokens} tokens (largest source "
                f"{max(s.num_tokens for s in self.sources)}), fewer than data.seq_len+1 = "
                f"{seq_len + 1} in any one source; add data or lower data.seq_len"
            )
        self._index_dtype = np.int32 if self.num_sequences < 2**31 else np.int64
        self._permutations: dict[tuple[int, int], np.ndarray] = {}

    @property
    def vocab_size(self) -> int:
        """The largest vocab_size over the sources."""
        return max(s.vocab_size for s in self.sources)

    @property
    def num_tokens(self) -> int:
        """Tokens over all sources."""
        return sum(s.num_tokens for s in self.sources)

    def __len__(self) -> int:
        return self.num_sequences

    def __repr__(self) -> str:
        paths = [s.path for s in self.sources]
        return (
            f"TokenDataset({paths!r}, seq_len={self.seq_len}, num_tokens={self.num_tokens}, "
            f"num_sequences={self.num_sequences})"
        )

    def sequence(self, index: int) -> np.ndarray:
        """Window `index` (0 <= index < num_sequences) as int64: seq_len + 1 tokens."""
        if not 0 <= index < self.num_sequences:
            raise IndexError(f"sequence {index} out of range 0..{self.num_sequences - 1}")
        source_index = int(np.searchsorted(self._window_ends, index, side="right"))
        start = (index - int(self._window_starts[source_index])) * self.seq_len
        tokens = self.sources[source_index].tokens
        return np.asarray(tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def sequence_indices(self, step: int, global_batch_size: int, seed: int) -> np.ndarray:
        """Which windows make up step `step`'s global batch, in order.

        Sample position p = step * global_batch_size + i is window
        permutation_e[p % num_sequences] of epoch e = p // num_sequences.
        """
        _check_batch_args(step, global_batch_size, seed)
        positions = step * global_batch_size + np.arange(global_batch_size, dtype=np.int64)
        epochs = positions // self.num_sequences
        offsets = positions % self.num_sequences
        indices = np.empty(global_batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            indices[in_epoch] = self._permutation(seed, int(epoch))[offsets[in_epoch]]
        return indices

    def batch(self, step: int, global_batch_size: int, seed: int) -> torch.Tensor:
        """Step `step`'s global batch: a LongTensor [global_batch_size, seq_len + 1].

        Depends only on (seed, step); inputs are `[:, :-1]`, targets `[:, 1:]`.
        """
        import torch

        indices = self.sequence_indices(step, global_batch_size, seed)
        batch = np.empty((global_batch_size, self.seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            batch[row] = self.sequence(int(index))
        return torch.from_numpy(batch)

    def state(self, step: int, global_batch_size: int) -> dict[str, int]:
        """Data position after `step` steps, for checkpoints."""
        samples_consumed = step * global_batch_size
        return {
            "samples_consumed": samples_consumed,
            "epoch": samples_consumed // self.num_sequences,
            "sample_in_epoch": samples_consumed % self.num_sequences,
            "num_sequences": self.num_sequences,
            "seq_len": self.seq_len,
        }

    def _permutation(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        permutation = self._permutations.get(key)
        if permutation is None:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
            permutation = np.arange(self.num_sequences, dtype=self._index_dtype)
            rng.shuffle(permutation)
            if len(self._permutations) >= _CACHED_PERMUTATIONS:
                del self._permutations[next(iter(self._permutations))]
            self._permutations[key] = permutation
        return permutation


def _check_batch_args(step: int, global_batch_size: int, seed: int) -> None:
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if global_batch_size < 1:
        raise DataError(f"data.global_batch_size={global_batch_size} must be >= 1")
    if seed < 0:
        raise DataError(f"train.seed={seed} must be >= 0")


def _open_source(path: str | Path, cache_dir: Path | None) -> TokenSource:
    """Open one `data.paths` entry, checking it against its metadata."""
    if isinstance(path, str) and path.startswith("builtin:"):
        if path != BUILTIN_STDLIB:
            raise DataError(
                f"unknown built-in dataset {path!r}; the built-in one is {BUILTIN_STDLIB}"
            )
        return _open_prepared_dir(path, builtin_dataset_dir(cache_dir))
    file_path = Path(path)
    if file_path.is_dir():
        return _open_prepared_dir(str(path), file_path)
    if not file_path.exists():
        raise DataError(f"data.paths entry {path} not found; give {_VALID_PATHS}")
    if file_path.suffix.lower() == ".npy":
        tokens = open_token_array(file_path)
        vocab_size = token_array_max(file_path, tokens) + 1
        return TokenSource(str(path), tokens, max(vocab_size, 1), None)
    raise DataError(f"data.paths entry {path} is not {_VALID_PATHS}")


def _open_prepared_dir(name: str, directory: Path) -> TokenSource:
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise DataError(
            f"{directory} has no {META_FILE}, so it is not a prepared data directory; "
            f"create one with `moe-train prepare-data INPUT... --out {directory}`"
        )
    meta = _read_meta(meta_path)
    dtype = np.dtype(meta["dtype"])
    num_tokens = meta["num_tokens"]
    tokens_path = directory / TOKENS_FILE
    expected_bytes = num_tokens * dtype.itemsize
    actual_bytes = tokens_path.stat().st_size if tokens_path.is_file() else None
    if actual_bytes != expected_bytes:
        found = "is missing" if actual_bytes is None else f"holds {actual_bytes} bytes"
        raise DataError(
            f"{tokens_path} {found} but {META_FILE} says num_tokens={num_tokens} "
            f"({expected_bytes} bytes of {dtype.name}); prepare the data again"
        )
    if num_tokens == 0:
        tokens = np.empty(0, dtype=dtype)
    else:
        tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(num_tokens,))
    return TokenSource(name, tokens, meta["vocab_size"], meta["eos_id"])


def _read_meta(meta_path: Path) -> dict[str, Any]:
    """Parse and check meta.json; any problem is a DataError naming the file."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path} is not readable JSON ({e}); prepare the data again") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise DataError(f"{meta_path} has format={found!r}; expected {FORMAT!r}")
    problems = []
    if meta.get("dtype") not in ("uint16", "uint32"):
        problems.append(f"dtype={meta.get('dtype')!r} (expected 'uint16' or 'uint32')")
    for key in ("num_tokens", "vocab_size"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            problems.append(f"{key}={value!r} (expected an integer >= 0)")
    eos_id = meta.get("eos_id")
    if eos_id is not None and (not isinstance(eos_id, int) or eos_id < 0):
        problems.append(f"eos_id={eos_id!r} (expected an integer >= 0 or null)")
    if problems:
        raise DataError(f"{meta_path} has {', '.join(problems)}; prepare the data again")
    return meta
