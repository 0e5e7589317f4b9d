"""Damaged checkpoints are refused with one line naming the file or tensor, and left as they are."""

import json
import os
from pathlib import Path

import pytest
import torch

from moe_checkpoint import (
    CheckpointError,
    OwnedSlice,
    SliceRequest,
    checkpoint_summary,
    latest_checkpoint,
    load_slices,
    read_trainer_state,
    save_checkpoint,
    verify_checkpoint,
)

SHAPES = {"experts.w1": (4, 8, 6), "norm.weight": (6,), "optim.step": (1,)}


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    g = torch.Generator().manual_seed(0)
    slices = [
        OwnedSlice.whole("experts.w1", torch.randn(4, 8, 6, generator=g)),
        OwnedSlice.whole("norm.weight", torch.randn(6, generator=g)),
        OwnedSlice.whole("optim.step", torch.tensor([3])),
    ]
    categories = {"experts.w1": "model", "norm.weight": "model", "optim.step": "optim"}
    return save_checkpoint(tmp_path, 1, slices, categories, {"step": 1}, max_file_bytes=512).wait()


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


def _file_of(path: Path, name: str) -> Path:
    return path / json.loads((path / "index.json").read_text())["tensors"][name]["file"]


def test_truncated_file(checkpoint):
    target = _file_of(checkpoint, "experts.w1")
    os.truncate(target, target.stat().st_size - 1)
    pattern = rf"{target.name}: truncated: \d+ bytes, index.json records \d+"
    _expect_one_line_error(lambda: _load_all(checkpoint), pattern, checkpoint.parent)
    _expect_one_line_error(lambda: verify_checkpoint(checkpoint), pattern, checkpoint.parent)


def test_flipped_byte_fails_verification(checkpoint):
    target = _file_of(checkpoint, "experts.w1")
    data = bytearray(target.read_bytes())
    data[-100] ^= 0x01
    target.write_bytes(bytes(data))
    _expect_one_line_error(
        lambda: verify_checkpoint(checkpoint),
        rf"{target.name}: checksum mismatch: sha256 [0-9a-f]{{64}}, index.json records",
        checkpoint.parent,
    )
    assert "checksum mismatch" in checkpoint_summary(checkpoint)["verification"]


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


def test_damaged_index_and_header(checkpoint):
    index_path = checkpoint / "index.json"
    good_index = index_path.read_text()
    index_path.write_text(good_index[:-20])
    _expect_one_line_error(
        lambda: _load_all(checkpoint),
        r"index.json: not a valid checkpoint index",
        checkpoint.parent,
    )
    edited = json.loads(good_index)
    edited["tensors"]["norm.weight"]["shape"] = [2, 3]
    index_path.write_text(json.dumps(edited))
    _expect_one_line_error(
        lambda: load_slices(checkpoint, [SliceRequest.whole("norm.weight", (2, 3))]),
        r"header disagrees with index.json for tensor 'norm.weight'",
        checkpoint.parent,
    )
    _expect_one_line_error(
        lambda: verify_checkpoint(checkpoint),
        r"index.json: checksum mismatch against COMMITTED",
        checkpoint.parent,
    )
