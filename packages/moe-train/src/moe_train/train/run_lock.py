"""One writer per run directory: `RUN_DIR/run.lock`, held by rank 0 for the whole job.

The lock is a file created with an exclusive create (O_CREAT | O_EXCL, which NFS and Lustre
honour, unlike `flock`), holding JSON that names its holder (host, pid, launch id, start time,
command line). While the job lives, a daemon thread of its holder refreshes the file's
modification time every HEARTBEAT_S seconds, also during a step that lasts minutes. A lock
whose heartbeat is older than STALE_AFTER_S belongs to a job that was killed without a chance
to release it (SIGKILL, a lost node): the next launch takes it over and says so. On the
holder's own host a launch need not wait that long: when the holder's process is gone and
its heartbeat has stopped for DEAD_HOLDER_S (a killed job relaunched at once), the lock is
taken over too. Any other lock stops the launch with one line naming its holder (exit 2,
before anything is written).

Only `train` locks (`inspect`, `plot` and the other readers never do). A lock this process
takes stays held until `release_held_locks`, which the trainer calls on every way out; a lock
is removed only while it still holds this process's own content.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from moe_train.errors import MoeTrainError

LOCK_NAME = "run.lock"
"""The lock's file name in the run directory."""
HEARTBEAT_S = 1.0
"""Seconds between the holder's refreshes of the lock's modification time."""
DEAD_HOLDER_S = 3 * HEARTBEAT_S
"""A lock of this host whose process is gone is taken over once its heartbeat is this old:
three missed beats, so a live holder whose pid this process cannot see (another pid
namespace under the same host name) keeps its lock."""
STALE_AFTER_S = 90.0
"""A lock whose modification time is older than this is taken over: 18 missed heartbeats,
generous for clocks of the hosts sharing a network file system that disagree by up to a
minute (the reader compares the file's time, set by the file server, with its own clock)."""
_TAKE_ATTEMPTS = 5
"""Rounds of judge-and-take before giving up on a lock that keeps changing hands."""


class RunDirBusy(MoeTrainError):
    """Another live launch holds the run directory's lock."""


@dataclass(frozen=True)
class LockHolder:
    """What a lock file says about the launch that holds it, and how old its heartbeat is."""

    content: bytes
    """The file's bytes as read (what a takeover checks it renamed)."""
    heartbeat_age_s: float
    """Seconds since the holder last refreshed the file (by this host's clock)."""

    @property
    def fields(self) -> dict:
        try:
            data = json.loads(self.content)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    @property
    def stale(self) -> bool:
        return self.heartbeat_age_s > STALE_AFTER_S

    def describe(self) -> str:
        """`host H, pid P, started ... (N s ago), command ...`."""
        f = self.fields
        if not f:
            return "a launch whose lock file is empty or unreadable"
        started = f.get("started")
        when = "an unknown time"
        if isinstance(started, (int, float)):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
            when = f"{stamp} ({time.time() - started:.0f} s ago)"
        return (
            f"host {f.get('host', '?')}, pid {f.get('pid', '?')}, started {when}, "
            f"command `{f.get('command', '?')}`"
        )


