"""Tests of prepare-data's inputs and output: every input format, the text field, text cut
into segments, shards read as one stream, and one-line errors (workers and resume are in
tests/moe_train/test_prepare_workers.py; the CLI's own errors in
tests/moe_train/test_prepare_data_cli.py; the corpora in tests/corpora.py).

Each expected token stream is built here from the documents themselves (their UTF-8 bytes, or
the `tokenizers` library's ids, then the end-of-document id), not by the code under test.
"""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from corpora import (
    EOS,
    WORDS,
    assert_streams_equal,
    byte_stream,
    directory_bytes,
    jsonl_bytes,
    optional,
    random_documents,
    read_stream,
    sha256_of,
    write_corpus,
    zstd_compress,
)
from moe_data import ByteTokenizer, DataError, TokenDataset, prepare_data
from tokenizer_files import bpe_tokenizer_file

# ---------------------------------------------------------------------------------------------
# Formats


def test_every_input_format_gives_its_documents_in_order(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", random.Random(1), scale=3)
    npy_ids = np.random.default_rng(2).integers(0, 257, size=5000)
    np.save(tmp_path / "corpus" / "h.npy", npy_ids)

    meta = prepare_data([tmp_path / "corpus"], tmp_path / "out", shard_size="64K")

    expected = np.concatenate([byte_stream(corpus), npy_ids])
    assert_streams_equal(read_stream(tmp_path / "out"), expected)
    assert len(meta["shards"]) > 5
    hf_files = sorted((tmp_path / "corpus" / "e_hf").glob("*.arrow"))
    assert len(hf_files) == 2
    paths = [p for p, _ in corpus[:4]] + hf_files + [p for p, _ in corpus[5:]]
    paths.append(tmp_path / "corpus" / "h.npy")
    assert [s["path"] for s in meta["sources"]] == [str(p) for p in paths]
    assert [s["sha256"] for s in meta["sources"]] == [sha256_of(p) for p in paths]
    documents = [len(d) for _, d in corpus[:4]] + [450, 450] + [len(d) for _, d in corpus[5:]]
    assert [s["num_documents"] for s in meta["sources"]] == [*documents, 0]
    tokens = [sum(len(d.encode()) + 1 for d in docs) for _, docs in corpus]
    tokens[4:5] = [sum(len(d.encode()) + 1 for d in corpus[4][1][:450]),
                   sum(len(d.encode()) + 1 for d in corpus[4][1][450:])]  # fmt: skip
    assert [s["num_tokens"] for s in meta["sources"]] == [*tokens, 5000]
    kinds = [(s["kind"], s["compression"]) for s in meta["sources"]]
    assert kinds == [("jsonl", None), ("jsonl", "gzip"), ("jsonl", "zstd"), ("parquet", None),
                     ("arrow", None), ("arrow", None), ("text", None), ("jsonl", "gzip"),
                     ("npy", None)]  # fmt: skip
    assert meta["num_tokens"] == expected.size == sum(s["num_tokens"] for s in meta["shards"])
    assert [s["sha256"] for s in meta["shards"]] == [
        sha256_of(tmp_path / "out" / s["file"]) for s in meta["shards"]
    ]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["meta.json", *(s["file"] for s in meta["shards"])]
    )
    assert not any(".partial" in p.name for p in tmp_path.iterdir())
    default = prepare_data([tmp_path / "corpus"], tmp_path / "default")  # other shards
    assert len(default["shards"]) < len(meta["shards"])
    assert_streams_equal(read_stream(tmp_path / "default"), expected)


