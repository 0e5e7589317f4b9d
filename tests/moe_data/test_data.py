"""Tests of the data layer: tokenizers, prepare_data, the built-in dataset and TokenDataset."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import moe_data.builtin as builtin_module
from moe_data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    TokenDataset,
    builtin_dataset_dir,
    load_tokenizer,
    prepare_data,
)
from moe_data.file_modes import current_umask

EOS = ByteTokenizer.eos_id


def read_tokens(out_dir: Path) -> np.ndarray:
    """The token stream of a prepared directory: its shards, in meta.json's order, joined."""
    meta = json.loads((out_dir / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    shards = [np.fromfile(out_dir / shard["file"], dtype=dtype) for shard in meta["shards"]]
    return np.concatenate(shards) if shards else np.empty(0, dtype)


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def leftovers(parent: Path) -> list[str]:
    """Temporary or unfinished directories a failed or finished preparation left behind."""
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".partial" in p.name)


def save_npy(path: Path, ids: list[int] | np.ndarray, dtype: str = "int64") -> Path:
    np.save(path, np.asarray(ids, dtype=dtype))
    return path


# ---------------------------------------------------------------------------------------------
# Tokenizers


def test_byte_tokenizer_round_trips_unicode_and_skips_eos():
    tokenizer = ByteTokenizer()
    text = "plain ascii, é, 漢字, emoji 🙂\n\ttabs"
    ids = tokenizer.encode(text)
    assert ids.dtype == np.uint8
    assert ids.tolist() == byte_ids(text)
    assert tokenizer.decode(ids) == text
    with_eos = np.concatenate([ids.astype(np.int64), [EOS], ids.astype(np.int64), [EOS]])
    assert tokenizer.decode(with_eos) == text + text
    assert tokenizer.decode([0xC3]) == "\ufffd"  # a truncated UTF-8 sequence is replaced


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match=r"nope\.json.*'byte'"):
        load_tokenizer(str(tmp_path / "nope.json"))


# ---------------------------------------------------------------------------------------------
# prepare_data


def test_prepare_text_jsonl_and_npy_places_eos_after_each_document(tmp_path):
    text_file = tmp_path / "a.txt"
    text_file.write_text("héllo\n", encoding="utf-8")
    jsonl_file = tmp_path / "b.jsonl"
    jsonl_file.write_text('{"text": "x y"}\n\n{"text": "", "id": 7}\n{"text": "z"}\n')
    npy_file = save_npy(tmp_path / "c.npy", [1, 2, 200])
    out_dir = tmp_path / "out"

    meta = prepare_data([text_file, jsonl_file, npy_file], out_dir)

    expected = [
        *byte_ids("héllo\n"), EOS,
        *byte_ids("x y"), EOS,
        EOS,
        *byte_ids("z"), EOS,
        1, 2, 200,
    ]  # fmt: skip
    tokens = read_tokens(out_dir)
    assert tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, expected)
    assert meta == json.loads((out_dir / "meta.json").read_text())
    assert meta["format"] == "moe-stack-tokens-v2"
    assert meta["dtype"] == "uint16"
    assert meta["num_tokens"] == len(expected)
    assert meta["vocab_size"] == 257
    assert meta["eos_id"] == EOS
    assert meta["tokenizer"] == "byte"
    assert meta["num_documents"] == 4
    assert [(s["path"], s["kind"], s["num_tokens"]) for s in meta["sources"]] == [
        (str(text_file), "text", 8),
        (str(jsonl_file), "jsonl", 7),
        (str(npy_file), "npy", 3),
    ]
    assert ByteTokenizer().decode(tokens[:8]) == "héllo\n"
    assert leftovers(tmp_path) == []


def test_prepare_uses_uint32_when_npy_ids_exceed_uint16(tmp_path):
    text_file = tmp_path / "a.md"
    text_file.write_text("# hi")
    npy_file = save_npy(tmp_path / "big.npy", [5, 70000, 65536], dtype="uint32")

    meta = prepare_data([npy_file, text_file], tmp_path / "out")

    assert meta["dtype"] == "uint32"
    assert meta["vocab_size"] == 70001
    tokens = read_tokens(tmp_path / "out")
    assert tokens.dtype == np.uint32
    np.testing.assert_array_equal(tokens, [5, 70000, 65536, *byte_ids("# hi"), EOS])
    assert (tmp_path / "out" / "tokens-000000.bin").stat().st_size == 4 * tokens.size


