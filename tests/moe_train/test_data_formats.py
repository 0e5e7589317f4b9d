"""Tests of the token files training reads: headerless memmaps (`path:dtype`), sharded and
single-file prepared directories, and their errors."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_data import TokenDataset, prepare_data
from moe_plan.config import load_config
from moe_train.cli import main
from moe_train.errors import ConfigError, DataError
from training import CONFIGS


def counting_ids(count: int, vocab: int = 257, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=count)


def all_windows(dataset: TokenDataset) -> np.ndarray:
    return np.stack([dataset.sequence(i) for i in range(dataset.num_sequences)])


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "int64"])
def test_headerless_file_reads_like_the_same_npy(tmp_path, dtype):
    ids = counting_ids(5000, vocab=60000)
    raw = tmp_path / "tokens.npy"
    ids.astype(np.dtype(dtype).newbyteorder("<")).tofile(raw)  # raw little-endian, no header
    np.save(tmp_path / "with_header.npy", ids)

    headerless = TokenDataset([f"{raw}:{dtype}"], seq_len=64)
    reference = TokenDataset([tmp_path / "with_header.npy"], seq_len=64)

    assert (headerless.num_tokens, headerless.num_sequences) == (5000, reference.num_sequences)
    assert headerless.vocab_size == int(ids.max()) + 1 == reference.vocab_size
    np.testing.assert_array_equal(all_windows(headerless), all_windows(reference))
    np.testing.assert_array_equal(
        headerless.batch(3, 8, seed=1).numpy(), reference.batch(3, 8, seed=1).numpy()
    )


def test_headerless_and_npy_errors_are_one_line(tmp_path):
    raw = tmp_path / "raw.bin"
    np.arange(10, dtype="<u4").tofile(raw)
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    np.save(tmp_path / "real.npy", np.arange(10))
    np.array([1, -5], dtype="<i8").tofile(tmp_path / "negative.bin")
    cases = [
        (f"{raw}:float32", r"raw\.bin:float32: unknown dtype suffix 'float32'; a headerless token file is named with one of :uint16, :uint32, :int32, :int64"),
        (f"{tmp_path / 'odd.bin'}:uint32", r"odd\.bin holds 7 bytes, not a multiple of 4 \(uint32\); check the dtype suffix"),
        (f"{tmp_path / 'real.npy'}:int64", r"real\.npy is a \.npy file with a header; name it without the :int64 suffix"),
        (f"{tmp_path / 'missing.bin'}:uint16", r"missing\.bin:uint16: .*missing\.bin not found"),
        (f"{tmp_path}:uint16", r"is not a file; a dtype suffix names a headerless token file"),
        (f"{tmp_path / 'negative.bin'}:int64", r"negative\.bin:int64 holds negative token ids \(-5\)"),
        (str(raw.rename(tmp_path / "raw.npy")), r"raw\.npy is not a readable \.npy file .*name it with its dtype, e\.g\. .*raw\.npy:uint32"),
    ]  # fmt: skip
    for entry, message in cases:
        with pytest.raises(DataError, match=message) as info:
            TokenDataset([entry], seq_len=4)
        assert "\n" not in str(info.value)


def test_config_refuses_an_unknown_dtype_suffix():
    with pytest.raises(
        ConfigError, match=r"data\.paths\[1\]='x\.npy:uint8': unknown dtype suffix 'uint8'"
    ):
        load_config(None, ["--data.paths=[builtin:stdlib,x.npy:uint8]"])
    config = load_config(None, ["--data.paths=[x.npy:uint32,builtin:stdlib,dir/with:colon/y]"])
    assert config.data.paths == ["x.npy:uint32", "builtin:stdlib", "dir/with:colon/y"]


def test_single_file_directories_of_earlier_releases_still_read(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 500)
    meta = prepare_data([tmp_path / "a.txt"], tmp_path / "v2", shard_size="64K")
    tokens = np.concatenate(
        [np.fromfile(tmp_path / "v2" / s["file"], dtype="<u2") for s in meta["shards"]]
    )
    v1 = tmp_path / "v1"
    v1.mkdir()
    tokens.tofile(v1 / "tokens.bin")
    v1_meta = {key: meta[key] for key in ("dtype", "num_tokens", "vocab_size", "eos_id")}
    (v1 / "meta.json").write_text(json.dumps({"format": "moe-stack-tokens-v1", **v1_meta}))

    old, new = TokenDataset([v1], seq_len=32), TokenDataset([tmp_path / "v2"], seq_len=32)
    assert (old.num_tokens, old.eos_id, old.vocab_size) == (new.num_tokens, 256, 257)
    np.testing.assert_array_equal(all_windows(old), all_windows(new))


def test_unfinished_preparation_is_named(tmp_path):
    (tmp_path / ".data.partial").mkdir()
    with pytest.raises(
        DataError,
        match=r"data not found: its preparation has not finished .*run the same prepare-data command again",
    ):
        TokenDataset([tmp_path / "data"], seq_len=4)


def test_missing_shard_is_an_error(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a document"}\n' * 10000)
    meta = prepare_data([tmp_path / "a.jsonl"], tmp_path / "data", shard_size="64K")
    assert len(meta["shards"]) >= 2
    (tmp_path / "data" / meta["shards"][1]["file"]).unlink()
    with pytest.raises(
        DataError, match=r"tokens-000001\.bin is missing but meta\.json says num_tokens="
    ):
        TokenDataset([tmp_path / "data"], seq_len=4)


def train_losses(tmp_path: Path, name: str, data_path: str) -> list[float]:
    run_dir = tmp_path / name
    code = main(
        [
            "train",
            str(CONFIGS / "tiny.yaml"),
            f"--data.paths=[{data_path}]",
            "--data.seq_len=64",
            "--data.global_batch_size=4",
            "--data.micro_batch_size=2",
            "--model.n_layers=1",
            "--model.d_model=64",
            "--precision.compute_dtype=float32",
            "--train.max_steps=3",
            "--eval.interval=0",
            "--eval.tasks=[]",  # tiny.yaml's task needs a known tokenizer (not a .npy's)
            "--train.progress=false",
            "--train.peak_flops=1e11",
            "--train.log_interval=1",
            f"--train.run_dir={run_dir}",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows]


@pytest.mark.slow
def test_training_on_a_headerless_file_equals_training_on_prepared_data(tmp_path):
    functions = [f"def f{i}(x):\n    return x * {i}\n" for i in range(5000)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f}) + "\n" for f in functions))
    meta = prepare_data([tmp_path / "a.jsonl"], tmp_path / "prepared", shard_size="64K")
    assert len(meta["shards"]) >= 2
    tokens = np.concatenate(
        [np.fromfile(tmp_path / "prepared" / s["file"], dtype="<u2") for s in meta["shards"]]
    )
    tokens.astype("<u4").tofile(tmp_path / "olmo.npy")

    prepared = train_losses(tmp_path, "prepared-run", str(tmp_path / "prepared"))
    headerless = train_losses(tmp_path, "headerless-run", f"{tmp_path / 'olmo.npy'}:uint32")

    assert len(prepared) == 3
    assert headerless == prepared


@pytest.mark.slow
def test_many_shards_stay_within_the_open_file_limit(tmp_path):
    """Reading a directory of 200 shards with a limit of 100 open files: shards are mapped a
    few at a time (each mapping holds a file descriptor)."""
    line = json.dumps({"text": "a document of some words " * 10}) + "\n"
    with open(tmp_path / "a.jsonl", "w") as f:
        for _ in range(201):
            f.write(line * ((64 << 10) // len(line) + 1))
    meta = prepare_data([tmp_path / "a.jsonl"], tmp_path / "data", shard_size="64K")
    assert len(meta["shards"]) > 200
    stream = np.concatenate(
        [np.fromfile(tmp_path / "data" / s["file"], dtype="<u2") for s in meta["shards"]]
    )
    script = (
        "import hashlib, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from moe_data import TokenDataset\n"
        "dataset = TokenDataset([sys.argv[1]], seq_len=500)\n"
        "digest = hashlib.sha256()\n"
        "for index in range(dataset.num_sequences):\n"
        "    digest.update(dataset.sequence(index).tobytes())\n"
        "print(dataset.num_sequences, digest.hexdigest())\n"
    )  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "data")],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    count = (stream.size - 1) // 500
    expected = hashlib.sha256()
    for index in range(count):
        expected.update(stream[index * 500 : index * 500 + 501].astype(np.int64).tobytes())
    assert result.stdout.split() == [str(count), expected.hexdigest()]
