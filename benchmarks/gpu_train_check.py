"""GPU check that trains: a ~1B-parameter MoE for 20 steps (bf16, rowwise FP8) on one GPU, and the step's parts.

Rows, in order (each reports and goes on; one table at the end, JSON in
``bench_results/gpu_check.json``):

- train: ``moe_train.train`` end to end on ``builtin:stdlib`` for 20 steps, bf16 compute on
  bf16 parameters (FP32 masters in the optimizer). The model is OLMoE-1B-7B's width, heads and
  expert width with 8 of its 16 layers and 16 of its 64 experts at top-2 (its 1-in-8 routing)
  and the byte-level vocabulary of the built-in data: 0.94B parameters, 0.24B active. Reports
  tokens/s and MFU (medians after the first steps; MFU over the data-sheet bf16 dense peak
  that ``moe_train.train.peak_flops`` finds for the GPU) and the peak of
  ``torch.cuda.max_memory_allocated`` over the steps.
- train (fp8_rowwise experts; and linears): the same run with
  ``precision.expert_gemm=fp8_rowwise`` (``torch._scaled_grouped_mm`` on SM90+), and with
  ``precision.linear=fp8_rowwise`` as well (torchao's float8 training: skipped where torchao is
  not installed). MFU stays over the bf16 peak, so the rows compare with the bf16 one.
- sync-free step (local, rowwise): one whole training step of the trainer's ``StepRunner``
  (router, dispatch, experts, combine, backward, gradient reduction and clipping, optimizer
  update, balancing biases) under ``torch.cuda.set_sync_debug_mode("error")``, around the
  step's one deliberate host read (its loss and routing figures, which with the gradient norm
  decide whether the step is applied). The model is the trained one cut to 2 layers, one
  micro-batch per step.
  The trainer builds ``local`` at ep = 1 (every backend reduces to it), so the rowwise row puts
  a ``RowwiseDispatcher`` over the trainer's one-rank EP group (a process group of world 1)
  into every MoE layer; rowwise runs at ep = 1, its exchange then being a copy to itself. The
  figure counts the host syncs of the unsplit ``train_step`` (sync debug mode "warn").
- grouped GEMM: ``moe_kernels.grouped_mm`` with the Triton and the torch backends, forward +
  backward at the trained model's gate_up shape (``benchmarks/grouped_mm_backends.py``'s
  timing), against a dense matmul of the same FLOPs.
- FP8 grouped GEMM: ``moe_kernels.fp8_rowwise_grouped_mm`` against ``grouped_mm`` in bf16,
  forward + backward at the trained model's gate_up and down shapes, and their agreement
  (within e4m3 rounding). On a CPU the emulation runs (agreement checked, speeds mean nothing).
- rowwise exchange (all_to_all, nvshmem): one transport exchange of a layer's dispatch block at
  ep = 1 through ``moe_dispatch.make_row_transport(name, group)``, checked for the bytes sent
  and timed under the sync debug mode; nvshmem reports "skipped: <reason>" when nvshmem4py or
  the transport cannot start here.
- nvshmem4py (1 PE): NVSHMEM started with one PE (or found started by the nvshmem transport),
  an all-to-all and a put to itself on the symmetric heap.

With ``--parts FILE`` the rows of ``benchmarks/gpu_check.sh``'s other parts (their exit
status, time and headline figure) open the table. ``--device cpu`` is the dry run that CI
runs: the same code paths with a tiny model and a few steps, the CUDA-only checks reported as
"skipped (cpu)"; it exits 1 when any row fails, like the GPU run.

    bash benchmarks/gpu_check.sh                               # on the GPU machine, all parts
    uv run python benchmarks/gpu_train_check.py --device cpu  # this script's dry run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from gpu_check_kernels import exchange_row, fp8_gemm_row, grouped_gemm_row
from gpu_check_support import (
    NVSHMEM_ENV,
    Row,
    amount,
    host_sync_forbidden,
    host_sync_sites,
    nvshmem_row,
    one_line,
    one_rank_process_group,
    part_rows,
    print_table,
    synchronize,
)
from harness.output import write_json
from harness.processes import benchmark_run_overrides
from moe_plan.config import Config, load_config
from moe_train.model import count_params
from moe_train.parallelize import layer_dispatchers
from moe_train.train import peak_flops, read_metrics, train
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "configs" / "olmoe-1b-7b.yaml"

MODEL_1B = (
    "--model.vocab_size=320",
    "--model.n_layers=8",
    "--model.moe.num_experts=16",
    "--model.moe.top_k=2",
    "--data.paths=[builtin:stdlib]",
    "--model.moe.capacity_factor=null",
    "--parallel.ep=1",
    "--parallel.dispatcher=auto",
    "--precision.compute_dtype=bfloat16",
    "--precision.param_dtype=bfloat16",
    "--optim.warmup_steps=5",
)
"""Overrides of configs/olmoe-1b-7b.yaml: its d_model 2048, 16 heads, QK-norm and expert width
1024; 8 layers, 16 experts at top-2 (OLMoE's 1-in-8 routing), dropless (the rowwise row sets
its own capacity), the built-in byte-level data.
0.94B parameters, 0.24B active."""

BATCH_GPU = ("--data.seq_len=2048", "--data.global_batch_size=32", "--data.micro_batch_size=8")
"""4 micro-batches of 8 x 2048 tokens: 65,536 tokens per step."""

TINY = (
    "--model.d_model=64",
    "--model.n_heads=4",
    "--model.n_kv_heads=4",
    "--model.n_layers=2",
    "--model.moe.num_experts=4",
    "--model.moe.expert_hidden=32",
    "--data.seq_len=32",
    "--data.global_batch_size=4",
    "--data.micro_batch_size=2",
)
"""The dry run's model and batch, applied over MODEL_1B: the same config keys, CPU-sized."""

