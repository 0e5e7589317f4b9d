"""Single-process saves: exact round trips, plain-safetensors readability, trainer state,
finding and pruning checkpoints, asynchronous saves, and ownership errors."""

import base64
import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import Tensor

from moe_checkpoint import (
    CheckpointError,
    OwnedSlice,
    SliceRequest,
    checkpoint_summary,
    latest_checkpoint,
    list_checkpoints,
    load_into,
    load_slices,
    prune_checkpoints,
    read_trainer_state,
    save_checkpoint,
    verify_checkpoint,
)


def _category(name: str) -> str:
    return "optim" if name.startswith("optim.") else "model"


def _tensors(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.experts.w1": torch.randn(4, 6, 5, generator=g),
        "layers.0.norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "layers.10.attn.qkv": torch.randn(8, 5, generator=g).t(),  # non-contiguous view
        "layers.2.scale": torch.tensor(1.5, dtype=torch.float64),  # 0-d
        "optim.step": torch.tensor([7, 2**40], dtype=torch.int64),
        "optim.mask": torch.tensor([True, False, True]),
        "optim.empty": torch.zeros(0, 3),
    }


def _stored(tensor: Tensor) -> Tensor:
    """What the checkpoint must hold: floating point as float32, the rest unchanged."""
    return tensor.to(torch.float32) if tensor.is_floating_point() else tensor


def _assert_equal(actual: Tensor, expected: Tensor, name: str) -> None:
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    if not torch.equal(actual, expected):
        diff = (actual.double() - expected.double()).abs().reshape(-1)
        worst = int(diff.argmax())
        raise AssertionError(
            f"{name}: differs; worst flat index {worst}: "
            f"{actual.reshape(-1)[worst].item()} vs {expected.reshape(-1)[worst].item()}"
        )


def _save(root: Path, step: int, tensors: dict[str, Tensor], **kwargs):
    slices = [OwnedSlice.whole(name, t) for name, t in tensors.items()]
    return save_checkpoint(root, step, slices, _category, {"step": step}, **kwargs)


