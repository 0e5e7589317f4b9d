"""Damaged checkpoints are refused with one line naming the file (and the tensor, for its
data), and left as they are: every byte a read uses is checked first, and a read of a range
checks exactly the checksum chunks it reads."""

import hashlib
import json
import os
import re
import zlib
from pathlib import Path

import pytest
import torch

from moe_checkpoint import (
    CheckpointError,
    OwnedSlice,
    SliceRequest,
    checkpoint_summary,
    latest_checkpoint,
    load_into,
    load_slices,
    read_trainer_state,
    save_checkpoint,
    verify_checkpoint,
)

SHAPES = {"experts.w1": (4, 8, 6), "norm.weight": (6,), "optim.step": (1,)}
CHUNK = 64  # bytes: experts.w1 (768 bytes) has 12 chunks


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "experts.w1": torch.randn(4, 8, 6, generator=g),
        "norm.weight": torch.randn(6, generator=g),
        "optim.step": torch.tensor([3]),
    }


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    slices = [OwnedSlice.whole(name, t) for name, t in _values().items()]
    categories = {"experts.w1": "model", "norm.weight": "model", "optim.step": "optim"}
    return save_checkpoint(
        tmp_path, 1, slices, categories, {"step": 1}, max_file_bytes=512, checksum_chunk_bytes=CHUNK
    ).wait()


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _load_all(path: Path) -> None:
    load_slices(path, [SliceRequest.whole(name, shape) for name, shape in SHAPES.items()])


def _expect_one_line_error(call, pattern: str, root: Path) -> str:
    before = _snapshot(root)
    with pytest.raises(CheckpointError, match=pattern) as error:
        call()
    assert "\n" not in str(error.value)
    assert _snapshot(root) == before, "a failed read changed or deleted something"
    return str(error.value)


def _index(path: Path) -> dict:
    return json.loads((path / "index.json").read_text())


def _file_of(path: Path, name: str) -> Path:
    return path / _index(path)["tensors"][name]["file"]