STEP_ROWS = ("--model.n_layers=2",)
"""The sync-free step rows: the trained model cut to 2 layers (and one micro-batch per step)."""

ROWWISE = (
    "--model.moe.capacity_factor=1.25",
    "--parallel.dispatcher=rowwise",
    "--parallel.rowwise_transport=all_to_all",
)
"""The rowwise step row: capacity-bounded routing (rowwise needs a capacity), over the padded
all-to-all transport (gpu_dispatch.py checks symmetric memory against it)."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each row runs: the GPU check's sizes, or the dry run's."""

    overrides: tuple[str, ...]
    steps: int
    """Training steps of the train row."""
    warmup: int
    """First steps left out of the train row's medians."""
    step_reps: int
    """Checked steps per dispatcher."""
    gemm_reps: int
    """Timed grouped GEMMs per backend."""
    exchange_reps: int
    """Timed exchanges per transport."""


FP8_EXPERTS = ("--precision.expert_gemm=fp8_rowwise",)
FP8_LINEARS = (*FP8_EXPERTS, "--precision.linear=fp8_rowwise")
"""The FP8 train rows: rowwise FP8 expert GEMMs; and linear layers too."""

GPU_SIZES = Sizes(
    overrides=MODEL_1B + BATCH_GPU, steps=20, warmup=5, step_reps=3, gemm_reps=5, exchange_reps=10
)
DRY_RUN_SIZES = Sizes(
    overrides=MODEL_1B + TINY, steps=3, warmup=1, step_reps=1, gemm_reps=1, exchange_reps=2
)


def build_config(sizes: Sizes, *extra: str) -> Config:
    return load_config(BASE_CONFIG, [*sizes.overrides, *extra])


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- train ----------------------------------------------------------------------------


def train_row(
    check: str,
    sizes: Sizes,
    device: torch.device,
    peak: float,
    peak_source: str,
    root: Path,
    precision: tuple[str, ...] = (),
) -> Row:
    """Train the model for ``sizes.steps`` steps (with the ``precision`` overrides);
    throughput, MFU and peak memory."""
    if any("linear=fp8" in o for o in precision) and importlib.util.find_spec("torchao") is None:
        return Row(check, "skipped", "FP8 linears need torchao, not installed here")
    run_dir = root / ("train" + "".join(o.rpartition("=")[2] for o in precision))
    config = build_config(sizes, *precision, *benchmark_run_overrides(sizes.steps, run_dir, peak))
    params = count_params(config.model)
    result = train(config, device=device)
    if result.stopped_by is not None:  # the trainer took gpu_check.sh's SIGTERM as a stop
        raise OutOfTime
    losses, metrics_path = list(result.losses), result.run_dir / "metrics.jsonl"
    del result
    free_memory(device)
    records = read_metrics(metrics_path)
    timed = records[sizes.warmup :]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed)
    mfu = statistics.median(r["mfu"] for r in timed)
    peak_mem = max(r["peak_mem_bytes"] for r in records)
    data = config.data
    finite = all(math.isfinite(loss) for loss in losses)
    memory = "peak allocated" if device.type == "cuda" else "peak RSS"
    figure = (
        f"{amount(params.total)} params ({amount(params.active)} active), "
        f"{tokens_per_s:,.0f} tok/s, MFU {100 * mfu:.1f}% of {amount(peak, 'FLOP/s')}, "
        f"{memory} {peak_mem / 2**30:.1f} GiB, loss {losses[0]:.2f} -> {losses[-1]:.2f}"
    )
    return Row(
        check,
        "ok" if finite else "FAIL",
        figure if finite else f"non-finite loss: {losses}",
        {
            "overrides": [*config_overrides(sizes), *precision],
            "total_params": params.total,
            "active_params": params.active,
            "tokens_per_step": data.global_batch_size * data.seq_len,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "peak_flops": peak,
            "peak_flops_source": peak_source,
            "peak_mem_bytes": peak_mem,
            "losses": losses,
            "steps_timed": len(timed),
            "metrics": records,
        },
    )