def test_round_trip_is_exact_and_plain_safetensors_reads_global_tensors(tmp_path):
    tensors = _tensors()
    path = _save(tmp_path, 3, tensors, max_file_bytes=200).wait()
    assert path == tmp_path / "step_00000003"
    assert (path / "COMMITTED").is_file()

    loaded = load_slices(path, [SliceRequest.whole(n, t.shape) for n, t in tensors.items()])
    for (name, tensor), got in zip(tensors.items(), loaded, strict=True):
        _assert_equal(got, _stored(tensor), name)

    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(files) > 2 and all(f.startswith(("model-", "optim-")) for f in files)
    assert "model-00001-of-" in files[0]
    seen = {}
    for file in files:
        with safe_open(path / file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                seen[name] = f.get_tensor(name)
    assert seen.keys() == tensors.keys()
    for name, tensor in tensors.items():
        _assert_equal(seen[name], _stored(tensor), f"safe_open {name}")
    verify_checkpoint(path)


def test_files_and_index_are_byte_identical_whatever_the_ownership(tmp_path):
    """Whole tensors saved synchronously, or pieces cut across checksum chunks saved
    asynchronously: the same files and the same index.json, chunk checksums included."""
    tensors = _tensors()
    chunked = dict(max_file_bytes=200, checksum_chunk_bytes=28)  # cuts inside chunks
    whole = _save(tmp_path / "whole", 1, tensors, **chunked).wait()
    w1 = tensors["layers.0.experts.w1"]
    flat = tensors["optim.step"]
    pieces = [
        OwnedSlice.whole(n, t)
        for n, t in tensors.items()
        if n not in ("layers.0.experts.w1", "optim.step")
    ]
    pieces += [
        OwnedSlice.rows("layers.0.experts.w1", w1.shape, 1, w1[1:]),
        OwnedSlice.rows("layers.0.experts.w1", w1.shape, 0, w1[:1]),
        OwnedSlice("optim.step", (2,), 1, flat[1:]),
        OwnedSlice("optim.step", (2,), 0, flat[:1]),
    ]
    split = save_checkpoint(
        tmp_path / "split", 1, pieces, _category, {"step": 1}, asynchronous=True, **chunked
    ).wait()
    for file in whole.glob("*.safetensors"):
        assert file.read_bytes() == (split / file.name).read_bytes(), file.name
    assert (whole / "index.json").read_bytes() == (split / "index.json").read_bytes()
    index = json.loads((whole / "index.json").read_text())
    assert len(index["tensors"]["layers.0.experts.w1"]["chunk_crc32"]) == 18 * 8  # 480 bytes


def test_slices_and_load_into(tmp_path):
    tensors = _tensors()
    path = _save(tmp_path, 1, tensors).wait()
    w1 = tensors["layers.0.experts.w1"]
    rows, flat = load_slices(
        path,
        [
            SliceRequest.rows("layers.0.experts.w1", w1.shape, 1, 3),
            SliceRequest("layers.0.experts.w1", tuple(w1.shape), flat_start=7, numel=40),
        ],
    )
    _assert_equal(rows, w1[1:3], "rows")
    _assert_equal(flat, w1.reshape(-1)[7:47], "flat range")

    norm = torch.zeros(5, dtype=torch.bfloat16)
    expert_rows = torch.zeros(2, 6, 5)
    step = torch.zeros(1, dtype=torch.int64)
    load_into(
        path,
        [
            OwnedSlice.whole("layers.0.norm.weight", norm),
            OwnedSlice.rows("layers.0.experts.w1", w1.shape, 2, expert_rows),
            OwnedSlice("optim.step", (2,), 1, step),
        ],
    )
    _assert_equal(norm, tensors["layers.0.norm.weight"], "norm (back to bf16)")
    _assert_equal(expert_rows, w1[2:4], "expert rows")
    _assert_equal(step, tensors["optim.step"][1:], "int64 step")


def test_trainer_state_round_trip_and_summary(tmp_path):
    rng = torch.get_rng_state()
    state = {
        "step": 12,
        "data_position": {"epoch": 0, "sample": 384},
        "rng": {"torch_cpu": base64.b64encode(rng.numpy().tobytes()).decode()},
        "config": {"model": {"d_model": 32}, "optim": {"lr": 3e-4, "betas": [0.9, 0.95]}},
        "topology": {"world_size": 1, "ep": 1, "pp": 1},
    }
    slices = [OwnedSlice.whole(n, t) for n, t in _tensors().items()]
    path = save_checkpoint(tmp_path, 12, slices, _category, state).wait()
    loaded = read_trainer_state(path)
    assert loaded == state
    restored = torch.frombuffer(
        bytearray(base64.b64decode(loaded["rng"]["torch_cpu"])), dtype=torch.uint8
    )
    assert torch.equal(restored, rng)

    summary = checkpoint_summary(path)
    assert summary["step"] == 12
    assert summary["saved_topology"] == state["topology"]
    assert summary["saved_world_size"] == 1
    assert summary["verification"] == "ok"
    assert summary["tensors"]["layers.0.norm.weight"] == {
        "shape": [5],
        "dtype": "F32",
        "category": "model",
        "file": summary["tensors"]["layers.0.norm.weight"]["file"],
        "bytes": 20,
    }
    assert summary["tensors"]["optim.step"]["dtype"] == "I64"
    assert summary["total_bytes"] == sum(f.stat().st_size for f in path.glob("*.safetensors"))


def test_latest_checkpoint_ignores_temporary_and_uncommitted_dirs(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    assert latest_checkpoint(tmp_path) is None
    tensors = _tensors()
    _save(tmp_path, 5, tensors)
    _save(tmp_path, 10, tensors)
    # Look-alikes of later saves that never committed:
    (tmp_path / ".tmp-step_00000020-abcd1234").mkdir()
    (tmp_path / ".deleting-step_00000030-abcd1234").mkdir()
    uncommitted = tmp_path / "step_00000040"
    uncommitted.mkdir()
    (uncommitted / "index.json").write_text("{}")
    (tmp_path / "step_00000050").write_text("a file, not a directory")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000010"
    assert list_checkpoints(tmp_path) == [tmp_path / "step_00000005", tmp_path / "step_00000010"]
    with pytest.raises(CheckpointError, match="not committed"):
        load_slices(uncommitted, [])


def test_prune_keeps_newest_committed_and_live_saves(tmp_path):
    tensors = {"w": torch.randn(3, 2)}
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, tensors)
    stale_tmp = tmp_path / ".tmp-step_00000003-deadbeef"
    stale_tmp.mkdir()
    long_ago = time.time() - 3600
    os.utime(stale_tmp, (long_ago, long_ago))
    interrupted_delete = tmp_path / ".deleting-step_00000000-0badf00d"
    (interrupted_delete / "sub").mkdir(parents=True)
    live_tmp = tmp_path / ".tmp-step_00000005-feedface"  # newer than the newest commit
    live_tmp.mkdir()
    uncommitted_newer = tmp_path / "step_00000006"
    uncommitted_newer.mkdir()

    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert set(removed) == {
        tmp_path / "step_00000001",
        tmp_path / "step_00000002",
        stale_tmp,
        interrupted_delete,
    }
    assert list_checkpoints(tmp_path) == [tmp_path / "step_00000003", tmp_path / "step_00000004"]
    assert live_tmp.is_dir() and uncommitted_newer.is_dir()
    assert not any(p.name.startswith(".deleting-") for p in tmp_path.iterdir())
    assert prune_checkpoints(tmp_path, keep_last=2) == []
    with pytest.raises(CheckpointError, match="keep_last=0"):
        prune_checkpoints(tmp_path, keep_last=0)


def test_async_save_holds_values_at_save_time(tmp_path):
    tensors = _tensors()
    expected = {name: _stored(t).clone() for name, t in tensors.items()}
    first = _save(tmp_path, 1, tensors, asynchronous=True)
    for tensor in tensors.values():  # the training step goes on and changes the weights
        if tensor.dtype == torch.bool:
            tensor.logical_not_()
        elif tensor.numel():
            tensor.add_(1)
    expected_second = {name: _stored(t).clone() for name, t in tensors.items()}
    # A second save waits for the first before staging its own copy.
    second = _save(tmp_path, 2, tensors, asynchronous=True)
    assert first.done()
    for tensor in tensors.values():
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
    assert second.wait() == tmp_path / "step_00000002"
    assert first.wait() == tmp_path / "step_00000001"

    requests = [SliceRequest.whole(n, t.shape) for n, t in tensors.items()]
    for name, got in zip(tensors, load_slices(first.path, requests), strict=True):
        _assert_equal(got, expected[name], f"step 1 {name}")
    for name, got in zip(tensors, load_slices(second.path, requests), strict=True):
        _assert_equal(got, expected_second[name], f"step 2 {name}")
    verify_checkpoint(second.path)


def test_existing_committed_step_is_not_replaced(tmp_path):
    tensors = {"w": torch.randn(3)}
    _save(tmp_path, 1, tensors)
    before = (tmp_path / "step_00000001" / "index.json").read_bytes()
    with pytest.raises(CheckpointError, match="already committed"):
        _save(tmp_path, 1, {"w": torch.randn(3)})
    assert (tmp_path / "step_00000001" / "index.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        (
            lambda w: [
                OwnedSlice.rows("w", w.shape, 0, w[:3]),
                OwnedSlice.rows("w", w.shape, 2, w[2:]),
            ],
            r"tensor 'w': ownership overlaps: rank 0 owns \[0, 15\) and rank 0 owns \[10, 20\)",
        ),
        (
            lambda w: [
                OwnedSlice.rows("w", w.shape, 0, w[:1]),
                OwnedSlice.rows("w", w.shape, 2, w[2:]),
            ],
            r"tensor 'w': elements \[5, 10\) of 20 are owned by no rank",
        ),
        (
            lambda w: [OwnedSlice.rows("w", w.shape, 0, w[:3])],
            r"tensor 'w': elements \[15, 20\) of 20 are owned by no rank",
        ),
        (
            lambda w: [OwnedSlice.rows("w", w.shape, 3, w[:2])],
            r"tensor 'w': owned range \[15, 25\) lies outside its 20 elements",
        ),
        (
            lambda w: [OwnedSlice.whole("w", w), OwnedSlice("w", (5, 4), 0, w[:0])],
            r"tensor 'w': rank 0 declares shape \[4, 5\]",
        ),
        (
            lambda w: [OwnedSlice.whole("w", w), OwnedSlice.whole("x", w.to(torch.complex64))],
            r"dtype torch.complex64 cannot be stored",
        ),
    ],
    ids=["overlap", "gap", "missing-tail", "past-the-end", "shape-disagreement", "complex"],
)
def test_ownership_errors_are_clear_and_create_nothing(tmp_path, pieces, message):
    w = torch.randn(4, 5)
    with pytest.raises(CheckpointError, match=message) as error:
        save_checkpoint(tmp_path / "ckpt", 1, pieces(w), _category, {})
    assert "\n" not in str(error.value)
    assert not (tmp_path / "ckpt").exists()


