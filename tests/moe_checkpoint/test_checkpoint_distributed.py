"""Saves written in parallel by several gloo ranks, each owning different pieces, read back
exactly at other world sizes; inconsistent ownership fails on every rank without a hang.

One spawn of four processes: ranks 0-1 save as a group of two (``group=``), then all four
load other slices (and save again, cut differently), and read their own expert rows of a copy
damaged in one rank's rows; the test process loads at world 1.
"""

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import Tensor

from harness.ranks import run_distributed
from moe_checkpoint import (
    CheckpointError,
    OwnedSlice,
    SliceRequest,
    latest_checkpoint,
    load_into,
    load_slices,
    read_trainer_state,
    save_checkpoint,
    verify_checkpoint,
)

E, H, D = 4, 6, 5
MASTER_NUMEL = 77
MAX_FILE_BYTES = 512  # several files per category, some written by several ranks
CHUNK = 64  # checksum chunk bytes: ranks' pieces start and end inside chunks
SAVE = {"max_file_bytes": MAX_FILE_BYTES, "checksum_chunk_bytes": CHUNK}


def _category(name: str) -> str:
    return "optim" if name.startswith("optim.") else "model"


def reference_tensors(scale: float = 1.0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "layers.0.experts.w1": torch.randn(E, H, D, generator=g),
        "layers.0.attn.qkv": torch.randn(8, 5, generator=g),
        "layers.0.norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "optim.layers.0.experts.w1.exp_avg": torch.randn(E, H, D, generator=g),
        "optim.master": torch.randn(MASTER_NUMEL, generator=g),
        "optim.step": torch.tensor([7], dtype=torch.int64),
    }
    return {n: t * scale if t.is_floating_point() else t for n, t in tensors.items()}


def _stored(tensor: Tensor) -> Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor


