"""Tests of prepare-data's workers, progress bar and resume, through the command line: the
same shards whatever the worker count, and an interrupted run (SIGINT, SIGTERM, SIGKILL) that
a rerun completes to the uninterrupted result."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from corpora import (
    EOS,
    assert_streams_equal,
    directory_bytes,
    jsonl_bytes,
    random_documents,
    read_stream,
    write_corpus,
)
from launch import CLI, run_cli
from moe_data import prepare_data
from moe_train.errors import DataError
from tokenizer_files import bpe_tokenizer_file


@pytest.mark.slow
def test_one_and_four_workers_write_the_same_shards(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    corpus = write_corpus(tmp_path / "corpus", random.Random(7), scale=2)
    tokenizer_file = bpe_tokenizer_file(tmp_path, corpus[-2][1][0])
    reference = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    eos = reference.token_to_id("<|endoftext|>")

    result = run_cli("prepare-data", str(tmp_path / "corpus"), "--out", str(tmp_path / "out4"),
                     "--workers", "4", "--tokenizer", str(tokenizer_file), "--shard-size", "64K")  # fmt: skip
    prepare_data(
        [tmp_path / "corpus"], tmp_path / "out1", str(tokenizer_file), workers=1, shard_size="64K"
    )

    assert result.returncode == 0, result.stderr
    assert "with 4 workers" in result.stderr
    assert "100% [" in result.stderr and "MB/s" in result.stderr  # the bar's last line
    four, one = directory_bytes(tmp_path / "out4"), directory_bytes(tmp_path / "out1")
    assert four == one
    assert len(four) - 1 > 4  # more shards than workers: they finish out of order
    expected = [
        t
        for _, documents in corpus
        for ids in reference.encode_batch(documents, add_special_tokens=False)
        for t in [*ids.ids, eos]
    ]
    assert_streams_equal(read_stream(tmp_path / "out4"), np.array(expected))


def child_pids(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_interrupted_preparation_resumes_to_the_same_result(tmp_path):
    """Stopped by SIGINT, then SIGTERM, then SIGKILL, each rerun keeps the finished shards, and
    the last one completes to what an uninterrupted run writes."""
    rng = random.Random(8)
    (tmp_path / "corpus").mkdir()
    for name in ("a", "b", "c"):
        documents = random_documents(rng, 6000)
        (tmp_path / "corpus" / f"{name}.jsonl").write_bytes(jsonl_bytes(documents))
    tokenizer_file = bpe_tokenizer_file(tmp_path, "".join(random_documents(rng, 200)))
    reference = tmp_path / "reference"
    started = time.monotonic()
    prepare_data([tmp_path / "corpus"], reference, str(tokenizer_file), shard_size="64K")
    # Orphaned workers would go on with every queued shard: about half of this run's work, on
    # two processes. Killed workers are gone long before, even on a loaded machine.
    orphan_wait_s = 0.2 * (time.monotonic() - started)
    shards = len(json.loads((reference / "meta.json").read_text())["shards"])
    assert shards > 40
    out, partial = tmp_path / "out", tmp_path / ".out.partial"
    args = ["prepare-data", str(tmp_path / "corpus"), "--tokenizer", str(tokenizer_file),
            "--shard-size", "64K", "--out", str(out), "--workers", "2"]  # fmt: skip
    command = [sys.executable, *CLI, *args]

    kept: dict[str, tuple[int, int]] = {}  # shard file: (inode, mtime) when first seen finished
    for stop_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while len(list(partial.glob("tokens-*.json"))) < len(kept) + 3:
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        workers = child_pids(process.pid)
        process.send_signal(stop_signal)
        process.wait(timeout=60)  # not communicate: orphaned workers would hold stderr open
        if stop_signal == signal.SIGKILL:
            deadline = time.monotonic() + orphan_wait_s
            while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
                time.sleep(0.01)
            survivors = [pid for pid in workers if alive(pid)]
            assert survivors == [], f"workers {survivors} outlived the killed prepare-data"
            assert process.returncode == -signal.SIGKILL
        stderr = process.stderr.read()
        if kept:
            assert f"{len(kept)} shards finished earlier are kept" in stderr
        if stop_signal != signal.SIGKILL:
            assert process.returncode == 75, stderr
            (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
            assert f"stopped by {stop_signal.name}: " in line and "shards are done" in line
            assert "Traceback" not in stderr
        assert not out.exists()
        finished = [p.with_suffix(".bin").name for p in partial.glob("tokens-*.json")]
        assert len(kept) + 3 <= len(finished) < shards, f"{stop_signal.name}: {len(finished)}"
        for name in finished:
            stat = (partial / name).stat()
            assert kept.setdefault(name, (stat.st_ino, stat.st_mtime_ns)) == (
                stat.st_ino, stat.st_mtime_ns
            ), f"{name} was written again"  # fmt: skip

    rerun = run_cli(*args)

    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(kept)} shards finished earlier are kept" in rerun.stderr
    assert directory_bytes(out) == directory_bytes(reference)
    for name, (inode, mtime) in kept.items():
        assert ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns) == (inode, mtime)
    assert not partial.exists()


@pytest.mark.slow
def test_progress_bar_on_a_terminal(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(random_documents(random.Random(9), 3000)))
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, *CLI, "prepare-data", str(tmp_path / "a.jsonl"),
             "--out", str(tmp_path / "out"), "--workers", "1"],
            stderr=terminal, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(terminal)
        output = b""
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the terminal closed: the process ended
                break
            if not chunk:
                break
            output += chunk
        assert process.wait(timeout=60) == 0
    finally:
        os.close(controller)
    text = output.decode()
    last = text.rstrip("\r\n").split("\r")[-1].replace("\x1b[K", "")
    size_mb = (tmp_path / "a.jsonl").stat().st_size / 1e6
    assert last.startswith("100% [########################]"), repr(last)
    assert f"{size_mb:,.1f}/{size_mb:,.1f} MB" in last
    assert " MB/s  ETA 0:00  shards 1/1" in last
    assert "\x1b[K" in text  # redrawn in place


def test_a_second_preparation_of_the_same_output_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    partial = tmp_path / ".out.partial"
    partial.mkdir()
    with open(partial / "prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(DataError, match=r"another prepare-data is writing .*\.out\.partial"):
            prepare_data([tmp_path / "a.txt"], tmp_path / "out")
    prepare_data([tmp_path / "a.txt"], tmp_path / "out")
    assert_streams_equal(read_stream(tmp_path / "out"), np.array([*b"text", EOS]))
