"""One writer per run directory: the lock is exclusive, refused while its heartbeat is fresh,
taken over once it is stale, released only by its holder; and the launcher's loss is a stop
request under torchrun alone."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from moe_train.cli import main
from moe_train.signals import LAUNCHER_CODE, LAUNCHER_GONE, SIGNAL_CODE, StopRequests
from moe_train.train import read_metrics, run_dir, run_lock
from moe_train.train.run_dir import choose_run_dir
from moe_train.train.run_lock import (
    LOCK_NAME,
    STALE_AFTER_S,
    RunDirBusy,
    release_held_locks,
    take_run_lock,
)
from moe_train.train.runtime import launched_by_torchrun
from training import save_config


@pytest.fixture(autouse=True)
def _release_locks():
    yield
    release_held_locks()


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _plant_lock(
    run: os.PathLike, *, age_s: float, host: str = "node-17", pid: int | None = None
) -> bytes:
    """A lock of another launch (by default a dead pid on another host) whose heartbeat is
    `age_s` old."""
    os.makedirs(run, exist_ok=True)
    path = os.path.join(run, LOCK_NAME)
    started = time.time() - age_s - 60
    content = json.dumps(
        {
            "host": host,
            "pid": _dead_pid() if pid is None else pid,
            "launch": "node-17|29500|job",
            "started": started,
            "command": "moe-train train other.yaml",
        }
    ).encode()
    with open(path, "wb") as f:
        f.write(content)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return content


def _wait_until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.01)


def test_the_lock_names_its_holder_beats_and_is_refused_to_a_second_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.02)
    monkeypatch.setattr(sys, "argv", ["moe-train", "train", "job.yaml"])
    assert take_run_lock(tmp_path, launch="node0|29500|abc")
    path = tmp_path / LOCK_NAME
    holder = json.loads(path.read_bytes())
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    assert holder["launch"] == "node0|29500|abc"
    assert holder["command"] == "moe-train train job.yaml"
    assert abs(holder["started"] - time.time()) < 3600

    # The heartbeat: an old modification time is refreshed by the holder's thread.
    os.utime(path, (0, 0))
    _wait_until(lambda: path.stat().st_mtime > 0, "the heartbeat refreshed the lock")

    content = path.read_bytes()
    with pytest.raises(RunDirBusy) as refused:
        take_run_lock(tmp_path, launch="other")
    message = str(refused.value)
    assert "\n" not in message and RunDirBusy.exit_code == 2
    assert f"train.run_dir={tmp_path} is in use by another launch" in message
    assert f"host {socket.gethostname()}, pid {os.getpid()}, started " in message
    assert "command `moe-train train job.yaml`" in message
    assert re.search(rf"heartbeat is \d+ s old, .* more than {STALE_AFTER_S:g} s", message)
    assert not take_run_lock(tmp_path, launch="other", busy_is_error=False)
    assert path.read_bytes() == content

    release_held_locks()
    assert not path.exists()


def test_a_stale_lock_is_taken_over_and_a_fresh_one_is_not(tmp_path, capsys):
    fresh = _plant_lock(tmp_path / "fresh", age_s=STALE_AFTER_S / 3)
    with pytest.raises(RunDirBusy, match=r"host node-17, pid \d+, .*heartbeat is \d+ s old"):
        take_run_lock(tmp_path / "fresh", launch="")
    assert (tmp_path / "fresh" / LOCK_NAME).read_bytes() == fresh

    _plant_lock(tmp_path / "stale", age_s=STALE_AFTER_S + 30)
    assert take_run_lock(tmp_path / "stale", launch="")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"took over the stale lock of {tmp_path / 'stale'} from host ")
    assert re.search(r"host node-17, pid \d+, .*: its heartbeat is \d+ s old", lines[0])
    assert json.loads((tmp_path / "stale" / LOCK_NAME).read_bytes())["pid"] == os.getpid()
    assert [p.name for p in (tmp_path / "stale").iterdir()] == [LOCK_NAME]  # nothing set aside


def test_a_takeover_puts_back_a_lock_that_changed_hands_and_release_keeps_others(tmp_path):
    stale = _plant_lock(tmp_path, age_s=STALE_AFTER_S + 30)
    judged = run_lock._read_holder(tmp_path / LOCK_NAME)
    fresh = _plant_lock(tmp_path, age_s=0)  # another launch took it over in between
    assert judged is not None and judged.content == stale
    assert not run_lock._set_aside(tmp_path / LOCK_NAME, judged)
    assert (tmp_path / LOCK_NAME).read_bytes() == fresh
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]

    (tmp_path / LOCK_NAME).unlink()
    assert take_run_lock(tmp_path, launch="")
    (tmp_path / LOCK_NAME).write_bytes(fresh)  # taken over by another launch while held
    release_held_locks()
    assert (tmp_path / LOCK_NAME).read_bytes() == fresh


def test_two_fresh_launches_that_find_the_same_directory_free_use_two(tmp_path, monkeypatch):
    real, raced = run_lock.take_run_lock, []

    def rival_first(candidate, **kwargs):
        if not raced:  # another launch found the same free directory and locked it first
            raced.append(real(candidate, launch="rival"))
        return real(candidate, **kwargs)

    monkeypatch.setattr(run_dir, "take_run_lock", rival_first)
    assert choose_run_dir(str(tmp_path / "run"), reuse=False) == tmp_path / "run.1"
    assert raced == [True] and (tmp_path / "run.1" / LOCK_NAME).is_file()
    with pytest.raises(RunDirBusy):
        choose_run_dir(str(tmp_path / "run"), reuse=True)


def test_train_refuses_a_live_run_dir_writing_nothing_takes_over_a_stale_one_readers_never_lock(
    tmp_path, make_config, capsys
):
    config = make_config(tmp_path, train={"max_steps": 2}, checkpoint={"resume": "auto"})
    config_path = save_config(tmp_path / "job.yaml", config)
    run = tmp_path / "run"
    planted = _plant_lock(run, age_s=5)
    assert main(["train", str(config_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: train.run_dir={run} is in use"), err
    assert "host node-17" in err[0] and "command `moe-train train other.yaml`" in err[0]
    assert [p.name for p in run.iterdir()] == [LOCK_NAME]
    assert (run / LOCK_NAME).read_bytes() == planted

    os.utime(run / LOCK_NAME, (0, 0))  # its holder was killed long ago
    assert main(["train", str(config_path)]) == 0
    err = capsys.readouterr().err
    assert "took over the stale lock of" in err and "node-17" in err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert not (run / LOCK_NAME).exists()  # released at the end

    # Readers never lock: they read a run that is training.
    live = _plant_lock(run, age_s=0)
    assert main(["inspect", str(run / "checkpoints" / "step_00000002")]) == 0
    assert main(["plot", str(run), "--out", str(tmp_path / "plots")]) == 0
    assert (run / LOCK_NAME).read_bytes() == live


def test_the_launchers_loss_is_a_stop_request_only_when_watched(monkeypatch, capsys):
    stops = StopRequests()
    parent = os.getppid()
    assert (stops.requested, stops.code) == (False, 0)
    monkeypatch.setattr(os, "getppid", lambda: 1)  # the launcher died: init adopted us
    assert not stops.requested  # not watched: a process started by hand outlives its shell
    stops.watch_launcher()
    assert (stops.requested, stops.code, stops.launcher_gone) == (True, LAUNCHER_CODE, True)
    assert stops.describe(LAUNCHER_CODE) == LAUNCHER_GONE
    assert capsys.readouterr().err == (
        f"the launcher (pid {parent}) is gone: finishing this step, then saving and stopping\n"
    )
    other = StopRequests()
    assert other.describe(LAUNCHER_CODE) == f"{LAUNCHER_GONE} on another rank"
    assert other.describe(SIGNAL_CODE) == "a signal on another rank"


def test_only_torchrun_workers_watch_their_launcher(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not launched_by_torchrun()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert launched_by_torchrun()


def test_a_lock_of_this_host_whose_process_is_gone_is_taken_over_once_its_beat_stops(tmp_path):
    """A job killed here and relaunched at once: its fresh lock is taken over after
    DEAD_HOLDER_S without a heartbeat; a live process's lock on this host, or a dead one's
    on another host, is not."""
    here = socket.gethostname()
    _plant_lock(tmp_path / "killed", age_s=0.0, host=here)
    started = time.monotonic()
    assert take_run_lock(tmp_path / "killed", launch="mine")
    assert time.monotonic() - started >= run_lock.DEAD_HOLDER_S - 0.5
    assert json.loads((tmp_path / "killed" / LOCK_NAME).read_bytes())["launch"] == "mine"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        try:
            _plant_lock(tmp_path / "alive", age_s=10.0, host=here, pid=alive.pid)
            with pytest.raises(RunDirBusy, match="in use by another launch"):
                take_run_lock(tmp_path / "alive", launch="mine")
        finally:
            alive.kill()
    _plant_lock(tmp_path / "elsewhere", age_s=10.0)
    with pytest.raises(RunDirBusy, match="in use by another launch"):
        take_run_lock(tmp_path / "elsewhere", launch="mine")
