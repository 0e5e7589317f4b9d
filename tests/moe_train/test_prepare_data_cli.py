"""Tests of the `moe-train prepare-data` command: one-line errors with exit 2, and its start
line (the preparation itself is tested in tests/moe_data/test_prepare_data.py)."""

from __future__ import annotations

import gzip
import json

from moe_data import prepare_data
from moe_train.cli import main


def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl.gz").write_bytes(b"not gzip")
    (tmp_path / "b.txt").write_text("fine")
    for args, expected in [
        ([str(tmp_path / "in")], "a.jsonl.gz is not a readable gzip file (Not a gzipped file"),
        ([str(tmp_path / "b.txt"), "--workers", "0"], "--workers=0 must be at least 1"),
        ([str(tmp_path / "b.txt"), "--shard-size", "12Q"], "--shard-size='12Q' is not a size"),
        ([str(tmp_path / "b.txt"), "--shard-size", "1K"], "--shard-size=1K is below the smallest"),
    ]:
        assert main(["prepare-data", *args, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and expected in lines[0], err
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt", "in"]


def test_a_corpus_without_text_is_refused_and_an_empty_out_is_kept(tmp_path, capsys):
    """Inputs that tokenize to nothing but end-of-document ids are refused in one line naming
    them, exit 2; an empty --out given beforehand stays as it was, and no .partial is left."""
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    out = tmp_path / "out"
    out.mkdir()
    no_text = "to tokenize, so nothing would be trained on; give inputs with text"
    for names, expected in [
        (["empty.jsonl"], f"error: {tmp_path / 'empty.jsonl'} holds no text {no_text}"),
        (["empty.txt"], f"error: {tmp_path / 'empty.txt'} holds no text {no_text}"),
        (
            ["empty.txt", "blank.jsonl"],
            f"error: none of the 2 inputs ({tmp_path / 'empty.txt'}, {tmp_path / 'blank.jsonl'})"
            f" holds any text {no_text}",
        ),
    ]:
        args = [str(tmp_path / name) for name in names]
        assert main(["prepare-data", *args, "--workers", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if line.startswith("error")] == [expected], err
        assert "Traceback" not in err
        assert list(out.iterdir()) == [] and not (tmp_path / ".out.partial").exists()
    (tmp_path / "some.txt").write_text("x")
    meta = prepare_data([tmp_path / "empty.txt", tmp_path / "some.txt"], out)
    assert (meta["num_tokens"], meta["num_documents"]) == (3, 2), "an empty file among others"


def test_the_start_line_counts_in_words_and_says_why_fewer_workers_run(tmp_path, capsys):
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": f"document {i}"}) + "\n" for i in range(100))
    (tmp_path / "b.txt").write_text("a small text\n" * 100)
    assert main(["prepare-data", str(tmp_path / "a.jsonl.gz"), "--workers", "2",
                 "--out", str(tmp_path / "one")]) == 0  # fmt: skip
    first = capsys.readouterr().err.replace("\r", "\n").splitlines()[0]
    assert first.startswith("preparing 1 input file (0.0 MB) into 1 shard of about 1.0 MB "), first
    assert first.endswith(
        "with 1 worker (2 asked for, at most one per shard to write; a compressed file "
        "(.gz, .zst) cannot be split: each is one shard)"
    ), first
    assert main(["prepare-data", str(tmp_path / "b.txt"), str(tmp_path / "a.jsonl.gz"),
                 "--workers", "3", "--out", str(tmp_path / "two")]) == 0  # fmt: skip
    first = capsys.readouterr().err.replace("\r", "\n").splitlines()[0]
    assert first.startswith("preparing 2 input files "), first
    assert "a smaller --shard-size makes more shards of the other inputs)" in first, first