def test_prepare_recurses_into_directories_in_sorted_order(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "b").mkdir(parents=True)
    (corpus / "b" / "2.py").write_text("B2")
    (corpus / "a.txt").write_text("A")
    (corpus / "b" / "1.txt").write_text("B1")
    (corpus / ".hidden").write_text("skipped")

    meta = prepare_data([corpus], tmp_path / "out")

    expected = [*byte_ids("A"), EOS, *byte_ids("B1"), EOS, *byte_ids("B2"), EOS]
    np.testing.assert_array_equal(read_tokens(tmp_path / "out"), expected)
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.txt", "1.txt", "2.py"]


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ('{"text": "ok"', "invalid JSON"),
        ('{"body": "no text"}', '"text" string'),
        ("[1]", '"text"'),
    ],
)
def test_prepare_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, reason):
    jsonl_file = tmp_path / "data.jsonl"
    jsonl_file.write_text('{"text": "fine"}\n' + bad_line + "\n")
    out_dir = tmp_path / "out"

    with pytest.raises(DataError, match=rf"data\.jsonl:2: .*{reason}") as info:
        prepare_data([jsonl_file], out_dir)

    assert "\n" not in str(info.value)
    assert not out_dir.exists()
    assert leftovers(tmp_path) == []


def test_prepare_missing_input_names_it(tmp_path):
    present = tmp_path / "present.txt"
    present.write_text("x")
    with pytest.raises(DataError, match=r"missing\.txt not found"):
        prepare_data([present, tmp_path / "missing.txt"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_prepare_non_utf8_text_names_file(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt is not UTF-8 text"):
        prepare_data([bad], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_prepare_refuses_existing_out_dir_and_leaves_it_intact(tmp_path):
    source = tmp_path / "a.txt"
    source.write_text("new data")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "precious.txt").write_text("keep me")

    with pytest.raises(DataError, match=r"out already exists; choose another --out or delete it"):
        prepare_data([source], out_dir)

    assert sorted(p.name for p in out_dir.iterdir()) == ["precious.txt"]
    assert (out_dir / "precious.txt").read_text() == "keep me"
    assert leftovers(tmp_path) == []

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    prepare_data([source], empty_dir)  # an empty directory is fine
    np.testing.assert_array_equal(read_tokens(empty_dir), [*byte_ids("new data"), EOS])


# ---------------------------------------------------------------------------------------------
# TokenDataset


@pytest.fixture
def counting_sources(tmp_path):
    """Two .npy sources whose ids count up, so a window's position is visible in its values."""
    first = save_npy(tmp_path / "first.npy", np.arange(1000))
    second = save_npy(tmp_path / "second.npy", np.arange(5000, 5100))
    return [first, second]


def test_windows_stride_by_seq_len_and_targets_continue_inputs(counting_sources):
    seq_len = 16
    dataset = TokenDataset(counting_sources, seq_len)
    assert dataset.num_sequences == (1000 - 1) // seq_len + (100 - 1) // seq_len
    assert dataset.vocab_size == 5100
    assert dataset.eos_id is None

    batch = dataset.batch(step=0, global_batch_size=dataset.num_sequences, seed=3).numpy()
    assert batch.shape == (dataset.num_sequences, seq_len + 1)
    # Targets continue the inputs in the source: every row counts up by one, never crossing
    # from one source into the other, and starts at a multiple of seq_len in its source.
    np.testing.assert_array_equal(batch[:, 1:], batch[:, :-1] + 1)
    starts = np.where(batch[:, 0] >= 5000, batch[:, 0] - 5000, batch[:, 0])
    assert (starts % seq_len == 0).all()
    assert (batch[:, -1] < 1000).sum() == (1000 - 1) // seq_len


def test_batches_depend_only_on_seed_and_step(counting_sources):
    dataset = TokenDataset(counting_sources, 8)
    other = TokenDataset(counting_sources, 8)
    step_5 = dataset.batch(step=5, global_batch_size=6, seed=11)
    dataset.batch(step=100, global_batch_size=6, seed=11)  # reading others must not matter

    assert step_5.dtype == torch.int64
    assert (other.batch(step=5, global_batch_size=6, seed=11) == step_5).all()
    assert (dataset.batch(step=5, global_batch_size=6, seed=11) == step_5).all()
    assert not (dataset.batch(step=6, global_batch_size=6, seed=11) == step_5).all()
    assert not (dataset.batch(step=5, global_batch_size=6, seed=12) == step_5).all()


def test_every_sequence_appears_once_per_epoch_and_epochs_reshuffle(counting_sources):
    dataset = TokenDataset(counting_sources, 8)
    count = dataset.num_sequences
    batch_size = 7  # does not divide count, so batches straddle epoch boundaries
    steps = -(-3 * count // batch_size)
    indices = np.concatenate(
        [dataset.sequence_indices(step, batch_size, seed=0) for step in range(steps)]
    )
    epochs = [indices[e * count : (e + 1) * count] for e in range(3)]
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(count))
    assert not np.array_equal(epochs[0], epochs[1])

    step = count // batch_size  # a batch that crosses from epoch 0 into epoch 1
    batch = dataset.batch(step, batch_size, seed=0).numpy()
    expected = np.stack([dataset.sequence(int(i)) for i in indices[step * batch_size :][:7]])
    np.testing.assert_array_equal(batch, expected)
    assert dataset.state(step + 1, batch_size) == {
        "samples_consumed": (step + 1) * batch_size,
        "epoch": 1,
        "sample_in_epoch": (step + 1) * batch_size - count,
        "num_sequences": count,
        "seq_len": 8,
    }


def test_global_batch_larger_than_the_dataset_wraps_epochs(tmp_path):
    dataset = TokenDataset([save_npy(tmp_path / "tiny.npy", np.arange(41))], 4)
    assert dataset.num_sequences == 10
    indices = dataset.sequence_indices(step=1, global_batch_size=25, seed=1)  # positions 25..49
    np.testing.assert_array_equal(np.sort(indices[5:15]), np.arange(10))  # all of epoch 3
    np.testing.assert_array_equal(np.sort(indices[15:25]), np.arange(10))  # all of epoch 4
    assert dataset.batch(step=1, global_batch_size=25, seed=1).shape == (25, 5)


def test_dataset_reads_prepared_directories(tmp_path):
    text_file = tmp_path / "a.txt"
    text_file.write_text("0123456789" * 4)
    prepare_data([text_file], tmp_path / "prepared")
    dataset = TokenDataset([tmp_path / "prepared"], seq_len=10)
    assert (dataset.num_tokens, dataset.num_sequences) == (41, 4)
    assert (dataset.vocab_size, dataset.eos_id) == (257, EOS)
    rows = dataset.batch(0, 4, seed=0).numpy()
    texts = sorted(ByteTokenizer().decode(row) for row in rows)
    assert texts == ["0123456789"] + ["01234567890"] * 3  # the last window ends with eos


def test_too_little_data_is_an_error(tmp_path):
    short = save_npy(tmp_path / "short.npy", np.arange(20))
    with pytest.raises(DataError, match=r"hold 40 tokens.*fewer than data\.seq_len\+1 = 21"):
        TokenDataset([short, short], seq_len=20)
    assert TokenDataset([short], seq_len=19).num_sequences == 1


def test_corrupted_tokens_bin_size_is_an_error(tmp_path):
    text_file = tmp_path / "a.txt"
    text_file.write_text("some text to tokenize")
    out_dir = tmp_path / "prepared"
    prepare_data([text_file], out_dir)
    tokens_bin = out_dir / "tokens-000000.bin"
    tokens_bin.write_bytes(tokens_bin.read_bytes()[:-3])
    with pytest.raises(
        DataError, match=r"prepared/tokens-000000\.bin holds 41 bytes .*num_tokens=22"
    ):
        TokenDataset([out_dir], seq_len=4)


def test_bad_paths_and_metadata_are_errors(tmp_path):
    with pytest.raises(DataError, match=r"nowhere not found"):
        TokenDataset([tmp_path / "nowhere"], seq_len=4)
    with pytest.raises(DataError, match=r"unknown built-in dataset 'builtin:wiki'"):
        TokenDataset(["builtin:wiki"], seq_len=4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty has no meta\.json"):
        TokenDataset([tmp_path / "empty"], seq_len=4)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text('{"format": "moe-stack-tokens-v1", "dtype": "int8"}')
    with pytest.raises(DataError, match=r"broken/meta\.json has dtype='int8'"):
        TokenDataset([broken], seq_len=4)
    two_d = save_npy(tmp_path / "two_d.npy", np.zeros((2, 3)))
    with pytest.raises(DataError, match=r"two_d\.npy holds a 2-D"):
        TokenDataset([two_d], seq_len=4)


# ---------------------------------------------------------------------------------------------
# Built-in dataset


@pytest.fixture(scope="module")
def builtin_cache(tmp_path_factory):
    """A cache dir with builtin:stdlib prepared once for this module."""
    cache_dir = tmp_path_factory.mktemp("builtin-cache")
    builtin_dataset_dir(cache_dir)
    return cache_dir


def test_builtin_dataset_is_byte_tokenized_stdlib_and_reused(builtin_cache):
    prepared = builtin_dataset_dir(builtin_cache)
    assert prepared.parent == builtin_cache
    assert f"py{sys.version_info.major}.{sys.version_info.minor}" in prepared.name
    meta = json.loads((prepared / "meta.json").read_text())
    assert (meta["tokenizer"], meta["dtype"], meta["eos_id"]) == ("byte", "uint16", EOS)
    assert 1 << 20 < meta["num_tokens"] <= (16 << 20) + (1 << 20)
    paths = [Path(s["path"]) for s in meta["sources"]]
    assert paths == sorted(paths) and all(p.suffix == ".py" for p in paths)
    assert not any({"site-packages", "test", "tests", "idlelib"} & set(p.parts) for p in paths)

    mtimes = {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()}
    assert builtin_dataset_dir(builtin_cache) == prepared
    assert {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()} == mtimes
    assert [p.name for p in builtin_cache.iterdir()] == [prepared.name]
    assert stat.S_IMODE(prepared.stat().st_mode) == 0o777 & ~current_umask()  # as mkdir makes

    dataset = TokenDataset(["builtin:stdlib"], seq_len=256, cache_dir=builtin_cache)
    assert (dataset.vocab_size, dataset.num_tokens) == (257, meta["num_tokens"])
    text = "".join(ByteTokenizer().decode(row) for row in dataset.batch(0, 8, seed=0))
    assert "def " in text or "import " in text


def test_builtin_preparation_that_loses_the_rename_uses_the_winner(
    builtin_cache, tmp_path, monkeypatch
):
    winner = builtin_dataset_dir(builtin_cache)
    cache_dir = tmp_path / "cache"
    real_write = builtin_module.write_dataset

    def write_while_another_process_finishes_first(files, dest_dir, tokenizer):
        os.makedirs(cache_dir / winner.name)
        for path in winner.iterdir():
            os.link(path, cache_dir / winner.name / path.name)
        return real_write(files, dest_dir, tokenizer)

    monkeypatch.setattr(builtin_module, "write_dataset", write_while_another_process_finishes_first)
    assert builtin_dataset_dir(cache_dir) == cache_dir / winner.name
    assert [p.name for p in cache_dir.iterdir()] == [winner.name]


def test_concurrent_builtin_preparation_gives_one_valid_dir(tmp_path):
    cache_dir = tmp_path / "cache"
    start_at = time.time() + 1.0
    script = (
        "import sys, time\n"
        "from moe_data import builtin_dataset_dir\n"
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
        "print(builtin_dataset_dir(sys.argv[1]))\n"
    )
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(cache_dir), str(start_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [process.communicate(timeout=60) for process in processes]
    for process, (_, stderr) in zip(processes, results, strict=True):
        assert process.returncode == 0, stderr
    printed = {stdout.strip() for stdout, _ in results}
    assert len(printed) == 1
    prepared = Path(printed.pop())
    assert [p.name for p in cache_dir.iterdir()] == [prepared.name]
    names = sorted(p.name for p in prepared.iterdir())
    assert names[0] == "meta.json" and all(n.startswith("tokens-") for n in names[1:])
    assert TokenDataset([prepared], seq_len=1024).num_sequences > 1000


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizers (optional)


def write_word_level_tokenizer(path: Path, with_eos: bool = True) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "hello": 1, "world": 2, "moe": 3}
    if with_eos:
        vocab["</s>"] = 4
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    if with_eos:
        tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(path))
    return path


def test_prepare_with_a_tokenizer_json(tmp_path):
    tokenizer_file = write_word_level_tokenizer(tmp_path / "tokenizer.json")
    text_file = tmp_path / "a.txt"
    text_file.write_text("hello world")
    jsonl_file = tmp_path / "b.jsonl"
    jsonl_file.write_text('{"text": "moe moe unknown"}\n{"text": "world"}\n')

    meta = prepare_data([text_file, jsonl_file], tmp_path / "out", tokenizer=str(tokenizer_file))

    np.testing.assert_array_equal(read_tokens(tmp_path / "out"), [1, 2, 4, 3, 3, 0, 4, 2, 4])
    assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (5, 4, "uint16")
    assert meta["tokenizer"] == str(tokenizer_file)
    tokenizer = load_tokenizer(str(tokenizer_file))
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.decode([1, 2, 4]) == "hello world"


def test_tokenizer_json_without_eos_is_an_error(tmp_path):
    tokenizer_file = write_word_level_tokenizer(tmp_path / "tokenizer.json", with_eos=False)
    with pytest.raises(DataError, match=r"tokenizer\.json has no end-of-document token.*</s>"):
        HFTokenizer(tokenizer_file)
