"""Checkpoint save / load throughput and async-save stall, against raw file I/O of the same bytes.

In one run, interleaved (the machines are shared and noisy, so ratios matter): a raw write
(one file, sequential ``write`` + ``fsync``) and raw read of the same bytes (no checks), against
``save_checkpoint`` (synchronous: every byte written, fsynced, hashed, committed),
``load_into`` (into preallocated tensors; every byte read is checked against its chunk's CRC32)
and ``verify_checkpoint`` (every file's sha256 and chunk CRC32s); and the training stall of an
asynchronous save (time until ``save_checkpoint`` returns, steady state: its staging buffer is
reused) against the synchronous save time. Reads are cold: the files are dropped from the page
cache first (``posix_fadvise(DONTNEED)`` after ``fsync``). ``--chunk-kib`` with several sizes
also times verified loads of checkpoints saved with the other checksum chunk sizes. Temporary
files are removed at the end.

    uv run python benchmarks/checkpoint.py            # ~1 GiB, writes bench_results/checkpoint.json
    uv run python benchmarks/checkpoint.py --chunk-kib 1024 256 4096   # chunk size sweep
    uv run python benchmarks/checkpoint.py --dcp      # also DCP's HuggingFaceStorageWriter, 2 ranks
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

from harness.output import print_table, write_json
from harness.ranks import run_distributed
from harness.timing import medians
from moe_checkpoint import (
    OwnedSlice,
    load_into,
    release_staging_memory,
    save_checkpoint,
    verify_checkpoint,
)

TARGETS = {
    "save_over_raw_write": 0.5,
    "verified_load_over_raw_read": 0.5,
    "async_stall_over_sync_save": 0.1,
}


def _bytes_of(tensor: Tensor) -> memoryview:
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def _drop_from_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_write(path: Path, tensors: list[Tensor]) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in tensors:
            view = _bytes_of(tensor)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done : done + (256 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _raw_read(path: Path, targets: list[Tensor]) -> float:
    _drop_from_page_cache([path])
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for target in targets:
            view = _bytes_of(target)
            done = 0
            while done < len(view):
                done += f.readinto(view[done : done + (256 << 20)])
    return time.perf_counter() - start


def _checkpoint_files(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("*.safetensors"))


def _timed_load(path: Path, slices: list[OwnedSlice], targets: list[Tensor]) -> float:
    """Cold `load_into` of every tensor into `targets`, checked against the sources."""
    _drop_from_page_cache(_checkpoint_files(path))
    for target in targets:
        target.zero_()
    start = time.perf_counter()
    load_into(
        path,
        [OwnedSlice(s.name, s.global_shape, 0, t) for s, t in zip(slices, targets, strict=True)],
    )
    seconds = time.perf_counter() - start
    assert all(torch.equal(s.data, t) for s, t in zip(slices, targets, strict=True))
    return seconds


def _timed_verify(path: Path) -> float:
    _drop_from_page_cache(_checkpoint_files(path))
    start = time.perf_counter()
    verify_checkpoint(path)
    return time.perf_counter() - start


def run(args: argparse.Namespace, work_dir: Path) -> dict:
    numel = int(args.gib * 2**30 / 4 / args.tensors)
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(numel, generator=generator) for _ in range(args.tensors)]
    targets = [torch.zeros_like(t) for t in tensors]
    nbytes = sum(t.numel() * 4 for t in tensors)
    slices = [OwnedSlice.whole(f"layers.{i}.weight", t) for i, t in enumerate(tensors)]
    root = work_dir / "checkpoints"
    raw_path = work_dir / "raw.bin"
    chunk_bytes = [kib * 1024 for kib in args.chunk_kib]
    times: dict[str, list[float]] = {
        k: []
        for k in ("raw_write", "save", "raw_read", "load", "verify", "async_stall", "async_total")
    }
    for size in chunk_bytes[1:]:
        times[f"load_chunk_{size // 1024}k"] = []
    step = 0

    def save(asynchronous: bool, chunk: int = chunk_bytes[0]) -> tuple[float, float, Path]:
        nonlocal step
        step += 1
        start = time.perf_counter()
        handle = save_checkpoint(
            root,
            step,
            slices,
            lambda name: "model",
            {"step": step},
            asynchronous=asynchronous,
            checksum_chunk_bytes=chunk,
        )
        returned = time.perf_counter()
        path = handle.wait()
        return returned - start, time.perf_counter() - start, path

    # Warm-up: one async save allocates and touches the reused staging buffer; one raw write.
    shutil.rmtree(save(asynchronous=True)[2])
    _raw_write(raw_path, tensors)
    os.remove(raw_path)
    others = {size: save(asynchronous=False, chunk=size)[2] for size in chunk_bytes[1:]}
    for _ in range(args.reps):
        times["raw_write"].append(_raw_write(raw_path, tensors))
        _, save_time, path = save(asynchronous=False)
        times["save"].append(save_time)
        times["raw_read"].append(_raw_read(raw_path, targets))
        times["load"].append(_timed_load(path, slices, targets))
        for size, other in others.items():
            times[f"load_chunk_{size // 1024}k"].append(_timed_load(other, slices, targets))
        times["verify"].append(_timed_verify(path))
        shutil.rmtree(path)
        stall, total, path = save(asynchronous=True)
        times["async_stall"].append(stall)
        times["async_total"].append(total)
        shutil.rmtree(path)
        os.remove(raw_path)
    release_staging_memory()
    median = medians(times)
    result = {
        "bytes": nbytes,
        "tensors": args.tensors,
        "reps": args.reps,
        "checksum_chunk_bytes": chunk_bytes[0],
        "median_s": median,
        "samples_s": times,
        "raw_write_gbps": nbytes / median["raw_write"] / 1e9,
        "save_gbps": nbytes / median["save"] / 1e9,
        "raw_read_gbps": nbytes / median["raw_read"] / 1e9,
        "verified_load_gbps": nbytes / median["load"] / 1e9,
        "verify_gbps": nbytes / median["verify"] / 1e9,
        "save_over_raw_write": median["raw_write"] / median["save"],
        "verified_load_over_raw_read": median["raw_read"] / median["load"],
        "verify_over_raw_read": median["raw_read"] / median["verify"],
        "async_stall_over_sync_save": median["async_stall"] / median["save"],
        "verified_load_over_raw_read_by_chunk_kib": {
            kib: median["raw_read"] / median["load" if i == 0 else f"load_chunk_{kib}k"]
            for i, kib in enumerate(args.chunk_kib)
        },
        "targets": TARGETS,
    }
    if args.dcp:
        result["dcp"] = _dcp_comparison(tensors, work_dir)
    return result


def _dcp_rank(rank: int, world_size: int, tensors: list[Tensor], out_dir: str, mode: str) -> float:
    """Each rank owns one block (dim 0) of every tensor; returns the save time on this rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard

    block = tensors[0].numel() // world_size
    local = [t[rank * block : (rank + 1) * block] for t in tensors]
    names = [f"layers.{i}.weight" for i in range(len(tensors))]
    if mode == "dcp":
        mesh = DeviceMesh("cpu", list(range(world_size)))
        state = {
            n: DTensor.from_local(t, mesh, [Shard(0)]) for n, t in zip(names, local, strict=True)
        }
    dist.barrier()
    start = time.perf_counter()
    if mode == "dcp":
        writer = HuggingFaceStorageWriter(
            out_dir,
            save_distributed=True,
            enable_consolidation=True,
            fqn_to_index_mapping=dict.fromkeys(names, 1),
        )
        dcp.save(state, storage_writer=writer)
    else:
        shape = tuple(tensors[0].shape)
        slices = [OwnedSlice(n, shape, rank * block, t) for n, t in zip(names, local, strict=True)]
        save_checkpoint(out_dir, 1, slices, lambda name: "model", {})
    dist.barrier()
    return time.perf_counter() - start


