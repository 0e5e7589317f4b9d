"""`TokenDataset`: fixed-length training sequences from token memmaps, shuffled per epoch.

A step's batch depends only on (seed, step), so a resumed run reads the same data without
replaying earlier steps, whatever the parallel layout.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moe_data.builtin import BUILTIN_STDLIB, builtin_dataset_dir
from moe_data.errors import DataError
from moe_data.labels import encode_masked
from moe_data.packing import PackedWindows, document_ends, pack_documents
from moe_data.prepare import partial_dir
from moe_data.token_files import (
    TokenStream,
    open_headerless,
    open_prepared_dir,
    open_token_array,
    split_dtype_suffix,
)

if TYPE_CHECKING:
    import torch

_VALID_PATHS = (
    "a directory written by prepare-data, a 1-D .npy id array, a headerless token file with "
    "its dtype (path:uint16, :uint32, :int32 or :int64) or builtin:stdlib"
)
_CACHED_PERMUTATIONS = 2


@dataclass(frozen=True)
class TokenSource:
    """One entry of `data.paths`, opened read-only."""

    path: str
    """The entry as given (a directory, a .npy file, path:dtype, or builtin:stdlib)."""
    tokens: TokenStream
    """All its token ids, memory-mapped."""
    vocab_size: int
    """Declared by meta.json, or the largest id + 1 for a .npy or headerless file."""
    eos_id: int | None
    """End-of-document id when known (prepared directories)."""
    mask: TokenStream | None = None
    """Its label mask (1: trained on), when it is a prepared directory that has one."""

    @property
    def num_tokens(self) -> int:
        return self.tokens.num_tokens


class TokenDataset:
    """Windows of `seq_len + 1` tokens (inputs and shifted targets) over one or more sources.

    Windows start every `seq_len` tokens inside each source and never cross a source boundary.
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        seq_len: int,
        *,
        cache_dir: Path | None = None,
        stream: int | None = None,
        label_mask: bool = False,
        split_long_examples: bool = False,
    ) -> None:
        """Open each of `paths`; `cache_dir` is where builtin:stdlib is prepared on first use;
        `stream` (for one source of a mixture) gives the dataset shuffles of its own;
        `label_mask`: read each source's label mask into the windows (see
        `moe_data.labels`; every source must have one) and pack whole documents into
        the windows (`moe_data.packing`; `split_long_examples` cuts those longer than
        a window instead of skipping them)."""
        if isinstance(paths, str | Path):
            paths = [paths]
        if seq_len < 1:
            raise DataError(f"data.seq_len={seq_len} must be >= 1")
        if not paths:
            raise DataError(f"data.paths is empty; give {_VALID_PATHS}")
        self.seq_len = seq_len
        self._stream = () if stream is None else (stream,)
        self.sources = [_open_source(path, cache_dir) for path in paths]
        self.label_mask = label_mask
        """Whether windows carry the label mask (untrained tokens stored as -1 - id)."""
        self.packed: list[PackedWindows] | None = None
        """Each source's windows of whole documents (with label_mask), else None: windows
        start every seq_len tokens."""
        if label_mask:
            _check_masks(self.sources)
            self.packed = [_pack(s, seq_len + 1, split_long_examples) for s in self.sources]

        self.eos_id: int | None = _common_eos_id(self.sources)
        """End-of-document id, when any source declares one."""
        self._lay_out_windows()
        self._index_dtype = np.int32 if self.num_sequences < 2**31 else np.int64
        self._permutations: dict[tuple[int, int], np.ndarray] = {}
        # Batches may be read ahead in a thread while the loop counts tokens.
        self._permutations_lock = threading.Lock()

    def _lay_out_windows(self) -> None:
        """Number the windows of one epoch across the sources; raise DataError if there are none."""
        seq_len = self.seq_len
        windows_per_source = np.array(
            [len(p.starts) for p in self.packed]
            if self.packed is not None
            else [max(0, (s.num_tokens - 1) // seq_len) for s in self.sources],
            dtype=np.int64,
        )
        self._window_ends = np.cumsum(windows_per_source)
        self._window_starts = self._window_ends - windows_per_source
        self.num_sequences = int(self._window_ends[-1])
        """Windows in one epoch."""
        if self.num_sequences == 0 and self.packed is not None:
            raise DataError(
                f"every document of data.paths is longer than data.seq_len+1 = {seq_len + 1} "
                f"tokens ({self.skipped_long} skipped); raise data.seq_len or set "
                "data.split_long_examples=true"
            )
        if self.num_sequences == 0:
            raise DataError(
                f"data.paths hold {self.num_tokens} tokens (largest source "
                f"{max(s.num_tokens for s in self.sources)}), fewer than data.seq_len+1 = "
                f"{seq_len + 1} in any one source; add data or lower data.seq_len"
            )

    @property
    def vocab_size(self) -> int:
        """The largest vocab_size over the sources."""
        return max(s.vocab_size for s in self.sources)

    @property
    def skipped_long(self) -> int:
        """Documents left out of packed windows for being longer than one."""
        return sum(p.skipped for p in self.packed) if self.packed is not None else 0

    @property
    def split_long(self) -> int:
        """Documents cut into pieces for being longer than a packed window."""
        return sum(p.split for p in self.packed) if self.packed is not None else 0

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
        offset = index - int(self._window_starts[source_index])
        source = self.sources[source_index]
        if self.packed is not None:
            return self._packed_window(source, self.packed[source_index], offset)
        start = offset * self.seq_len
        ids = source.tokens.read(start, start + self.seq_len + 1)
        if self.label_mask and source.mask is not None:
            return encode_masked(ids, source.mask.read(start, start + self.seq_len + 1))
        return ids

    def _packed_window(self, source: TokenSource, packed: PackedWindows, offset: int) -> np.ndarray:
        """Packed window `offset` of `source`, padded with untrained end-of-document ids."""
        start, length = int(packed.starts[offset]), int(packed.lengths[offset])
        assert source.mask is not None and source.eos_id is not None
        ids = np.full(self.seq_len + 1, source.eos_id, dtype=np.int64)
        trained = np.zeros(self.seq_len + 1, dtype=np.uint8)
        ids[:length] = source.tokens.read(start, start + length)
        trained[:length] = source.mask.read(start, start + length)
        return encode_masked(ids, trained)

    @property
    def source_names(self) -> list[str]:
        """The sources whose tokens `tokens_per_source` counts: each data.paths entry."""
        return [s.path for s in self.sources]

    def sequence_indices(self, step: int, global_batch_size: int, seed: int) -> np.ndarray:
        """Which windows make up step `step`'s global batch, in order.

        Sample position p = step * global_batch_size + i is window
        permutation_e[p % num_sequences] of epoch e = p // num_sequences.
        """
        check_batch_args(step, global_batch_size, seed)
        positions = step * global_batch_size + np.arange(global_batch_size, dtype=np.int64)
        return self.windows_at(positions, seed)

    def windows_at(self, positions: np.ndarray, seed: int) -> np.ndarray:
        """The windows at sample positions `positions` (int64) of the shuffled epochs."""
        epochs = positions // self.num_sequences
        offsets = positions % self.num_sequences
        indices = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            indices[in_epoch] = self._permutation(seed, int(epoch))[offsets[in_epoch]]
        return indices

    def tokens_per_source(self, step: int, global_batch_size: int, seed: int) -> np.ndarray:
        """[sources] int64: the target tokens step `step`'s global batch takes from each
        source, in the order of `sources`."""
        return self.tokens_of_windows(self.sequence_indices(step, global_batch_size, seed))

    def tokens_of_windows(self, indices: np.ndarray) -> np.ndarray:
        """[sources] int64: the target tokens windows `indices` hold from each source."""
        owners = np.searchsorted(self._window_ends, indices, side="right")
        return np.bincount(owners, minlength=len(self.sources)).astype(np.int64) * self.seq_len

    def tokens_before(self, step: int, global_batch_size: int, seed: int) -> np.ndarray:
        """[sources] int64: the target tokens steps 0 .. step-1 took from each source."""
        check_batch_args(step, global_batch_size, seed)
        return self.tokens_in_first(step * global_batch_size, seed)

    def tokens_in_first(self, samples: int, seed: int) -> np.ndarray:
        """[sources] int64: the target tokens the first `samples` sample positions hold from
        each source (whole epochs hold every window once)."""
        epochs, rest = divmod(samples, self.num_sequences)
        windows = np.diff(self._window_ends, prepend=0) * self.seq_len
        partial = self.tokens_of_windows(self._permutation(seed, epochs)[:rest])
        return epochs * windows + partial

    def batch(self, step: int, global_batch_size: int, seed: int) -> torch.Tensor:
        """Step `step`'s global batch: a LongTensor [global_batch_size, seq_len + 1].

        Depends only on (seed, step); inputs are `[:, :-1]`, targets `[:, 1:]`.
        """
        return self.rows(step, global_batch_size, seed, 0, global_batch_size)

    def rows(
        self, step: int, global_batch_size: int, seed: int, start: int, stop: int
    ) -> torch.Tensor:
        """Rows start .. stop-1 of step `step`'s global batch (a LongTensor
        [stop - start, seq_len + 1]), reading only those sequences."""
        indices = self.sequence_indices(step, global_batch_size, seed)[start:stop]
        return read_windows(self, indices)

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
        with self._permutations_lock:
            return self._cached_permutation(seed, epoch)

    def _cached_permutation(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        permutation = self._permutations.get(key)
        if permutation is None:
            entropy = [seed, epoch, *self._stream]
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
            permutation = np.arange(self.num_sequences, dtype=self._index_dtype)
            rng.shuffle(permutation)
            if len(self._permutations) >= _CACHED_PERMUTATIONS:
                del self._permutations[next(iter(self._permutations))]
            self._permutations[key] = permutation
        return permutation


def read_windows(dataset: TokenDataset, indices: np.ndarray) -> torch.Tensor:
    """The windows `indices` of `dataset` as a LongTensor [len(indices), seq_len + 1]."""
    import torch

    batch = np.empty((len(indices), dataset.seq_len + 1), dtype=np.int64)
    for row, index in enumerate(indices):
        batch[row] = dataset.sequence(int(index))
    return torch.from_numpy(batch)


def check_batch_args(step: int, global_batch_size: int, seed: int) -> None:
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if global_batch_size < 1:
        raise DataError(f"data.global_batch_size={global_batch_size} must be >= 1")
    if seed < 0:
        raise DataError(f"train.seed={seed} must be >= 0")


def _common_eos_id(sources: Sequence[TokenSource]) -> int | None:
    """The end-of-document id the sources declare (None if none does); raise if they differ."""
    eos_ids = sorted({s.eos_id for s in sources if s.eos_id is not None})
    if len(eos_ids) > 1:
        listing = ", ".join(f"{s.path} (eos_id={s.eos_id})" for s in sources)
        raise DataError(
            f"data.paths were prepared with different tokenizers: {listing}; "
            "prepare them all with the same tokenizer"
        )
    return eos_ids[0] if eos_ids else None


def _check_masks(sources: Sequence[TokenSource]) -> None:
    """Every source has a label mask, and it marks a token to train on."""
    for source in sources:
        if source.mask is None:
            raise DataError(
                f"data.label_mask=true but data.paths entry {source.path} has no label mask; "
                "prepare it with `moe-train prepare-data --format chat` (or prompt-completion), "
                "or set data.label_mask=false"
            )
        if not source.mask.any_nonzero():
            held = f"its label mask marks none of its {source.num_tokens:,} tokens"
            raise DataError(
                f"data.label_mask=true but {source.path} has no token to train on "
                f"({held if source.num_tokens else 'it holds no tokens'}); prepare it again "
                "from rows with assistant replies (or with --train-on all)"
            )


def _pack(source: TokenSource, window: int, split_long: bool) -> PackedWindows:
    """The packed windows of a masked source (whose documents end at its eos_id)."""
    if source.eos_id is None:
        raise DataError(
            f"data.paths entry {source.path} declares no end-of-document id, so its documents "
            "cannot be packed; prepare it with moe-train prepare-data"
        )
    return pack_documents(document_ends(source.tokens, source.eos_id), window, split_long)


def _open_source(path: str | Path, cache_dir: Path | None) -> TokenSource:
    """Open one `data.paths` entry, checking it against its metadata."""
    if isinstance(path, str) and path.startswith("builtin:"):
        if path != BUILTIN_STDLIB:
            raise DataError(
                f"unknown built-in dataset {path!r}; the built-in one is {BUILTIN_STDLIB}"
            )
        return _prepared_source(path, builtin_dataset_dir(cache_dir))
    try:
        file_name, dtype_name = split_dtype_suffix(str(path))
    except ValueError as e:
        raise DataError(f"data.paths entry {path}: {e}") from e
    file_path = Path(file_name)
    if dtype_name is not None:
        tokens = TokenStream([open_headerless(file_path, dtype_name)])
        vocab_size = tokens.id_range(str(path))[1] + 1
        return TokenSource(str(path), tokens, max(vocab_size, 1), None)
    if file_path.is_dir():
        return _prepared_source(str(path), file_path)
    if not file_path.exists():
        unfinished = partial_dir(file_path)
        if unfinished.is_dir():
            raise DataError(
                f"data.paths entry {path} not found: its preparation has not finished "
                f"({unfinished} exists); run the same prepare-data command again to complete it"
            )
        raise DataError(f"data.paths entry {path} not found; give {_VALID_PATHS}")
    if file_path.suffix.lower() == ".npy":
        tokens = TokenStream([open_token_array(file_path)])
        vocab_size = tokens.id_range(str(file_path))[1] + 1
        return TokenSource(str(path), tokens, max(vocab_size, 1), None)
    raise DataError(f"data.paths entry {path} is not {_VALID_PATHS}")


def _prepared_source(name: str, directory: Path) -> TokenSource:
    prepared = open_prepared_dir(directory)
    return TokenSource(name, prepared.tokens, prepared.vocab_size, prepared.eos_id, prepared.mask)
