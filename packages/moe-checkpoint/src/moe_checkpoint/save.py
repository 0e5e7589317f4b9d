"""Saving: every rank writes the bytes it owns straight into the final safetensors files.

Why not DCP's ``HuggingFaceStorageWriter``? With ``save_distributed=True`` it first writes
every rank's shards to ``sharded/`` files and then, in ``finish`` on the coordinator (or with
``consolidate_safetensors_files_on_every_rank``), reads them back and writes the consolidated
``model-0000X-of-0000N.safetensors``: every byte is written twice and read once more, and the
second pass is not spread over the ranks by default. Here the layout of each file is a pure
function of the tensors' names, shapes and dtypes, so rank 0 writes the headers and sizes the
files, and then all ranks ``pwrite`` their owned flat ranges at their final offsets, in
parallel: each byte is written once, into the final file, by the rank that owns it.
``benchmarks/checkpoint.py --dcp`` times both writers on the same state.

A save, on every rank (``world_size == 1`` is just the degenerate case):

1. Describe the owned slices; one all-gather of those descriptions (and of rank 0's temporary
   directory name and any local error). Every rank then checks, identically, that the ranks
   agree on each tensor and own it exactly once, and plans the same file layout.
2. Rank 0 creates ``ROOT/.tmp-step_N-<random>/`` and every file (header written, size set);
   an exchange acts as the barrier.
3. Every rank writes its bytes (``os.pwrite`` on its own descriptor) and fsyncs. A file written
   by one rank alone is hashed (whole-file sha256, chunk CRC32s) from memory by that rank while
   it writes; other files are hashed after the next exchange, file ``i`` by rank
   ``i % world_size``, reading it once.
4. ``SaveHandle.wait()``: an exchange (all bytes are down), the remaining hashes, an exchange
   gathering all hashes to rank 0, which writes ``index.json`` and ``trainer_state.json``
   (fsynced), renames the directory to ``ROOT/step_N`` and writes ``COMMITTED`` (fsynced, then
   the directory). A last exchange reports the outcome to every rank.

Asynchronous saves stage (copy) the owned data synchronously, then run step 3 in a background
thread; no collective ever runs off the calling thread. Steps 1-2 (small) happen inside
``save_checkpoint``; step 4 happens in ``handle.wait()``, which every rank must call (the next
``save_checkpoint`` calls it first if the caller has not).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moe_checkpoint.checksums import (
    DEFAULT_CHUNK_BYTES,
    FileChecksums,
    checksum_file,
    crc32_hex,
    sha256_of_bytes,
)
from moe_checkpoint.comm import Communicator
from moe_checkpoint.errors import CheckpointError
from moe_checkpoint.fileio import create_file, fsync_path, remove_dir, write_at, write_durable
from moe_checkpoint.format import (
    COMMIT_MARKER,
    DEFAULT_MAX_FILE_BYTES,
    INDEX_FILE,
    TMP_PREFIX,
    TRAINER_STATE_FILE,
    FileLayout,
    dtype_code,
    natural_key,
    step_dir_name,
)
from moe_checkpoint.index import CheckpointIndex, FileRecord, TensorRecord, is_committed
from moe_checkpoint.plan import Categories, OwnedSlice, SavePlan, describe_slices, plan_save
from moe_checkpoint.staging import StagingArea
from moe_checkpoint.writer import WRITE_THREADS, Placement, write_owned_bytes

_phase_hook: Callable[[str], None] | None = None
"""Test seam: called with the name of each phase a save reaches ("files_created", "writing",
"written", "renamed", "committed"); crash tests stop a process there."""

_in_flight: SaveHandle | None = None


def _phase(name: str) -> None:
    if _phase_hook is not None:
        _phase_hook(name)


class SaveHandle:
    """A save in progress or done. `wait()` (on every rank) finishes and commits it."""

    def __init__(
        self,
        step: int,
        path: Path,
        tmp_dir: Path,
        plan: SavePlan,
        comm: Communicator,
        trainer_state_json: bytes | None,
    ) -> None:
        self.step = step
        self.path = path
        """The checkpoint directory, ``ROOT/step_NNNNNNNN``; complete once `wait()` returns."""
        self._tmp_dir = tmp_dir
        self._plan = plan
        self._comm = comm
        self._trainer_state_json = trainer_state_json
        self._thread: threading.Thread | None = None
        self._hashes: dict[str, FileChecksums] = {}
        self._write_error: str | None = None
        self._outcome: str | None = None  # "committed" or the error message

    def done(self) -> bool:
        """Whether `wait()` has finished (committed or failed)."""
        return self._outcome is not None

    def wait(self) -> Path:
        """Finish the save: collectives on the calling thread, then rank 0 commits. Every rank
        must call it; returns the committed directory or raises the same CheckpointError on
        every rank."""
        global _in_flight
        if self._outcome == "committed":
            return self.path
        if self._outcome is not None:
            raise CheckpointError(self._outcome)
        try:
            if self._thread is not None:
                self._thread.join()
            self._comm.exchange(error=self._write_error)
            _phase("written")
            error = None
            try:
                self._hash_files_from_disk()
            except OSError as e:
                error = f"hashing {e.filename}: {e.strerror}"
            all_hashes = self._comm.exchange(self._hashes, error)
            error = None
            if self._comm.rank == 0:
                try:
                    self._commit({k: v for hashes in all_hashes for k, v in hashes.items()})
                except OSError as e:
                    error = f"committing {self.path}: {e}"
                except CheckpointError as e:
                    error = str(e)
            self._comm.exchange(error=error)
        except CheckpointError as e:
            self._outcome = str(e)
            self._discard_tmp_dir()
            raise
        finally:
            if _in_flight is self:
                _in_flight = None
        self._outcome = "committed"
        return self.path

    def _start_writing(self, placements: list[Placement], background: bool) -> None:
        if background:
            self._thread = threading.Thread(
                target=self._write, args=(placements,), name="moe-checkpoint-writer", daemon=True
            )
            self._thread.start()
        else:
            self._write(placements)

    def _write(self, placements: list[Placement]) -> None:
        """This rank's bytes (no collectives: safe on a background thread)."""
        try:
            hashes = write_owned_bytes(
                self._tmp_dir, self._plan, self._comm.rank, placements, lambda: _phase("writing")
            )
            self._hashes.update(hashes)
        except OSError as e:
            self._write_error = f"writing {e.filename or self._tmp_dir}: {e.strerror or e}"
        except Exception as e:
            self._write_error = f"writing into {self._tmp_dir}: {e!r}"

    def _hash_files_from_disk(self) -> None:
        """Hash the files assigned to this rank that nobody hashed from memory."""
        mine = [
            layout
            for index, layout in enumerate(self._plan.files)
            if self._plan.hasher(index) == self._comm.rank and layout.name not in self._hashes
        ]

        def checksums(layout: FileLayout) -> FileChecksums:
            path = self._tmp_dir / layout.name
            return checksum_file(path, layout.tensor_ranges(), self._plan.chunk_bytes)

        with ThreadPoolExecutor(WRITE_THREADS) as pool:
            for layout, sums in zip(mine, pool.map(checksums, mine), strict=True):
                self._hashes[layout.name] = sums

    def _commit(self, hashes: dict[str, FileChecksums]) -> None:
        """Rank 0: index and trainer state, fsync, rename into place, then the marker."""
        trainer_state_json = self._trainer_state_json or b"{}"
        index = _build_index(self.step, self._plan, hashes, trainer_state_json)
        # The headers rank 0 wrote (the data: fsynced by its writers).
        for layout in self._plan.files:
            fsync_path(self._tmp_dir / layout.name)
        index_json = index.to_json().encode()
        write_durable(self._tmp_dir / INDEX_FILE, index_json)
        write_durable(self._tmp_dir / TRAINER_STATE_FILE, trainer_state_json)
        fsync_path(self._tmp_dir)
        if self.path.exists():
            if is_committed(self.path):
                raise CheckpointError(
                    f"checkpoint {self.path} is already committed; not replacing it"
                )
            remove_dir(self.path)  # left by a crash between rename and marker: never trusted
        os.rename(self._tmp_dir, self.path)
        fsync_path(self.path.parent)
        _phase("renamed")
        marker = {"step": self.step, "index_sha256": sha256_of_bytes(index_json)}
        write_durable(self.path / COMMIT_MARKER, json.dumps(marker).encode())
        fsync_path(self.path)
        _phase("committed")

    def _discard_tmp_dir(self) -> None:
        if self._comm.rank == 0 and self._tmp_dir.exists():
            # A stale temporary directory is harmless; prune_checkpoints removes it later.
            with contextlib.suppress(OSError):
                remove_dir(self._tmp_dir)


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    slices: Sequence[OwnedSlice],
    categories: Categories,
    trainer_state: Mapping[str, Any] | None,
    *,
    group: dist.ProcessGroup | None = None,
    asynchronous: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    checksum_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> SaveHandle:
    """Save the global tensors whose pieces the ranks own as ``root/step_NNNNNNNN``.

    Called on every rank of `group` (None: the default group if torch.distributed is
    initialised, else this process alone) with the slices that rank owns; over all ranks the
    slices of each tensor must cover it exactly once. Floating-point data is stored as float32,
    other dtypes as they are. `categories` maps each tensor name (mapping or function) to its
    file prefix (``model``, ``optim``, ...); files hold at most about `max_file_bytes` each.
    `trainer_state` (JSON-able; rank 0's is written) goes to ``trainer_state.json``. Each
    tensor's bytes get a CRC32 per `checksum_chunk_bytes` chunk (the same on every rank), the
    unit that readers read and check.

    Synchronous: returns once the checkpoint is committed. ``asynchronous=True``: copies the
    owned data (to pinned memory for CUDA tensors) before returning, writes in a background
    thread, and the returned handle's ``wait()`` commits; every rank must call it (a later save
    calls it first, and raises if that earlier save failed). One save is in flight at a time.
    Raises CheckpointError, the same on every rank, for inconsistent ownership and for any
    rank's failure to write.
    """
    global _in_flight
    if _in_flight is not None:
        _in_flight.wait()
    comm = Communicator(group)
    final_dir = Path(root) / step_dir_name(step)
    plan, tmp_dir, trainer_state_json = _agree_on_plan(
        comm, final_dir, step, slices, categories, trainer_state, max_file_bytes,
        checksum_chunk_bytes,
    )  # fmt: skip
    _create_files_together(comm, tmp_dir, plan)
    _phase("files_created")

    handle = SaveHandle(step, final_dir, tmp_dir, plan, comm, trainer_state_json)
    placements = _placements(slices, plan)
    if asynchronous:
        _in_flight = handle
        _stage_and_write_in_background(handle, placements)
        return handle
    handle._start_writing(placements, background=False)
    handle.wait()
    return handle


