"""What the GPU check's rows share: the table and its rows, host-sync guards, the rows of the
other parts of ``gpu_check.sh``, and the checks that need no model (nvshmem4py on one PE, a
process group of one rank). Used by ``benchmarks/gpu_train_check.py``."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from harness import output
from harness.ranks import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Row:
    """One line of the table."""

    check: str
    result: str
    """ok, FAIL, timeout, skipped, or skipped (cpu)."""
    figure: str = ""
    """The measurement, or why the row failed or was skipped."""
    details: dict = dataclasses.field(default_factory=dict)
    """Everything else, for the JSON."""

    @property
    def failed(self) -> bool:
        return self.result in ("FAIL", "timeout")


def one_line(error: BaseException) -> str:
    """The error's type and first line, and where in this repository it was raised."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    ours = (str(ROOT / "packages"), str(ROOT / "benchmarks"))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(ours)]
    if frames:
        text += f" (at {Path(frames[-1].filename).relative_to(ROOT)}:{frames[-1].lineno})"
    return text


def amount(count: float, unit: str = "") -> str:
    """``count`` with a decimal prefix and three significant digits: 941M, 1.61T, 2.5k."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            return f"{count / scale:.3g}{' ' if unit else ''}{prefix}{unit}"
    return f"{count:.3g}{' ' if unit else ''}{unit}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def host_sync_forbidden(device: torch.device) -> Iterator[None]:
    """Any device-to-host synchronisation inside raises (CUDA; nothing is checked on a CPU)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def host_sync_sites(fn: Callable[[], object], device: torch.device) -> list[str]:
    """Run ``fn`` with sync debug mode "warn"; the file:line of each host sync it made."""
    if device.type != "cuda":
        fn()
        return []
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


NVSHMEM_ENV = {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}
"""One GPU, one node: no network transport, and the unique-id bootstrap over loopback (set
unless the environment already sets them)."""


def nvshmem_row(check: str, device: torch.device) -> Row:
    """nvshmem4py with one PE: started here, or found started by the nvshmem transport."""
    if device.type != "cuda":
        return Row(check, "skipped (cpu)", "NVSHMEM's heap is GPU memory")
    try:
        nvshmem = importlib.import_module("nvshmem.core")
        cuda_core = importlib.import_module("cuda.core")
        uid = nvshmem.get_unique_id()  # loads the NVSHMEM host library
        started_here = nvshmem.init_status() < nvshmem.InitStatus.STATUS_IS_INITIALIZED
        if started_here:
            cuda_device = cuda_core.Device(device.index or 0)
            cuda_device.set_current()
            nvshmem.init(device=cuda_device, uid=uid, rank=0, nranks=1, initializer_method="uid")
    except Exception as e:  # nvshmem4py's own error classes included
        return Row(check, "skipped", one_line(e))
    pes, me = nvshmem.n_pes(), nvshmem.my_pe()
    source_PN = nvshmem.tensor((pes, 4096), dtype=torch.float32)
    target_PN = nvshmem.tensor((pes, 4096), dtype=torch.float32)
    put_PN = nvshmem.tensor((pes, 4096), dtype=torch.float32)
    source_PN.copy_(torch.arange(source_PN.numel(), device=device).view_as(source_PN))
    stream = torch.cuda.current_stream(device)
    nvshmem.alltoall(nvshmem.Teams.TEAM_WORLD, target_PN, source_PN, stream=stream)
    nvshmem.put(put_PN, source_PN, remote_pe=me, stream=stream)
    nvshmem.barrier(nvshmem.Teams.TEAM_WORLD, stream=stream)
    stream.synchronize()
    alltoall_ok = torch.equal(target_PN, source_PN)
    put_ok = torch.equal(put_PN, source_PN)
    for t in (source_PN, target_PN, put_PN):
        nvshmem.free_tensor(t)
    version = nvshmem.get_version()
    if started_here:
        nvshmem.finalize()
    how = "started here" if started_here else "started by the nvshmem transport"
    figure = (
        f"{pes} PE ({how}), libnvshmem {version.libnvshmem_version}, nvshmem4py "
        f"{version.nvshmem4py_version}: alltoall {'ok' if alltoall_ok else 'WRONG'}, put to "
        f"itself {'ok' if put_ok else 'WRONG'}"
    )
    ok = pes == 1 and alltoall_ok and put_ok
    return Row(
        check, "ok" if ok else "FAIL", figure, {"env": {k: os.environ.get(k) for k in NVSHMEM_ENV}}
    )


@contextlib.contextmanager
def one_rank_process_group(device: torch.device) -> Iterator[dist.ProcessGroup]:
    """A process group of world size 1 (NCCL on a GPU, gloo on a CPU) on a free port."""
    port = free_port()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def part_rows(path: Path) -> list[Row]:
    """Rows of gpu_check.sh's other parts from its file of `check rc seconds json log` lines."""
    rows = []
    for line in path.read_text().splitlines():
        check, rc, seconds, json_path, log_path = line.split("\t")
        figure = part_figure(check, Path(json_path), Path(log_path))
        if rc == "cpu":
            rows.append(Row(check, "skipped (cpu)", figure or "needs CUDA"))
            continue
        if rc == "0":
            result, said = "ok", [figure, f"{seconds} s"]
        elif rc in ("124", "137"):
            result, said = "timeout", [f"stopped after {seconds} s", figure]
        else:
            error = last_error(Path(log_path))
            result, said = "FAIL", [f"exit {rc} after {seconds} s", error, figure]
        rows.append(Row(check, result, "; ".join(part for part in said if part)))
    return rows


def part_figure(check: str, json_path: Path, log_path: Path) -> str:
    """The headline of a part's JSON (or its log's summary line); empty if there is none."""
    try:
        if check.startswith("gpu-marked tests"):
            lines = [line.strip("= ") for line in log_path.read_text().splitlines()]
            return next((line for line in reversed(lines) if " in " in line), "")
        data = json.loads(json_path.read_text())
        if check.startswith("gpu_dispatch"):
            return "; ".join(
                f"{r['backend']} {r['ms']:.2f} ms" + (f" ERROR {r['error']}" if r["error"] else "")
                for r in data["rows"]
            )
        if check.startswith("gpu_moe_layer"):
            return "; ".join(
                f"{r['path']} {r['over_dense']:.2f}x dense, sync {r['host_sync']}"
                if "error" not in r
                else f"{r['path']} ERROR {r['error']}"
                for r in data["rows"]
            )
        if check.startswith("grouped_mm_backends"):
            by_shape: dict[str, list[str]] = {}
            for r in data:
                shape = f"{r['rows']},{r['experts']},{r['k']},{r['n']}"
                by_shape.setdefault(shape, []).append(
                    f"{r['variant'].split()[0]} {r['tflops']:.1f}"
                )
            return "; ".join(f"{shape}: {', '.join(v)} TFLOP/s" for shape, v in by_shape.items())
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return ""


def last_error(log_path: Path) -> str:
    try:
        lines = [line.strip() for line in log_path.read_text().splitlines() if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or [""])[-1][:160]


def print_table(rows: list[Row]) -> None:
    print()
    output.print_table(
        ("check", "result", "figure"),
        ([row.check, row.result, row.figure] for row in rows),
        left=("result", "figure"),
    )