@pytest.mark.parametrize("line_bytes", [64, 63, 1 << 17])
def test_jsonl_pieces_take_each_line_once(tmp_path, line_bytes):
    """64-byte lines put every piece boundary (64 KiB) at a line start, 63-byte ones inside a
    line; a line longer than a piece spans a boundary."""
    overhead = len(json.dumps({"text": ""})) + 1
    documents = [
        f"{i:06d}".ljust(line_bytes - overhead, "x") for i in range(4000 if line_bytes < 100 else 3)
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    assert (tmp_path / "a.jsonl").stat().st_size == line_bytes * len(documents)

    meta = prepare_data([tmp_path / "a.jsonl"], tmp_path / "out", shard_size="64K")

    assert len(meta["shards"]) >= 3
    assert_streams_equal(read_stream(tmp_path / "out"), byte_stream([(Path(), documents)]))


def test_text_field_chooses_the_field_or_column(tmp_path):
    pa, pq, datasets = optional("pyarrow", "pyarrow.parquet", "datasets")
    docs = random_documents(random.Random(3), 90)
    decoys = random_documents(random.Random(4), 90)
    lines = [json.dumps({"text": b, "body": a}) for a, b in zip(docs[:30], decoys, strict=False)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(
        pa.table({"text": decoys[30:60], "body": docs[30:60]}), tmp_path / "in" / "b.parquet"
    )
    datasets.Dataset.from_dict({"body": docs[60:], "text": decoys[60:]}).save_to_disk(
        str(tmp_path / "in" / "c")
    )

    prepare_data([tmp_path / "in"], tmp_path / "out", text_field="body")

    assert_streams_equal(read_stream(tmp_path / "out"), byte_stream([(Path(), docs)]))


def test_large_text_file_gives_the_ids_of_the_whole_text(tmp_path):
    """A text file read in segments (and split over shards) tokenizes as if read whole."""
    tokenizers = pytest.importorskip("tokenizers")
    rng = random.Random(5)

    def lines(count: int) -> str:
        return "\n".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 14)))
            + rng.choice(["", "", " ", "\t  "])
            for _ in range(count)
        )

    head = lines(24000)
    assert len(head.encode()) < 1 << 20
    # At the 1 MiB boundary a line ends in a space: not a cut that keeps the ids.
    head += "y" * ((1 << 20) - len(head.encode())) + " \n"
    text = head + lines(5000) + "\n\n\n"
    assert (1 << 20) + (1 << 17) < len(text.encode()) < 2 << 20  # two segments, one cut
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    # Trained where a space and a line break before a blank line form one pre-token.
    tokenizer_file = bpe_tokenizer_file(tmp_path, text[:100000] + "x \n\ny\t  \n\n" * 3000)
    reference = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    eos = reference.token_to_id("<|endoftext|>")

    meta = prepare_data(
        [tmp_path / "big.txt"], tmp_path / "out", str(tokenizer_file), shard_size="1M"
    )

    assert len(meta["shards"]) == 2
    expected = np.array([*reference.encode(text, add_special_tokens=False).ids, eos])
    assert_streams_equal(read_stream(tmp_path / "out"), expected)
    assert meta["num_documents"] == 1


def test_a_text_without_line_breaks_is_cut_the_same_whatever_the_shards(tmp_path):
    rng = random.Random(6)
    head = "".join(rng.choice("abé漢 ") for _ in range(600_000)).encode()
    head += b"x" * ((1 << 20) - len(head))  # a character starts at the 1 MiB boundary
    text = (head + "".join(rng.choice("abé漢 ") for _ in range(90_000)).encode()).decode()
    assert (1 << 20) + (1 << 17) < len(text.encode()) < 2 << 20  # no line break at all
    (tmp_path / "line.txt").write_text(text, encoding="utf-8")
    tokenizer_file = bpe_tokenizer_file(tmp_path, text[:50000])

    whole = prepare_data(
        [tmp_path / "line.txt"], tmp_path / "one", str(tokenizer_file), shard_size="4M"
    )
    split = prepare_data(
        [tmp_path / "line.txt"], tmp_path / "two", str(tokenizer_file), shard_size="1M"
    )

    assert (len(whole["shards"]), len(split["shards"])) == (1, 2)
    assert_streams_equal(read_stream(tmp_path / "two"), read_stream(tmp_path / "one"))
    prepare_data([tmp_path / "line.txt"], tmp_path / "bytes", shard_size="1M")
    assert ByteTokenizer().decode(read_stream(tmp_path / "bytes")) == text  # cut between chars


# ---------------------------------------------------------------------------------------------
# Errors


SOME_JSONL = jsonl_bytes(random_documents(random.Random(12), 200))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("x.jsonl.gz", b"plain text, not gzip", r"x\.jsonl\.gz is not a readable gzip file \(Not a gzipped"),
        ("x.jsonl.gz", gzip.compress(SOME_JSONL)[:4000], r"x\.jsonl\.gz is not a readable gzip file \(Compressed file ended"),
        ("x.jsonl.zst", b"not zstd data at all", r"x\.jsonl\.zst is not a readable zstd file \(.*Unknown frame"),
        ("x.jsonl.zst", lambda: zstd_compress(SOME_JSONL)[:4000], r"x\.jsonl\.zst is not a readable zstd file \(the file ends inside a zstd frame"),
        ("x.parquet", b"PAR1 garbage garbage", r"x\.parquet is not a readable parquet file"),
        ("x.txt", "café\n".encode("latin-1"), r"x\.txt is not UTF-8 text \(bad byte at offset 3\)"),
        ("x.txt.gz", gzip.compress(b"ok " * 10 + b"\xff"), r"x\.txt\.gz is not UTF-8 text \(bad byte at offset 30 of its decompressed text\)"),
        ("x.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', r"x\.jsonl:2: not UTF-8"),
        ("x.jsonl", b'{"text": "a"}\n{"body": "b", "id": 1}\n', r'x\.jsonl:2: no "text" string field \(its fields: body, id\); choose the field with --text-field'),
        ("x.jsonl.gz", gzip.compress(b'{"text": "a"}\n\n{"text": null}\n'), r'x\.jsonl\.gz:3: no "text" string field'),
        ("x.arrow", b"", r"x\.arrow is a lone \.arrow file; give the Hugging Face dataset directory"),
        ("x.npy.gz", b"", r"x\.npy\.gz: a compressed \.npy file cannot be read"),
    ],
    ids=["not-gzip", "truncated-gzip", "not-zstd", "truncated-zstd", "not-parquet",
         "latin1-text", "gzip-not-utf8", "jsonl-not-utf8", "jsonl-no-field", "jsonl-gz-null",
         "lone-arrow", "npy-gz"],
)  # fmt: skip
def test_unreadable_input_is_one_line_naming_the_file(tmp_path, name, content, message):
    if name.endswith(".zst"):
        optional("zstandard")
    if name.endswith(".parquet"):
        optional("pyarrow")
    (tmp_path / "good.jsonl").write_text('{"text": "fine"}\n')
    (tmp_path / name).write_bytes(content() if callable(content) else content)
    out = tmp_path / "out"
    with pytest.raises(DataError, match=message) as info:
        prepare_data([tmp_path / "good.jsonl", tmp_path / name], out)
    assert "\n" not in str(info.value)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["good.jsonl", name])