def _dcp_comparison(tensors: list[Tensor], work_dir: Path) -> dict:
    """DCP HuggingFaceStorageWriter (sharded files, then consolidation) vs moe-checkpoint,
    both at world size 2 over gloo, same tensors."""
    out = {}
    for mode in ("moe_checkpoint", "dcp"):
        target = work_dir / mode
        out[f"{mode}_s"] = max(run_distributed(_dcp_rank, 2, args=(tensors, str(target), mode)))
        shutil.rmtree(target)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--chunk-kib",
        type=int,
        nargs="+",
        default=[1024],
        help="checksum chunk size of the main checkpoint; more sizes add verified-load rows",
    )
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--out", default="bench_results/checkpoint.json")
    parser.add_argument("--dcp", action="store_true", help="also time DCP's HF writer (slow)")
    args = parser.parse_args()

    work_dir = Path(tempfile.mkdtemp(prefix="moe-checkpoint-bench-", dir=args.dir))
    try:
        result = run(args, work_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    gb = result["bytes"] / 1e9
    median = result["median_s"]
    print(
        f"checkpoint I/O: {gb:.2f} GB of fp32 in {args.tensors} tensors, median of {args.reps}, "
        f"checksum chunks of {args.chunk_kib[0]} KiB"
    )
    rows = [
        ("raw write + fsync", median["raw_write"], None, None),
        ("save_checkpoint (sync)", median["save"], result["save_over_raw_write"], ">=0.50"),
        ("raw read (cold, unchecked)", median["raw_read"], None, None),
        (
            "load_into (cold, verified)",
            median["load"],
            result["verified_load_over_raw_read"],
            ">=0.50",
        ),
    ]
    by_chunk = result["verified_load_over_raw_read_by_chunk_kib"]
    for kib in args.chunk_kib[1:]:
        rows.append((f"  same, {kib} KiB chunks", median[f"load_chunk_{kib}k"], by_chunk[kib], ""))
    rows += [
        ("verify_checkpoint (cold)", median["verify"], result["verify_over_raw_read"], ""),
        (
            "async save: stall until return",
            median["async_stall"],
            result["async_stall_over_sync_save"],
            "<=0.10",
        ),
        ("async save: return + wait", median["async_total"], None, None),
    ]
    cells = []
    for name, seconds, ratio, target in rows:
        gbps = f"{gb / seconds:.2f}" if not name.startswith("async save: stall") else ""
        ratio_text = "" if ratio is None else f"{ratio:.2f}"
        cells.append([name, f"{seconds:.3f}", gbps, ratio_text, target or ""])
    print_table(("operation", "median s", "GB/s", "ratio", "target"), cells)
    if "dcp" in result:
        dcp = result["dcp"]
        print(
            f"world 2, gloo: moe_checkpoint save {dcp['moe_checkpoint_s']:.2f} s, "
            f"DCP HuggingFaceStorageWriter (consolidating) {dcp['dcp_s']:.2f} s"
        )
    write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