def config_overrides(sizes: Sizes) -> tuple[str, ...]:
    return (f"config {BASE_CONFIG.relative_to(ROOT)}", *sizes.overrides)


# ---- sync-free step ---------------------------------------------------------------------


def checked_step(runner: StepRunner, batch: Tensor, lr: float, device: torch.device) -> float:
    """``StepRunner.train_step`` in its phases, the device work with host syncs forbidden;
    returns the step's seconds."""
    micro_batches = runner.my_micro_batches(batch)  # the host-to-device copy
    synchronize(device)
    start = time.perf_counter()
    with host_sync_forbidden(device):
        lm_loss_sum = runner.forward_backward(micro_batches)
        runner.optimizer.finish()
        runner.optimizer.clip_grad_norm_(runner.grad_clip)
    # The step's host read of its loss and routing figures, which (with the gradient norm, left
    # on the device here) decide whether the step is applied.
    stats = runner.step_stats(lm_loss_sum)
    with host_sync_forbidden(device):
        runner.apply(lr, stats)
        runner.optimizer.zero_grad()
    synchronize(device)
    return time.perf_counter() - start


def step_row(check: str, config: Config, sizes: Sizes, device: torch.device) -> Row:
    """A warm-up step, the host syncs of one whole train_step, then checked steps (with the
    rowwise dispatcher when ``config.parallel.dispatcher`` names it)."""
    runtime = start_runtime(config, device)
    try:
        # The rowwise dispatcher even at ep = 1 (the trainer's choice there is local), its
        # transport over the runtime's EP group of one.
        rowwise = config.parallel.dispatcher == "rowwise"
        dispatchers = (
            layer_dispatchers(config, runtime.layout.ep_group, device, backend="rowwise")
            if rowwise
            else None
        )
        runner = StepRunner(config, runtime, dispatchers=dispatchers)
        data, lr = config.data, config.optim.lr
        generator = torch.Generator().manual_seed(0)
        batch = torch.randint(
            0,
            config.model.vocab_size,
            (data.global_batch_size, data.seq_len + 1),
            generator=generator,
        )
        runner.train_step(batch, lr)  # first-step allocations and kernel choices
        sites = host_sync_sites(lambda: runner.train_step(batch, lr), device)
        seconds = [checked_step(runner, batch, lr, device) for _ in range(sizes.step_reps)]
    finally:
        runtime.close(clean=True)
        free_memory(device)
    step_ms = 1e3 * statistics.median(seconds)
    tokens = data.global_batch_size * data.seq_len
    details = {"step_ms": step_ms, "tokens_per_step": tokens, "train_step_sync_sites": sites}
    if device.type != "cuda":
        return Row(check, "skipped (cpu)", f"step ran ({step_ms:.0f} ms); no sync check", details)
    distinct = ", ".join(sorted(set(sites)))
    figure = (
        f"no host sync; {step_ms:.1f} ms/step of {tokens:,} tokens; unsplit train_step: "
        f"{len(sites)} syncs ({distinct or 'none'})"
    )
    return Row(check, "ok", figure, details)


class OutOfTime(BaseException):
    """SIGTERM, from gpu_check.sh's time limit: stop, and print the rows there are."""


def stop_on_sigterm(signum: int, frame: object) -> None:
    raise OutOfTime


# ---- the other parts of gpu_check.sh -------------------------------------------------------


# ---- table --------------------------------------------------------------------------------