def test_missing_text_in_a_later_piece_names_its_line(tmp_path):
    lines = [json.dumps({"text": f"document {i}"}) for i in range(20000)]
    lines[15000] = json.dumps({"content": "no text here"})
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    assert (tmp_path / "big.jsonl").stat().st_size > 4 * (64 << 10)
    with pytest.raises(DataError, match=r'big\.jsonl:15001: no "text" string field'):
        prepare_data([tmp_path / "big.jsonl"], tmp_path / "out", shard_size="64K")


def test_bad_columns_and_rows_name_file_row_and_column(tmp_path):
    pa, pq, datasets = optional("pyarrow", "pyarrow.parquet", "datasets")
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "no_text.parquet")
    with pytest.raises(
        DataError,
        match=r"no_text\.parquet has no column 'text' \(its columns: body\); choose the text column with --text-field",
    ):
        prepare_data([tmp_path / "no_text.parquet"], tmp_path / "out")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(DataError, match=r"ints\.parquet: column 'text' holds int64, not strings"):
        prepare_data([tmp_path / "ints.parquet"], tmp_path / "out")
    pq.write_table(
        pa.table({"text": ["a"] * 70 + [None] + ["b"]}),
        tmp_path / "null.parquet",
        row_group_size=50,
    )
    with pytest.raises(
        DataError, match=r"null\.parquet: row 70 \(counting from 0\) has no 'text' text \(null\)"
    ):
        prepare_data([tmp_path / "null.parquet"], tmp_path / "out")
    datasets.Dataset.from_dict({"content": ["a", "b"]}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(
        DataError,
        match=r"hf/data-00000-of-00001\.arrow has no column 'text' \(its columns: content\)",
    ):
        prepare_data([tmp_path / "hf"], tmp_path / "out")
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["a"]}),
            "test": datasets.Dataset.from_dict({"text": ["b"]}),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(
        DataError,
        match=r"dd is a Hugging Face DatasetDict \(splits: train, test\); give the directory of the split to prepare, e.g\. .*dd/train",
    ):
        prepare_data([tmp_path / "dd"], tmp_path / "out")
    prepare_data([tmp_path / "dd" / "test"], tmp_path / "out")  # a split is fine
    assert_streams_equal(read_stream(tmp_path / "out"), np.array([*b"b", EOS]))
    assert not (tmp_path / ".out.partial").exists()