def _flip(path: Path, offset: int) -> None:
    """Flip the low bit of the byte at `offset` (negative: from the end)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _rewrite_index(path: Path, index: dict) -> None:
    """Replace index.json and make COMMITTED vouch for it (as a save of that index would)."""
    text = json.dumps(index, indent=1).encode()
    (path / "index.json").write_bytes(text)
    marker = {"step": index["step"], "index_sha256": hashlib.sha256(text).hexdigest()}
    (path / "COMMITTED").write_text(json.dumps(marker))


@pytest.mark.parametrize("where", ["first byte", "middle chunk", "last byte"])
def test_flipped_tensor_byte_fails_every_read_naming_file_and_tensor(checkpoint, where):
    target = _file_of(checkpoint, "experts.w1")
    begin, end = _index(checkpoint)["tensors"]["experts.w1"]["byte_range"]
    offset = {"first byte": begin, "middle chunk": begin + 5 * CHUNK + 3, "last byte": end - 1}
    _flip(target, offset[where])
    chunk = (offset[where] - begin) // CHUNK
    pattern = (
        rf"{target.name}: tensor 'experts.w1': checksum mismatch in chunk {chunk} \(file bytes "
        rf"\[{begin + chunk * CHUNK}, {min(begin + (chunk + 1) * CHUNK, end)}\)\): "
        r"crc32 [0-9a-f]{8}, index.json records [0-9a-f]{8}"
    )
    root = checkpoint.parent
    _expect_one_line_error(lambda: _load_all(checkpoint), pattern, root)
    into = [OwnedSlice.whole("experts.w1", torch.zeros(SHAPES["experts.w1"]))]
    _expect_one_line_error(lambda: load_into(checkpoint, into), pattern, root)
    _expect_one_line_error(lambda: verify_checkpoint(checkpoint), pattern, root)
    assert re.search(pattern, checkpoint_summary(checkpoint)["verification"])
    # The other tensors, in other chunks and files, still load.
    (norm,) = load_slices(checkpoint, [SliceRequest.whole("norm.weight", (6,))])
    assert torch.equal(norm, _values()["norm.weight"])


def test_a_range_read_checks_exactly_the_chunks_it_reads(checkpoint):
    """A flip in chunk 5 (bytes [320, 384) of the tensor, elements [80, 96)) fails every read
    that touches that chunk, even by one element, and no read that stays outside it."""
    w1 = _values()["experts.w1"].reshape(-1)
    target = _file_of(checkpoint, "experts.w1")
    begin = _index(checkpoint)["tensors"]["experts.w1"]["byte_range"][0]
    _flip(target, begin + 5 * CHUNK + 10)
    shape = SHAPES["experts.w1"]
    clean = {(0, 80), (96, 96), (79, 1), (96, 1), (3, 40)}  # (flat_start, numel)
    for start, numel in sorted(clean):
        (got,) = load_slices(checkpoint, [SliceRequest("experts.w1", shape, start, numel)])
        assert torch.equal(got, w1[start : start + numel]), (start, numel)
        piece = torch.zeros(numel)
        load_into(checkpoint, [OwnedSlice("experts.w1", shape, start, piece)])
        assert torch.equal(piece, w1[start : start + numel]), (start, numel)
    for start, numel in [(0, 81), (95, 1), (80, 1), (90, 30), (0, 192)]:
        _expect_one_line_error(
            lambda s=start, n=numel: load_slices(
                checkpoint, [SliceRequest("experts.w1", shape, s, n)]
            ),
            rf"{target.name}: tensor 'experts.w1': checksum mismatch in chunk 5 ",
            checkpoint.parent,
        )


def test_default_chunks_a_rank_reads_only_its_rows(tmp_path):
    """With the default chunk size: a tensor of 2.5 chunks, a flip in the middle chunk."""
    rows = torch.randn(10, 65536)  # 256 KiB per row, 1 MiB default chunks: rows 4-7 in chunk 1
    path = save_checkpoint(tmp_path, 1, [OwnedSlice.whole("w", rows)], {"w": "model"}, {}).wait()
    index = _index(path)
    assert index["chunk_bytes"] == 1024 * 1024
    assert len(index["tensors"]["w"]["chunk_crc32"]) == 3 * 8
    _flip(_file_of(path, "w"), index["tensors"]["w"]["byte_range"][0] + 1024 * 1024 + 7)
    (mine,) = load_slices(path, [SliceRequest.rows("w", (10, 65536), 0, 4)])
    assert torch.equal(mine, rows[:4])
    (mine,) = load_slices(path, [SliceRequest.rows("w", (10, 65536), 8, 10)])
    assert torch.equal(mine, rows[8:])
    with pytest.raises(CheckpointError, match=r"tensor 'w': checksum mismatch in chunk 1 "):
        load_slices(path, [SliceRequest.rows("w", (10, 65536), 7, 8)])


@pytest.mark.parametrize("where", ["length prefix", "data offset", "metadata", "last byte"])
def test_flipped_header_byte_fails_naming_the_file(checkpoint, where):
    """Including flips that leave a valid header (a metadata value nobody uses)."""
    target = _file_of(checkpoint, "experts.w1")
    header_bytes = _index(checkpoint)["files"][target.name]["header_bytes"]
    raw = target.read_bytes()[:header_bytes]
    offset = {
        "length prefix": 0,
        "data offset": raw.index(b'"data_offsets":[') + len(b'"data_offsets":['),
        "metadata": raw.index(b'"pt"') + 2,
        "last byte": header_bytes - 1,
    }
    _flip(target, offset[where])
    pattern = (
        rf"{target.name}: safetensors header checksum mismatch: crc32 [0-9a-f]{{8}}, "
        r"index.json records [0-9a-f]{8}$"
    )
    _expect_one_line_error(lambda: _load_all(checkpoint), pattern, checkpoint.parent)
    _expect_one_line_error(lambda: verify_checkpoint(checkpoint), pattern, checkpoint.parent)


@pytest.mark.parametrize("offset", [0, 1000, -2])
def test_flipped_index_byte_fails_every_read(checkpoint, offset):
    _flip(checkpoint / "index.json", offset)
    pattern = (
        r"step_00000001/index.json: checksum mismatch: sha256 [0-9a-f]{64}, "
        r"COMMITTED records [0-9a-f]{64}$"
    )
    for call in (
        lambda: _load_all(checkpoint),
        lambda: verify_checkpoint(checkpoint),
        lambda: read_trainer_state(checkpoint),
        lambda: checkpoint_summary(checkpoint, verify=False),
    ):
        _expect_one_line_error(call, pattern, checkpoint.parent)


def test_flipped_trainer_state_and_damaged_marker(checkpoint):
    state = checkpoint / "trainer_state.json"
    _flip(state, 3)
    pattern = r"trainer_state.json: checksum mismatch: sha256 [0-9a-f]{64}, index.json records"
    _expect_one_line_error(lambda: read_trainer_state(checkpoint), pattern, checkpoint.parent)
    _expect_one_line_error(lambda: verify_checkpoint(checkpoint), pattern, checkpoint.parent)
    _flip(state, 3)
    assert read_trainer_state(checkpoint) == {"step": 1}

    (checkpoint / "COMMITTED").write_text('{"step": 1}')
    _expect_one_line_error(
        lambda: _load_all(checkpoint), r"COMMITTED: damaged: no index_sha256", checkpoint.parent
    )


def test_older_format_gives_one_clear_line(checkpoint):
    """A version 1 index (no checksums of chunks, headers or trainer state) is refused."""
    index = _index(checkpoint)
    index["format_version"] = 1
    for key in ("chunk_bytes", "trainer_state_sha256"):
        del index[key]
    for record in index["tensors"].values():
        del record["chunk_crc32"]
    for record in index["files"].values():
        del record["header_bytes"], record["header_crc32"]
    _rewrite_index(checkpoint, index)
    pattern = (
        r"index.json: checkpoint format version 1 is older than version 2, the only one this "
        r"moe-checkpoint reads: it lacks the per-chunk checksums"
    )
    for call in (lambda: _load_all(checkpoint), lambda: verify_checkpoint(checkpoint)):
        _expect_one_line_error(call, pattern, checkpoint.parent)


def test_index_with_the_wrong_number_of_chunk_checksums(checkpoint):
    index = _index(checkpoint)
    index["tensors"]["norm.weight"]["chunk_crc32"] += "00000000"
    _rewrite_index(checkpoint, index)
    _expect_one_line_error(
        lambda: _load_all(checkpoint),
        r"index.json: tensor 'norm.weight': chunk_crc32 has 16 hex digits, 1 chunks of 64 "
        r"bytes need 8",
        checkpoint.parent,
    )


def test_index_records_the_crc32_of_each_chunk(checkpoint):
    """Against an independent computation from the file's bytes."""
    index = _index(checkpoint)
    assert index["format_version"] == 2 and index["chunk_bytes"] == CHUNK
    for name, record in index["tensors"].items():
        data = (checkpoint / record["file"]).read_bytes()
        begin, end = record["byte_range"]
        expected = "".join(
            f"{zlib.crc32(data[at : min(at + CHUNK, end)]):08x}" for at in range(begin, end, CHUNK)
        )
        assert record["chunk_crc32"] == expected, name
    for name, record in index["files"].items():
        data = (checkpoint / name).read_bytes()
        assert record["sha256"] == hashlib.sha256(data).hexdigest(), name
        assert record["header_crc32"] == f"{zlib.crc32(data[: record['header_bytes']]):08x}"
        assert int.from_bytes(data[:8], "little") + 8 == record["header_bytes"], name
    state = (checkpoint / "trainer_state.json").read_bytes()
    assert index["trainer_state_sha256"] == hashlib.sha256(state).hexdigest()