def _ragged_bounds(numel: int, world_size: int, shift: int) -> list[int]:
    """Uneven cut points that need not fall on row boundaries."""
    inner = [min(numel, numel * k * k // world_size**2 + shift) for k in range(1, world_size)]
    return [0, *inner, numel]


def owned_slices(
    tensors: dict[str, Tensor], rank: int, world_size: int, shift: int
) -> list[OwnedSlice]:
    """Expert rows split over ranks, ragged flat shards of optimizer state, replicated dense
    tensors each owned by one rank (the first, or the last)."""
    rows = E // world_size
    w1 = tensors["layers.0.experts.w1"]
    mine = w1[rank * rows : (rank + 1) * rows]
    slices = [OwnedSlice.rows("layers.0.experts.w1", w1.shape, rank * rows, mine)]
    for name in ("optim.layers.0.experts.w1.exp_avg", "optim.master"):
        flat = tensors[name].reshape(-1)
        bounds = _ragged_bounds(flat.numel(), world_size, shift)
        piece = flat[bounds[rank] : bounds[rank + 1]].clone()
        slices.append(OwnedSlice(name, tuple(tensors[name].shape), bounds[rank], piece))
    if rank == 0:
        qkv = tensors["layers.0.attn.qkv"]
        slices.append(OwnedSlice.whole("layers.0.attn.qkv", qkv.t().contiguous().t()))  # strided
        slices.append(OwnedSlice.whole("optim.step", tensors["optim.step"]))
    if rank == world_size - 1:
        slices.append(OwnedSlice.whole("layers.0.norm.weight", tensors["layers.0.norm.weight"]))
    return slices


def _plain(tensor: Tensor) -> tuple[str, list]:
    """Tensors returned from spawned ranks travel as lists (exact for every dtype used here)."""
    return str(tensor.dtype).removeprefix("torch."), tensor.tolist()


def _tensor(plain: tuple[str, list]) -> Tensor:
    dtype, values = plain
    return torch.tensor(values, dtype=getattr(torch, dtype))


def _error_of(call) -> str | None:
    try:
        call()
    except CheckpointError as e:
        return str(e)
    return None


def _save_as_pair(rank: int, root: str, pair: dist.ProcessGroup) -> dict:
    """Ranks 0 and 1 save steps 1 (sync) and 2 (async), then try three broken saves."""
    results = {}
    save = dict(group=pair, **SAVE)
    slices = owned_slices(reference_tensors(), rank, 2, shift=3)
    save_checkpoint(root, 1, slices, _category, {"topology": {"dp": 2}}, **save)

    slices = owned_slices(reference_tensors(scale=2.0), rank, 2, shift=5)
    handle = save_checkpoint(root, 2, slices, _category, {"step": 2}, asynchronous=True, **save)
    for piece in slices:  # training goes on
        if piece.data.is_floating_point():
            piece.data.fill_(float("nan"))
    handle.wait()

    # Rank 1 also claims expert row 1 (rank 0's): overlap. Then nobody owns row 1: gap.
    w1 = reference_tensors()["layers.0.experts.w1"]
    name = "layers.0.experts.w1"
    good = [s for s in owned_slices(reference_tensors(), rank, 2, 3) if s.name != name]
    start = 1 if rank else 0
    overlap = OwnedSlice.rows(name, w1.shape, start, w1[start : start + 2 + rank])
    results["overlap"] = _error_of(
        lambda: save_checkpoint(root, 3, [*good, overlap], _category, {}, **save)
    )
    gap = OwnedSlice.rows(name, w1.shape, 2 * rank, w1[2 * rank : 2 * rank + 1])
    results["gap"] = _error_of(
        lambda: save_checkpoint(root, 3, [*good, gap], _category, {}, **save)
    )
    # A problem only one rank can see is reported by every rank.
    bad_category = {} if rank == 1 else _category
    results["local"] = _error_of(lambda: save_checkpoint(root, 3, slices, bad_category, {}, **save))
    results["chunks"] = _error_of(
        lambda: save_checkpoint(
            root, 3, slices, _category, {}, group=pair, checksum_chunk_bytes=CHUNK * (1 + rank)
        )
    )
    return results


def _load_at_four(rank: int, world_size: int, root: str, root4: str) -> dict:
    ckpt = latest_checkpoint(root)
    tensors = reference_tensors(scale=2.0)
    w1 = tensors["layers.0.experts.w1"]
    master = _ragged_bounds(MASTER_NUMEL, world_size, shift=1)
    row, shard = load_slices(
        ckpt,
        [
            SliceRequest.rows("layers.0.experts.w1", w1.shape, rank, rank + 1),
            SliceRequest(
                "optim.master", (MASTER_NUMEL,), master[rank], master[rank + 1] - master[rank]
            ),
        ],
    )
    # load_into the pieces this rank owns at world 4 (the bf16 norm goes back to bf16).
    mine = owned_slices({n: torch.zeros_like(t) for n, t in tensors.items()}, rank, 4, shift=2)
    load_into(ckpt, mine)
    # The same tensors saved by four ranks, cut differently, give byte-identical files.
    resaved = owned_slices(tensors, rank, world_size, shift=2)
    path = save_checkpoint(root4, 2, resaved, _category, {}, **SAVE).wait()
    return {
        "expert_row": _plain(row),
        "master_shard": _plain(shard),
        "owned": {f"{s.name}@{s.flat_start}": _plain(s.data) for s in mine},
        "resaved": str(path),
    }


def _read_rows_of_damaged_copy(rank: int, root4: str) -> str | None:
    """Rank 0 copies the checkpoint and flips a byte in expert row 3's last chunk (bytes
    [448, 480) of the tensor, which no other row touches); each rank then reads its own row."""
    ckpt = Path(root4).parent / "damaged" / "step_00000002"
    name = "layers.0.experts.w1"
    if rank == 0:
        shutil.copytree(Path(root4) / "step_00000002", ckpt)
    dist.barrier()
    record = json.loads((ckpt / "index.json").read_text())["tensors"][name]
    if rank == 0:
        data = bytearray((ckpt / record["file"]).read_bytes())
        data[record["byte_range"][0] + 7 * CHUNK + 5] ^= 0x10
        (ckpt / record["file"]).write_bytes(bytes(data))
    dist.barrier()
    return _error_of(
        lambda: load_slices(ckpt, [SliceRequest.rows(name, (E, H, D), rank, rank + 1)])
    )


def _save_at_two_then_load_at_four(rank: int, world_size: int, root: str, root4: str) -> dict:
    pair = dist.new_group([0, 1])  # every rank takes part in creating a group
    results = _save_as_pair(rank, root, pair) if rank < 2 else {}
    dist.barrier()
    results.update(_load_at_four(rank, world_size, root, root4))
    results["damaged_row"] = _read_rows_of_damaged_copy(rank, root4)
    return results


def _read_with_safe_open(path: Path) -> dict[str, Tensor]:
    found = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                found[name] = f.get_tensor(name)
    return found


def test_save_at_two_ranks_load_at_one_and_four(tmp_path):
    root, root4 = tmp_path / "ckpt", tmp_path / "ckpt4"
    per_rank = run_distributed(
        _save_at_two_then_load_at_four, world_size=4, args=(str(root), str(root4))
    )

    # Both saving ranks see the same clear error, naming the tensor; no hang, nothing left.
    for key, message in [
        (
            "overlap",
            "tensor 'layers.0.experts.w1': ownership overlaps: rank 0 owns [0, 60) "
            "and rank 1 owns [30, 120) of 120 elements",
        ),
        ("gap", "tensor 'layers.0.experts.w1': elements [30, 60) of 120 are owned by no rank"),
        ("local", "rank 1: tensor 'layers.0.experts.w1' has no category"),
        ("chunks", "the ranks save different checksum_chunk_bytes: [64, 128] (by rank)"),
    ]:
        assert per_rank[0][key] == per_rank[1][key] == message, (key, per_rank[0][key])
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    assert read_trainer_state(root / "step_00000001") == {"topology": {"dp": 2}}
    index = json.loads((root / "step_00000001" / "index.json").read_text())
    assert index["saved_world_size"] == 2
    assert len({t["file"] for t in index["tensors"].values()}) >= 4

    # World 1 (this process), with project code and with plain safetensors.
    for step, scale in ((1, 1.0), (2, 2.0)):
        path = root / f"step_{step:08d}"
        verify_checkpoint(path)
        expected = {n: _stored(t) for n, t in reference_tensors(scale).items()}
        loaded = load_slices(path, [SliceRequest.whole(n, t.shape) for n, t in expected.items()])
        plain = _read_with_safe_open(path)
        for (name, want), got in zip(expected.items(), loaded, strict=True):
            assert torch.equal(got, want), f"step {step} {name}: load_slices differs"
            assert torch.equal(plain[name], want), f"step {step} {name}: safe_open differs"

    # World 4, other slices.
    expected = {n: _stored(t) for n, t in reference_tensors(2.0).items()}
    bounds = _ragged_bounds(MASTER_NUMEL, 4, shift=1)
    for rank, loaded in enumerate(per_rank):
        want_row = expected["layers.0.experts.w1"][rank : rank + 1]
        assert torch.equal(_tensor(loaded["expert_row"]), want_row), f"rank {rank} row"
        want_shard = expected["optim.master"][bounds[rank] : bounds[rank + 1]]
        assert torch.equal(_tensor(loaded["master_shard"]), want_shard), f"rank {rank} shard"
        for piece in owned_slices(reference_tensors(2.0), rank, 4, shift=2):
            got = _tensor(loaded["owned"][f"{piece.name}@{piece.flat_start}"])
            assert torch.equal(got, piece.data), f"rank {rank} load_into {piece.name}"
    # Four ranks, cut differently, give the same files and the same chunk checksums.
    resaved = Path(per_rank[0]["resaved"])
    for file in (root / "step_00000002").glob("*.safetensors"):
        assert file.read_bytes() == (resaved / file.name).read_bytes(), f"{file.name} differs"
    by_two = json.loads((root / "step_00000002" / "index.json").read_text())
    by_four = json.loads((resaved / "index.json").read_text())
    assert (by_two["saved_world_size"], by_four["saved_world_size"]) == (2, 4)
    for key in ("tensors", "files", "chunk_bytes"):
        assert by_two[key] == by_four[key], key

    # Only rank 3 reads the damaged chunk; ranks 0-2 read their rows undisturbed.
    assert [r["damaged_row"] is None for r in per_rank] == [True, True, True, False]
    record = by_four["tensors"]["layers.0.experts.w1"]
    begin, end = record["byte_range"]
    pattern = (
        rf".*/{record['file']}: tensor 'layers.0.experts.w1': checksum mismatch in chunk 7 "
        rf"\(file bytes \[{begin + 7 * CHUNK}, {end}\)\): crc32 [0-9a-f]{{8}}, "
        r"index.json records [0-9a-f]{8}"
    )
    assert re.fullmatch(pattern, per_rank[3]["damaged_row"]), per_rank[3]["damaged_row"]