def test_ids_that_do_not_fit_the_dtype_are_refused(tmp_path):
    np.save(tmp_path / "ids.npy", np.array([1, 2, 70000, 3], dtype=np.int64))
    with pytest.raises(
        DataError,
        match=r"ids\.npy holds token id 70000 at index 2, which does not fit uint16 \(ids up to 65535\); use --dtype uint32",
    ):
        prepare_data([tmp_path / "ids.npy"], tmp_path / "out", dtype="uint16")
    np.save(tmp_path / "huge.npy", np.array([5, 2**33], dtype=np.int64))
    with pytest.raises(
        DataError,
        match=r"huge\.npy holds token id 8589934592 at index 1, which does not fit uint32 .*no token dtype holds it",
    ):
        prepare_data([tmp_path / "huge.npy"], tmp_path / "out")
    np.save(tmp_path / "negative.npy", np.array([5, -1], dtype=np.int64))
    with pytest.raises(
        DataError, match=r"negative\.npy holds a negative token id \(-1\) at index 1"
    ):
        prepare_data([tmp_path / "negative.npy"], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    meta = prepare_data([tmp_path / "ids.npy"], tmp_path / "out", dtype="uint32")
    assert (meta["dtype"], meta["vocab_size"]) == ("uint32", 70001)
    assert_streams_equal(read_stream(tmp_path / "out"), np.array([1, 2, 70000, 3]))


def test_a_failure_keeps_finished_shards_and_a_fixed_rerun_completes(tmp_path):
    rng = random.Random(10)
    good = random_documents(rng, 3000)
    later = random_documents(rng, 50)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(jsonl_bytes(good))
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(later))[:-100])
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"b\.jsonl\.gz is not a readable gzip file"):
        prepare_data([tmp_path / "in"], out, shard_size="64K")
    partial = tmp_path / ".out.partial"
    finished = sorted(p.name for p in partial.glob("tokens-*.bin"))
    assert len(finished) >= 3 and not out.exists()
    stats = {name: (partial / name).stat().st_ino for name in finished}

    (tmp_path / "in" / "b.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(later)))
    prepare_data([tmp_path / "in"], out, shard_size="64K")

    assert_streams_equal(read_stream(out), byte_stream([(Path(), good + later)]))
    assert {name: (out / name).stat().st_ino for name in finished} == stats
    prepare_data([tmp_path / "in"], tmp_path / "clean", shard_size="64K")
    assert directory_bytes(out)["meta.json"].replace(b"out", b"") == directory_bytes(
        tmp_path / "clean"
    )["meta.json"].replace(b"clean", b"")


def test_prepared_shards_are_one_stream_for_training(tmp_path):
    """Windows of a sharded directory cross shard boundaries as in one file."""
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(random_documents(random.Random(11), 3000)))
    meta = prepare_data([tmp_path / "a.jsonl"], tmp_path / "out", shard_size="64K")
    assert len(meta["shards"]) > 3
    stream = read_stream(tmp_path / "out")
    np.save(tmp_path / "same.npy", stream)
    sharded = TokenDataset([tmp_path / "out"], seq_len=100)
    single = TokenDataset([tmp_path / "same.npy"], seq_len=100)
    assert (sharded.num_sequences, sharded.eos_id) == (single.num_sequences, EOS)
    indices = np.arange(sharded.num_sequences)
    np.testing.assert_array_equal(
        np.stack([sharded.sequence(int(i)) for i in indices]),
        np.stack([single.sequence(int(i)) for i in indices]),
    )


@pytest.mark.slow
def test_memory_does_not_grow_with_the_input(tmp_path):
    """Peak memory of preparing 4 MB and 32 MB of text and of JSON Lines is about the same."""
    script = (  # VmHWM: this process's peak resident memory (ru_maxrss would count the parent's)
        "import re, sys\n"
        "from pathlib import Path\n"
        "from moe_data import prepare_data\n"
        "prepare_data([sys.argv[1]], sys.argv[2], workers=1)\n"
        "print(re.search(r'VmHWM:\\s*(\\d+)', Path('/proc/self/status').read_text())[1])\n"
    )
    line = json.dumps({"text": "some words of a document, " * 40}) + "\n"
    peaks = {}
    for megabytes in (4, 32):
        for suffix, unit in ((".txt", "a line of plain text\n"), (".jsonl", line)):
            path = tmp_path / f"{megabytes}{suffix}"
            block = unit * (10**6 // len(unit))
            with open(path, "w") as f:
                for _ in range(megabytes):
                    f.write(block)
            out = tmp_path / f"out{megabytes}{suffix}"
            result = subprocess.run([sys.executable, "-c", script, str(path), str(out)],
                                    capture_output=True, text=True, timeout=300)  # fmt: skip
            assert result.returncode == 0, result.stderr
            peaks[megabytes, suffix] = int(result.stdout.split()[-1]) / 1024  # MiB
    for suffix in (".txt", ".jsonl"):
        growth = peaks[32, suffix] - peaks[4, suffix]
        assert growth < 16, f"{suffix}: peak {peaks[4, suffix]:.0f} -> {peaks[32, suffix]:.0f} MiB"


def test_a_missing_optional_library_is_named_with_its_extra(tmp_path, monkeypatch):
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    (tmp_path / "b.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    for module in ("pyarrow", "pyarrow.parquet", "zstandard"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(
        DataError, match=r"\.parquet files .* needs pyarrow: pip install 'moestack-train\[data\]'"
    ):
        prepare_data([tmp_path / "a.parquet"], tmp_path / "out")
    with pytest.raises(
        DataError,
        match=r"\.zst files needs the zstandard package: pip install 'moestack-train\[data\]'",
    ):
        prepare_data([tmp_path / "b.jsonl.zst"], tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet", "b.jsonl.zst"]