def _create_files_together(comm: Communicator, tmp_dir: Path, plan: SavePlan) -> None:
    """Rank 0 creates the plan's files in `tmp_dir`; every rank raises if that failed."""
    error = None
    if comm.rank == 0:
        try:
            _create_files(tmp_dir, plan)
        except OSError as e:
            error = f"creating {e.filename or tmp_dir}: {e.strerror or e}"
    comm.exchange(error=error)


def _stage_and_write_in_background(handle: SaveHandle, placements: list[Placement]) -> None:
    """Copy the owned data aside and start writing it in a thread; a failure to copy is kept
    for `handle.wait()` to report to every rank."""
    try:
        staged = _staging.stage([(p.data, p.dtype) for p in placements])
    except (RuntimeError, MemoryError) as e:  # reported to every rank by wait()
        handle._write_error = f"staging a copy of the owned data: {e}"
        return
    placements = [
        Placement(p.file_index, p.offset, data, p.dtype)
        for p, data in zip(placements, staged, strict=True)
    ]
    handle._start_writing(placements, background=True)


def _agree_on_plan(
    comm: Communicator,
    final_dir: Path,
    step: int,
    slices: Sequence[OwnedSlice],
    categories: Categories,
    trainer_state: Mapping[str, Any] | None,
    max_file_bytes: int,
    checksum_chunk_bytes: int,
) -> tuple[SavePlan, Path, bytes | None]:
    """Check the arguments, exchange every rank's pieces and plan the files, the same on
    every rank: the plan, the temporary directory to write, and rank 0's encoded trainer
    state (None on other ranks). Raises the same CheckpointError on every rank."""
    error = None
    pieces: list = []
    trainer_state_json = None
    tmp_name = None
    try:
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step={step!r} must be a non-negative integer")
        if not isinstance(checksum_chunk_bytes, int) or checksum_chunk_bytes <= 0:
            raise CheckpointError(
                f"checksum_chunk_bytes={checksum_chunk_bytes!r} must be a positive integer"
            )
        pieces = describe_slices(slices, categories)
        if comm.rank == 0:
            trainer_state_json = _encode_trainer_state(trainer_state)
            if is_committed(final_dir):
                raise CheckpointError(
                    f"checkpoint {final_dir} is already committed; not replacing it"
                )
            tmp_name = f"{TMP_PREFIX}{final_dir.name}-{secrets.token_hex(4)}"
    except CheckpointError as e:
        error = str(e)
    gathered = comm.exchange((step, checksum_chunk_bytes, pieces, tmp_name), error)
    for position, name in ((0, "steps"), (1, "checksum_chunk_bytes")):
        values = [rank_values[position] for rank_values in gathered]
        if len(set(values)) > 1:
            raise CheckpointError(f"the ranks save different {name}: {values} (by rank)")
    plan = plan_save(
        [rank_pieces for _, _, rank_pieces, _ in gathered], max_file_bytes, checksum_chunk_bytes
    )
    return plan, final_dir.parent / gathered[0][3], trainer_state_json


