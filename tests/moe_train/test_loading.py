"""Loading: each rank reads only the sequences it trains on, one step ahead in a thread that
changes nothing and stops cleanly after an error or a stop signal."""

import os
import signal
import threading

import numpy as np
import pytest

from harness.ranks import run_distributed
from moe_data import MixedDataset, MixtureSource, TokenDataset
from moe_plan.config import config_from_dict
from moe_train.errors import DataError
from moe_train.train import read_metrics, train
from moe_train.train.data_feed import BatchFeed
from training import assert_losses_match, small_config_data

STEPS = 4


@pytest.fixture
def two_sources(tmp_path):
    rng = np.random.default_rng(3)
    paths = []
    for index, size in enumerate((6000, 2500)):
        paths.append(tmp_path / f"source{index}.npy")
        np.save(paths[-1], rng.integers(0, 200, size).astype(np.uint16))
    return paths


def _mixture_config(tmp_path, paths, run, **sections):
    data = small_config_data(tmp_path / run, paths[0], **sections)
    data["data"].pop("paths")
    data["data"]["mixture"] = [
        {"paths": [str(paths[0])], "weight": 0.6},
        {"paths": [str(paths[1])], "weight": 0.4},
    ]
    data["data"]["micro_batch_size"] = 2
    data["train"]["max_steps"] = STEPS
    return data


def _data_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("moe-train-data")]


def _record_reads(reads: list[tuple[int, int]]):
    """Patch TokenDataset.sequence to note (stream, window) of every sequence read."""
    original = TokenDataset.sequence

    def sequence(self, index):
        reads.append((self._stream[0] if self._stream else 0, int(index)))
        return original(self, index)

    TokenDataset.sequence = sequence


def _train_and_record(rank: int, world_size: int, data: dict):
    reads: list[tuple[int, int]] = []
    _record_reads(reads)
    losses = train(config_from_dict(data)).losses
    return losses, sorted(reads), _data_threads()


def _expected_reads(dataset: MixedDataset, rows: tuple[int, int], seed: int, global_batch: int):
    """The (stream, window) pairs of `rows` of every step, from the whole batches' order."""
    from moe_data.mixture import positions_in_order

    expected = []
    for step in range(STEPS):
        first = step * global_batch
        owners, ks = positions_in_order(first, first + global_batch, dataset.weights)
        for owner, k in zip(owners[rows[0] : rows[1]], ks[rows[0] : rows[1]], strict=True):
            part = dataset.parts[owner]
            expected.append((owner + 1, int(part.windows_at(np.array([k]), seed)[0])))
    return sorted(expected)


@pytest.mark.slow
def test_each_rank_reads_only_its_rows_and_trains_as_one_process(tmp_path, two_sources):
    single = _mixture_config(tmp_path, two_sources, "single")
    reference = train(config_from_dict(single)).losses
    no_prefetch = _mixture_config(tmp_path, two_sources, "sync", data={"prefetch": False})
    assert train(config_from_dict(no_prefetch)).losses == reference
    rows = read_metrics(tmp_path / "single" / "metrics.jsonl")
    assert all(row["data_wait_s"] >= 0 for row in rows)

    data = _mixture_config(tmp_path, two_sources, "dp2")
    results = run_distributed(_train_and_record, world_size=2, args=(data,))
    config = config_from_dict(data)
    dataset = MixedDataset(
        [MixtureSource(s.label, s.paths, s.weight) for s in config.data.mixture], 32
    )
    half = config.data.global_batch_size // 2
    for rank, (losses, reads, threads) in enumerate(results):
        assert_losses_match("dp2", losses, reference)
        expected = _expected_reads(dataset, (rank * half, (rank + 1) * half), 0, 2 * half)
        assert reads == expected, f"rank {rank} read other rows"
        assert not threads, f"rank {rank} left {threads} running"


def test_the_read_ahead_thread_stops_after_a_read_error(tmp_path, make_config, monkeypatch):
    original = TokenDataset.sequence
    calls = []

    def failing(self, index):
        calls.append(threading.current_thread().name)
        if len(calls) > 3 * 8:  # step 3's batch, read ahead in the thread
            raise DataError("tokens.npy: unreadable (planted)")
        return original(self, index)

    monkeypatch.setattr(TokenDataset, "sequence", failing)
    with pytest.raises(DataError, match="planted"):
        train(make_config(tmp_path, train={"max_steps": 6}))
    assert any(name.startswith("moe-train-data") for name in calls)
    assert not _data_threads()
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 3


@pytest.mark.slow
def test_the_read_ahead_thread_stops_after_a_stop_signal(tmp_path, make_config, monkeypatch):
    original = TokenDataset.sequence
    calls = []

    def signalling(self, index):
        calls.append(index)
        if len(calls) == 2 * 8 + 1:  # while step 1 trains, reading step 2 ahead
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, index)

    monkeypatch.setattr(TokenDataset, "sequence", signalling)
    stopped = train(make_config(tmp_path / "a", train={"max_steps": 6}))
    assert stopped.stopped_by == "SIGTERM" and stopped.end_step in (2, 3)
    assert not _data_threads()
    monkeypatch.setattr(TokenDataset, "sequence", original)
    whole = train(make_config(tmp_path / "b", train={"max_steps": 6})).losses
    config = make_config(tmp_path / "a", train={"max_steps": 6})
    config.checkpoint.resume = "auto"
    assert train(config).losses == whole[stopped.end_step :]


def test_a_feed_reads_the_asked_step_whatever_came_before(token_file):
    dataset = TokenDataset([token_file], 32)
    feed = BatchFeed(dataset, (2, 6), 8, seed=5, end_step=10, prefetch=True, pin_memory=False)
    try:
        for step in (0, 1, 2, 7, 3, 3, 9):
            assert feed.get(step).equal(dataset.batch(step, 8, 5)[2:6])
    finally:
        feed.close()
        feed.close()
    assert not _data_threads()