class RunLock:
    """The lock of one run directory, held by this process, with its heartbeat thread."""

    def __init__(self, path: Path, content: bytes, *, made_from: Path | None = None) -> None:
        self.path, self.content = path, content
        self.made_from = made_from
        """The outermost directory this launch made for the run directory (it and those below
        it are removed on release while empty); None when the run directory existed."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def owned(self) -> bool:
        """Whether the lock file still holds this process's content."""
        try:
            return self.path.read_bytes() == self.content
        except OSError:
            return False

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still this process's, and the
        run directory too when this launch made it and wrote nothing else there (a run that
        did not start leaves nothing behind)."""
        self._stop.set()
        self._thread.join()
        if self.owned():
            self.path.unlink(missing_ok=True)
            if self.made_from is not None:
                _remove_empty(self.path.parent, self.made_from)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.path.read_bytes() == self.content:
                    os.utime(self.path)
                    continue
            except FileNotFoundError:
                pass
            except OSError:
                continue  # a file server that does not answer now may at the next beat
            _say(f"warning: {self.path} is no longer this job's lock; its heartbeat stops")
            return


_held: dict[Path, RunLock] = {}
"""The locks this process holds, by lock file."""


def take_run_lock(
    run_dir: Path, *, launch: str, busy_is_error: bool = True, made_from: Path | None = None
) -> bool:
    """Take `run_dir`'s lock for this process (until `release_held_locks`). A live holder
    raises RunDirBusy when `busy_is_error`, else returns False (the caller tries another
    directory); a stale one is taken over, with a line saying so. `made_from`: the outermost
    directory this launch made for `run_dir` (see `RunLock.release`)."""
    path = run_dir / LOCK_NAME
    content = _lock_content(launch)
    for _ in range(_TAKE_ATTEMPTS):
        if _create(path, content):
            _held[path] = RunLock(path, content, made_from=made_from)
            return True
        holder = _read_holder(path)
        if holder is None:
            continue  # released between the create and the read: try again
        gone = not holder.stale and _holder_gone(holder)
        if gone:
            holder = _after_dead_holder_wait(path, holder)
            if holder is None:
                continue
            gone = holder.heartbeat_age_s >= DEAD_HOLDER_S
        if not holder.stale and not gone:
            if not busy_is_error:
                return False
            raise RunDirBusy(_busy_message(run_dir, holder))
        if _set_aside(path, holder):
            why = "its process is gone from this host" if gone else f"more than {STALE_AFTER_S:g} s"
            _say(
                f"took over the stale lock of {run_dir} from {holder.describe()}: its "
                f"heartbeat is {holder.heartbeat_age_s:.0f} s old ({why})"
            )
    raise RunDirBusy(f"{path} keeps changing hands; is another launch of this run starting?")


def release_held_locks() -> None:
    """Release every lock this process holds (each only while it is still this process's)."""
    while _held:
        _, lock = _held.popitem()
        lock.release()


def _remove_empty(directory: Path, outermost: Path) -> None:
    """Remove `directory` and its parents up to `outermost` while they are empty (a run that
    wrote its files keeps them)."""
    while True:
        try:
            directory.rmdir()
        except OSError:
            return
        if directory == outermost or directory.parent == directory:
            return
        directory = directory.parent


def _holder_gone(holder: LockHolder) -> bool:
    """Whether the holder ran on this host and its process no longer runs (or is a zombie)."""
    fields = holder.fields
    pid = fields.get("pid")
    if fields.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return False  # an earlier run of this process still holds it: not gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's live process
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return status.rsplit(")", 1)[-1].split()[0] == "Z"  # killed, not yet reaped


def _after_dead_holder_wait(path: Path, holder: LockHolder) -> LockHolder | None:
    """The lock read again once its heartbeat could be DEAD_HOLDER_S old (None: released)."""
    time.sleep(max(0.0, DEAD_HOLDER_S - holder.heartbeat_age_s) + 0.1)
    return _read_holder(path)


def _lock_content(launch: str) -> bytes:
    data = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "launch": launch,
        "started": time.time(),
        "command": " ".join(sys.argv),
        "token": uuid.uuid4().hex,  # two launches of one pid (in-process runs) differ
    }
    return (json.dumps(data) + "\n").encode()


def _create(path: Path, content: bytes) -> bool:
    """Create `path` holding `content`, only if nothing is there (False if something is)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    return True


def _read_holder(path: Path) -> LockHolder | None:
    """The lock's holder, or None when the file is gone. A file still being written by its
    creator (empty) is read again for a moment before it counts as unreadable."""
    for _ in range(20):
        try:
            stat = path.stat()
            content = path.read_bytes()
        except FileNotFoundError:
            return None
        if content:
            break
        time.sleep(0.05)
    return LockHolder(content, time.time() - stat.st_mtime)


def _set_aside(path: Path, judged: LockHolder) -> bool:
    """Move the stale lock `judged` out of the way. Renaming is atomic; what was renamed is
    checked to be the lock that was judged stale (another launch may have taken it over in
    between), and put back when it is not. True when the judged lock is gone."""
    aside = path.with_name(f"{path.name}.stale.{socket.gethostname()}.{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        if aside.read_bytes() == judged.content:
            return True
        os.link(aside, path)  # another launch's fresh lock: back in place, unless a newer one is
    except OSError:
        pass
    finally:
        aside.unlink(missing_ok=True)
    return False


def _busy_message(run_dir: Path, holder: LockHolder) -> str:
    return (
        f"train.run_dir={run_dir} is in use by another launch ({holder.describe()}); its "
        f"heartbeat is {max(holder.heartbeat_age_s, 0.0):.0f} s old, and its lock "
        f"{run_dir / LOCK_NAME} is taken over once that is more than {STALE_AFTER_S:g} s: "
        f"wait for that job to end or stop it, or set train.run_dir to another directory"
    )


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
