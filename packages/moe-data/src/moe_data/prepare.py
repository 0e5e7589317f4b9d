"""`prepare_data`: text, JSON Lines, parquet and saved Hugging Face datasets into token shards.

The output directory holds `meta.json`, the manifest (format, dtype, totals, vocab_size,
eos_id, tokenizer, the shards in order, and per input file its sha256, tokens and
documents), and the shards `tokens-NNNNNN.bin`: raw little-endian uint16 or uint32 ids, each
document followed by eos_id (.npy inputs are copied as they are, with no eos). Read in order,
the shards are one token stream. The directory appears under its final name only when
complete; until then the work is in `.NAME.partial` next to it, and running the same command
again continues from the shards finished there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from moe_data.errors import PREEMPTED_EXIT, DataError, UserError
from moe_data.inputs import expand_inputs, input_file
from moe_data.plan import Plan, Task, make_plan
from moe_data.progress import ProgressBar
from moe_data.shards import (
    finished_records,
    manifest,
    record_name,
    remove_leftovers,
    run_task,
    write_json,
)
from moe_data.token_files import META_FILE, shard_file_name
from moe_data.tokenizer import Tokenizer, load_tokenizer
from moe_data.workers import WorkerSetup, run_in_workers

LOCK_FILE = "prepare.lock"


class PreparationStopped(UserError):
    """SIGINT or SIGTERM stopped prepare-data; its finished shards are kept for a rerun."""

    exit_code = PREEMPTED_EXIT


def partial_dir(out_dir: Path) -> Path:
    """Where the preparation of `out_dir` works until it is complete."""
    return out_dir.parent / f".{out_dir.name}.partial"


def prepare_data(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: str | None = None,
    *,
    workers: int = 1,
    text_field: str = "text",
    shard_size: int | str | None = None,
    dtype: str | None = None,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Tokenize `inputs` into `out_dir` (which must not exist or be empty); return meta.json.

    `tokenizer`: "byte" (default when None) or a tokenizer.json path. `workers`: processes
    (1: this one). `text_field`: the field or column holding the text (JSON Lines, parquet,
    Hugging Face datasets). `shard_size`: input bytes per shard (e.g. "64M"; default: sized
    for about 64 shards, 1-256 MiB each). `dtype`: "uint16", "uint32" or None/"auto" (the
    smallest that holds every id). `progress`: where the progress bar goes (None: nowhere).
    The result does not depend on `workers`. SIGINT and SIGTERM stop it with
    `PreparationStopped`, keeping finished shards for the next run of the same command.
    """
    out_dir = Path(out_dir)
    check_out_dir_free(out_dir)
    if workers < 1:
        raise DataError(f"--workers={workers} must be at least 1")
    tokenizer_impl = load_tokenizer(tokenizer)
    plan = make_plan(
        expand_inputs(inputs),
        tokenizer_impl,
        text_field=text_field,
        shard_size=shard_size,
        dtype=dtype,
    )
    work_dir = partial_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with locked_work_dir(work_dir):
        meta = _prepare_in(work_dir, plan, tokenizer_impl, workers, progress)
        check_out_dir_free(out_dir)
        try:
            os.rename(work_dir, out_dir)
        except OSError as e:
            raise DataError(
                f"output directory {out_dir} already exists; choose another --out or delete it"
            ) from e
    return meta


def _prepare_in(
    work_dir: Path, plan: Plan, tokenizer: Tokenizer, workers: int, progress: TextIO | None
) -> dict[str, Any]:
    """Finish the plan in `work_dir`, keeping what an earlier run finished; return meta.json."""
    records = finished_records(plan, work_dir)
    kept = {name for i in records for name in (shard_file_name(i), record_name(i))}
    remove_leftovers(work_dir, kept)
    try:
        with _signals_stop():
            _run(plan, records, work_dir, tokenizer, workers, progress)
    except _Stopped as e:
        raise PreparationStopped(
            f"stopped by {e}: {len(records)} of {len(plan.tasks)} shards are done, kept in "
            f"{work_dir}; run the same command again to continue"
        ) from None
    except BaseException:
        if not records:
            shutil.rmtree(work_dir, ignore_errors=True)
        raise
    meta = manifest(plan, records)
    if meta["num_tokens"] <= meta["num_documents"]:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise DataError(_no_text(plan))
    _finish(work_dir, meta)
    return meta


def _no_text(plan: Plan) -> str:
    """Why a corpus whose documents are all empty (only end-of-document ids) is refused."""
    paths = [str(source.path) for source in plan.sources]
    if len(paths) == 1:
        what = f"{paths[0]} holds no text"
    else:
        listed = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
        what = f"none of the {len(paths)} inputs ({listed}) holds any text"
    return f"{what} to tokenize, so nothing would be trained on; give inputs with text"