def test_bad_categories_and_trainer_state_are_reported(tmp_path):
    w = [OwnedSlice.whole("w", torch.randn(2))]
    with pytest.raises(CheckpointError, match="tensor 'w' has no category"):
        save_checkpoint(tmp_path, 1, w, {}, {})
    with pytest.raises(CheckpointError, match="category 'a/b'"):
        save_checkpoint(tmp_path, 1, w, {"w": "a/b"}, {})
    with pytest.raises(CheckpointError, match="trainer_state is not JSON-serialisable"):
        save_checkpoint(tmp_path, 1, w, {"w": "model"}, {"rng": torch.get_rng_state()})
    with pytest.raises(CheckpointError, match="checksum_chunk_bytes=0 must be a positive integer"):
        save_checkpoint(tmp_path, 1, w, {"w": "model"}, {}, checksum_chunk_bytes=0)
    assert list(tmp_path.iterdir()) == []


def test_load_into_converts_to_the_target_dtype(tmp_path):
    step = torch.tensor([5, 6], dtype=torch.int64)
    path = _save(tmp_path, 1, {"optim.step": step, "w": torch.randn(3)}).wait()
    as_int32 = torch.zeros(2, dtype=torch.int32)
    as_double = torch.zeros(3, dtype=torch.float64)
    load_into(path, [OwnedSlice.whole("optim.step", as_int32), OwnedSlice.whole("w", as_double)])
    assert as_int32.tolist() == [5, 6]
    assert torch.equal(as_double, load_slices(path, [SliceRequest.whole("w", (3,))])[0].double())
