"""A save killed with SIGKILL at any point leaves the previous checkpoint as the latest one,
loadable, and nothing partial that a reader would pick."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_checkpoint import (
    CheckpointError,
    OwnedSlice,
    SliceRequest,
    latest_checkpoint,
    list_checkpoints,
    load_slices,
    prune_checkpoints,
    save_checkpoint,
)

# Phases of a save (see moe_checkpoint.save._phase_hook) and whether the save is asynchronous.
KILL_POINTS = [
    ("writing", False),  # after the first of several files got its data
    ("writing", True),  # the same, in the background thread of an asynchronous save
    ("written", False),  # all data down, before index and rename
    ("renamed", False),  # renamed to step_00000002, before the COMMITTED marker
]

CHILD = textwrap.dedent(
    """
    import sys, threading, time
    import torch
    import moe_checkpoint.save as save_module
    from moe_checkpoint import OwnedSlice, save_checkpoint

    root, stop_at, asynchronous = sys.argv[1], sys.argv[2], sys.argv[3] == "async"
    stopped = threading.Lock()  # files are written by several threads: announce once

    def stop(phase):
        if phase == stop_at and stopped.acquire(blocking=False):
            print(phase, flush=True)
        if phase == stop_at:
            time.sleep(600)

    save_module._phase_hook = stop
    tensors = {f"w{i}": torch.full((64, 64), float(i + 100)) for i in range(4)}
    slices = [OwnedSlice.whole(name, t) for name, t in tensors.items()]
    handle = save_checkpoint(root, 2, slices, lambda n: "model", {"step": 2},
                             asynchronous=asynchronous, max_file_bytes=20000)
    handle.wait()
    print("finished", flush=True)
    """
)


def _tensors(value_offset: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((64, 64), float(i + value_offset)) for i in range(4)}


def _save(root: Path, step: int, tensors: dict[str, torch.Tensor]) -> Path:
    slices = [OwnedSlice.whole(name, t) for name, t in tensors.items()]
    return save_checkpoint(
        root, step, slices, lambda n: "model", {"step": step}, max_file_bytes=20000
    ).wait()


def _assert_holds(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    loaded = load_slices(path, [SliceRequest.whole(n, t.shape) for n, t in tensors.items()])
    for (name, want), got in zip(tensors.items(), loaded, strict=True):
        assert torch.equal(got, want), f"{path.name} {name} differs"


def test_killed_saves_never_replace_the_last_committed_checkpoint(tmp_path):
    roots = {
        point: tmp_path / f"{point[0]}-{'async' if point[1] else 'sync'}" for point in KILL_POINTS
    }
    for root in roots.values():
        _save(root, 1, _tensors(0))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children = {
        point: subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root), point[0], "async" if point[1] else "sync"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for point, root in roots.items()
    }
    try:
        for point, child in children.items():
            line = child.stdout.readline().strip()
            assert line == point[0], f"{point}: child said {line!r}"
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
            child.stdout.close()

    for point, root in roots.items():
        first = root / "step_00000001"
        assert latest_checkpoint(root) == first, point
        assert list_checkpoints(root) == [first], point
        _assert_holds(first, _tensors(0))
        leftovers = sorted(p.name for p in root.iterdir() if p != first)
        assert len(leftovers) == 1, (point, leftovers)
        if point[0] == "renamed":
            assert leftovers == ["step_00000002"]
            with pytest.raises(CheckpointError, match="not committed"):
                load_slices(root / "step_00000002", [SliceRequest.whole("w0", (64, 64))])
        else:
            assert leftovers[0].startswith(".tmp-step_00000002-"), (point, leftovers)
        # Live saves may be that new, so pruning keeps the leftover...
        assert prune_checkpoints(root, keep_last=1) == []
        # ...until a later save commits: then the retried step 2 replaces or outdates it.
        second = _save(root, 2, _tensors(100))
        assert latest_checkpoint(root) == second
        _assert_holds(second, _tensors(100))
        prune_checkpoints(root, keep_last=1)
        assert sorted(p.name for p in root.iterdir()) == ["step_00000002"], point