def environment(device: torch.device) -> dict:
    facts = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    with contextlib.suppress(ImportError):
        import triton

        facts["triton"] = triton.__version__
    return facts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes (implied by --device cpu)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=160.0,
        help="seconds; a row that would end after them is skipped (default 160)",
    )
    parser.add_argument("--parts", type=Path, help="gpu_check.sh's file of its other parts")
    parser.add_argument("--out", type=Path, default=Path("bench_results/gpu_check.json"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu for the dry run")
    return args


class Checks:
    """Runs the rows within a time budget and keeps their results."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.started = time.monotonic()
        self.rows: list[Row] = []

    def run(self, check: str, needs_s: float, fn: Callable[[str], Row]) -> None:
        """Row ``check`` from ``fn(check)``, unless fewer than ``needs_s`` of the budget are left."""
        if time.monotonic() - self.started + needs_s > self.budget_s:
            self.rows.append(Row(check, "skipped", f"not started: --budget-s={self.budget_s:g}"))
            return
        began = time.monotonic()
        try:
            row = fn(check)
        except OutOfTime:
            self.rows.append(
                Row(check, "timeout", "stopped by SIGTERM (gpu_check.sh's time limit)")
            )
            raise
        except Exception as e:  # one table for the whole check: report and go on
            row = Row(check, "FAIL", one_line(e))
            traceback.print_exc()
        row.details["seconds"] = round(time.monotonic() - began, 1)
        self.rows.append(row)
        print(f"[gpu_train_check] {row.check}: {row.result}  {row.figure}", flush=True)


def run_checks(checks: Checks, sizes: Sizes, device: torch.device) -> None:
    """Every row, in order: training, the sync-free steps, the grouped GEMM, the rowwise
    exchanges and nvshmem4py."""
    run = checks.run
    peak, peak_source = peak_flops(torch.bfloat16, device, None)
    one_micro_batch = f"--data.global_batch_size={build_config(sizes).data.micro_batch_size}"
    step_config = build_config(sizes, *STEP_ROWS, one_micro_batch)
    rowwise_config = build_config(sizes, *STEP_ROWS, *ROWWISE, one_micro_batch)
    with tempfile.TemporaryDirectory() as tmp:
        run(
            f"train {sizes.steps} steps (bf16, local)",
            0,
            lambda check: train_row(check, sizes, device, peak, peak_source, Path(tmp)),
        )
        for label, precision in (
            ("fp8_rowwise experts", FP8_EXPERTS),
            ("fp8_rowwise experts + linears", FP8_LINEARS),
        ):
            run(
                f"train {sizes.steps} steps ({label}, local)",
                40,
                lambda check, precision=precision: train_row(
                    check, sizes, device, peak, peak_source, Path(tmp), precision
                ),
            )
    run("sync-free step (local)", 20, lambda check: step_row(check, step_config, sizes, device))
    run(
        "grouped GEMM fwd+bwd (triton vs torch)",
        45,
        lambda check: grouped_gemm_row(check, build_config(sizes), sizes.gemm_reps, device),
    )
    run(
        "FP8 grouped GEMM fwd+bwd (fp8_rowwise vs bf16)",
        15,
        lambda check: fp8_gemm_row(check, build_config(sizes), sizes.gemm_reps, device),
    )
    with contextlib.ExitStack() as stack:
        try:
            group = stack.enter_context(one_rank_process_group(device))
        except Exception as e:  # the rows that need a process group cannot run
            group = None
            checks.rows.append(Row("process group of world 1", "FAIL", one_line(e)))
        if group is not None:
            run(
                "sync-free step (rowwise)",
                20,
                lambda check: step_row(check, rowwise_config, sizes, device),
            )
            for name in ("all_to_all", "nvshmem"):
                run(
                    f"rowwise exchange ({name}, ep=1)",
                    10,
                    lambda check, name=name: exchange_row(
                        check, name, rowwise_config, sizes.exchange_reps, device, group
                    ),
                )
        run("nvshmem4py (1 PE)", 10, lambda check: nvshmem_row(check, device))


def main() -> int:
    args = parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    sizes = DRY_RUN_SIZES if args.dry_run or device.type == "cpu" else GPU_SIZES
    if device.type == "cuda":
        torch.cuda.set_device(device)
        for key, value in NVSHMEM_ENV.items():
            os.environ.setdefault(key, value)
    else:
        # Triton's kernels run on a CPU only interpreted; read when they are first decorated.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    rows = part_rows(args.parts) if args.parts else []
    checks = Checks(args.budget_s)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        run_checks(checks, sizes, device)
    except OutOfTime:
        print("[gpu_train_check] stopped by SIGTERM: the rows so far", flush=True)
    rows += checks.rows
    print_table(rows)
    document = {
        "environment": environment(device),
        "sizes": "dry run" if sizes is DRY_RUN_SIZES else "gpu",
        "config": list(config_overrides(sizes)),
        "seconds": round(time.monotonic() - checks.started, 1),
        "rows": [dataclasses.asdict(row) for row in rows],
    }
    write_json(args.out, document, default=str)
    return 1 if any(row.failed for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