def write_dataset(files: Sequence[Path], dest_dir: Path, tokenizer: Tokenizer) -> dict[str, Any]:
    """Tokenize `files` into the existing empty `dest_dir` in this process; return meta.json."""
    plan = make_plan([input_file(Path(path)) for path in files], tokenizer)
    records: dict[int, dict[str, Any]] = {}
    for task, record in _run_here(plan.tasks, plan, dest_dir, tokenizer, ProgressBar(None, 0, 0)):
        records[task.index] = record
    meta = manifest(plan, records)
    _finish(dest_dir, meta)
    return meta


def _run(
    plan: Plan,
    records: dict[int, dict[str, Any]],
    work_dir: Path,
    tokenizer: Tokenizer,
    workers: int,
    stream: TextIO | None,
) -> None:
    """Run the plan's unfinished tasks, adding their records to `records`."""
    pending = [task for task in plan.tasks if task.index not in records]
    done_bytes = sum(task.size for task in plan.tasks if task.index in records)
    total_bytes = sum(task.size for task in plan.tasks)
    bar = ProgressBar(stream, total_bytes, len(plan.tasks), done_bytes, len(records))
    asked, workers = workers, max(1, min(workers, len(pending)))
    bar.say(
        f"preparing {_count(len(plan.sources), 'input file')} ({total_bytes / 1e6:,.1f} MB) "
        f"into {_count(len(plan.tasks), 'shard')} of about {plan.shard_bytes / 1e6:,.1f} MB "
        f"with {_count(workers, 'worker')}{_fewer_workers_note(asked, workers, pending, plan)}"
        + (f"; {_kept(len(records))}" if records else "")
    )
    if workers == 1:
        finished = _run_here(pending, plan, work_dir, tokenizer, bar)
    else:
        setup = WorkerSetup(plan.sources, plan.settings, work_dir, os.getpid())
        finished = run_in_workers(pending, setup, workers, bar.update)
    with contextlib.closing(finished):
        for task, record in finished:
            records[task.index] = record
            bar.shard_done(task.size)
    bar.finish()


def _kept(shards: int) -> str:
    """'1 shard finished earlier is kept', '4 shards finished earlier are kept'."""
    return f"{_count(shards, 'shard')} finished earlier {'is' if shards == 1 else 'are'} kept"


def _count(n: int, noun: str) -> str:
    """'1 shard', '3 shards'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _fewer_workers_note(asked: int, used: int, pending: Sequence[Task], plan: Plan) -> str:
    """Why fewer workers run than --workers asked for: a worker writes whole shards, so
    there are no more workers than shards left to write; and why there are so few shards."""
    if used >= asked:
        return ""
    compressed = {p.source for t in pending for p in t.pieces if plan.sources[p.source].compression}
    why = [f"{asked} asked for, at most one per shard to write"]
    if compressed:
        why.append("a compressed file (.gz, .zst) cannot be split: each is one shard")
    if len(compressed) < len(plan.sources):
        why.append("a smaller --shard-size makes more shards of the other inputs")
    return f" ({'; '.join(why)})"


def _run_here(
    tasks: Sequence[Task], plan: Plan, work_dir: Path, tokenizer: Tokenizer, bar: ProgressBar
) -> Iterator[tuple[Task, dict[str, Any]]]:
    for task in tasks:
        reported = 0

        def progress(input_bytes: int, task: Task = task) -> None:
            nonlocal reported
            reported = min(reported + input_bytes, task.size)
            bar.update(reported)

        record = run_task(task, plan.sources, plan.settings, tokenizer, work_dir, progress)
        bar.update(0)
        yield task, record


def _finish(work_dir: Path, meta: dict[str, Any]) -> None:
    """Keep only the shards, write meta.json last, and make it all durable."""
    remove_leftovers(work_dir, {shard["file"] for shard in meta["shards"]})
    write_json(work_dir / META_FILE, meta)
    (work_dir / LOCK_FILE).unlink(missing_ok=True)
    directory = os.open(work_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def check_out_dir_free(out_dir: Path) -> None:
    if out_dir.is_dir():
        if any(out_dir.iterdir()):
            raise DataError(
                f"output directory {out_dir} already exists; choose another --out or delete it"
            )
    elif out_dir.exists():
        raise DataError(f"output path {out_dir} is a file, not a directory; choose another --out")


@contextlib.contextmanager
def locked_work_dir(work_dir: Path) -> Iterator[None]:
    """Create `work_dir` if needed and hold its lock: one preparation at a time writes there."""
    try:
        work_dir.mkdir(exist_ok=True)
        lock = os.open(work_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise DataError(f"cannot write {work_dir} ({e.strerror}); choose another --out") from e
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise DataError(
                f"another prepare-data is writing {work_dir}; wait for it to finish"
            ) from e
        yield
    finally:
        os.close(lock)


class _Stopped(BaseException):
    """Raised in the main thread by SIGINT or SIGTERM while a preparation runs."""


@contextlib.contextmanager
def _signals_stop() -> Iterator[None]:
    """SIGINT and SIGTERM raise _Stopped once (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handler(number: int, frame: FrameType | None) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise _Stopped(signal.Signals(number).name)

    previous = {
        number: signal.signal(number, handler) for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