def test_truncated_file(checkpoint):
    target = _file_of(checkpoint, "experts.w1")
    os.truncate(target, target.stat().st_size - 1)
    pattern = rf"{target.name}: truncated: \d+ bytes, index.json records \d+"
    _expect_one_line_error(lambda: _load_all(checkpoint), pattern, checkpoint.parent)
    _expect_one_line_error(lambda: verify_checkpoint(checkpoint), pattern, checkpoint.parent)


def test_missing_file(checkpoint):
    target = _file_of(checkpoint, "optim.step")
    target.unlink()
    pattern = rf"{target.name}: file listed in index.json is missing"
    _expect_one_line_error(lambda: _load_all(checkpoint), pattern, checkpoint.parent)
    _expect_one_line_error(lambda: verify_checkpoint(checkpoint), pattern, checkpoint.parent)


def test_missing_tensor_and_wrong_shape(checkpoint):
    _expect_one_line_error(
        lambda: load_slices(checkpoint, [SliceRequest.whole("experts.w2", (4, 8, 6))]),
        r"tensor 'experts.w2' is not in checkpoint",
        checkpoint.parent,
    )
    _expect_one_line_error(
        lambda: load_slices(checkpoint, [SliceRequest.whole("experts.w1", (8, 8, 6))]),
        r"tensor 'experts.w1' has shape \[4, 8, 6\] in .*model-0000\d-of-0000\d.safetensors, "
        r"but the caller expects \[8, 8, 6\]",
        checkpoint.parent,
    )
    _expect_one_line_error(
        lambda: load_slices(checkpoint, [SliceRequest("norm.weight", (6,), 4, 3)]),
        r"tensor 'norm.weight': requested elements \[4, 7\) lie outside its 6 elements",
        checkpoint.parent,
    )


def test_uncommitted_checkpoint_is_not_trusted(checkpoint):
    (checkpoint / "COMMITTED").unlink()
    for call in (
        lambda: _load_all(checkpoint),
        lambda: verify_checkpoint(checkpoint),
        lambda: read_trainer_state(checkpoint),
    ):
        _expect_one_line_error(call, r"step_00000001 is not committed", checkpoint.parent)
    assert latest_checkpoint(checkpoint.parent) is None


def test_index_and_header_that_disagree(checkpoint):
    """An index edited consistently with COMMITTED (as a buggy writer could leave it) is
    still checked against the files' headers."""
    edited = _index(checkpoint)
    edited["tensors"]["norm.weight"]["shape"] = [2, 3]
    _rewrite_index(checkpoint, edited)
    _expect_one_line_error(
        lambda: load_slices(checkpoint, [SliceRequest.whole("norm.weight", (2, 3))]),
        r"header disagrees with index.json for tensor 'norm.weight'",
        checkpoint.parent,
    )