def _placements(slices: Sequence[OwnedSlice], plan: SavePlan) -> list[Placement]:
    """Where in which file each owned slice's bytes go."""
    return [
        Placement(
            file_index=plan.file_of[piece.name],
            offset=plan.files[plan.file_of[piece.name]].byte_ranges[piece.name][0]
            + piece.flat_start * plan.tensors[piece.name].dtype.itemsize,
            data=piece.data,
            dtype=plan.tensors[piece.name].dtype,
        )
        for piece in slices
    ]


def release_staging_memory() -> None:
    """Free the host buffer kept between asynchronous saves (it is reused to avoid page faults
    and pinned-memory allocation at every save); waits for a save in flight first."""
    if _in_flight is not None:
        _in_flight.wait()
    _staging.release()


def _encode_trainer_state(trainer_state: Mapping[str, Any] | None) -> bytes:
    try:
        return json.dumps(dict(trainer_state or {}), indent=1).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"trainer_state is not JSON-serialisable: {e}") from e


def _build_index(
    step: int, plan: SavePlan, hashes: dict[str, FileChecksums], trainer_state_json: bytes
) -> CheckpointIndex:
    """The index of a save whose every file is hashed; it depends only on the tensors and the
    saving world size, never on who owned what (tensors in natural name order)."""
    tensors = {}
    for name in sorted(plan.tensors, key=natural_key):
        spec = plan.tensors[name]
        layout = plan.files[plan.file_of[name]]
        tensors[name] = TensorRecord(
            file=layout.name,
            shape=spec.shape,
            dtype=dtype_code(spec.dtype),
            category=spec.category,
            byte_range=layout.byte_ranges[name],
            chunk_crc32=hashes[layout.name].chunk_crc32[name],
        )
    files = {
        layout.name: FileRecord(
            size=layout.size,
            sha256=hashes[layout.name].sha256,
            header_bytes=len(layout.header),
            header_crc32=crc32_hex(layout.header),
        )
        for layout in plan.files
    }
    return CheckpointIndex(
        step=step,
        saved_world_size=plan.world_size,
        chunk_bytes=plan.chunk_bytes,
        trainer_state_sha256=sha256_of_bytes(trainer_state_json),
        tensors=tensors,
        files=files,
    )


def _create_files(tmp_dir: Path, plan: SavePlan) -> None:
    """Rank 0: the temporary directory and every file at its final size, header written.
    (Not fsynced here, to keep asynchronous saves' stall short: `_commit` fsyncs them.)"""
    tmp_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir.mkdir()
    for layout in plan.files:
        fd = create_file(tmp_dir / layout.name, exclusive=True)
        try:
            write_at(fd, memoryview(layout.header), 0)
            os.ftruncate(fd, layout.size)
        finally:
            os.close(fd)


_staging = StagingArea()
