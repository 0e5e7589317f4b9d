"""Training-step throughput and MFU of the tiny, medium and bench-14m configs: fp32, bf16
compute on fp32 parameters, and bf16 parameters (`PRECISIONS`).

MFU is model FLOPs (6 x active parameters + causal attention) per second over the peak
matmul rate of this machine, measured once per dtype at the start of this run and shared by
every row, so the rows compare within one run. Each row trains in a fresh process, so that
no row inherits the allocator state of the one before (``harness.processes``). The first
steps of each run warm up caches and kernel choices and are left out of the medians.
bench-14m is the reference trainer's benchmark model (``BENCH_14M``), built as overrides of
configs/tiny.yaml.

With ``--breakdown`` each row also profiles one optimizer step (after the warm-up steps) and
splits its self time into matmul kernels, attention kernels (together the work MFU counts),
copies and dtype casts (one class: both run as ``copy_``), the optimizer and everything else;
"outside" is the share of all but the first two. The MFU ceiling is model FLOPs over the
matmul-and-attention time alone times the peak: the MFU this step would reach if everything
else took no time at all, with the kernels this torch build has for these shapes.

    uv run python benchmarks/train_step.py [--configs tiny medium bench-14m]
        [--dtypes float32 bfloat16 bf16-params] [--compile] [--steps 8] [--warmup 3] [--breakdown]
        [--out bench_results/train_step.json]
"""

import argparse
import re
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from harness import output
from harness.processes import benchmark_run_overrides, json_from_fresh_process
from moe_plan.config import Config, load_config
from moe_train.model import count_params, flops_per_token
from moe_train.train import measure_matmul_peak, read_metrics, train
from moe_train.train.host_memory import allocated_host_bytes, keep_freed_host_memory
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner

CONFIG_DIR = Path(__file__).parents[1] / "configs"
PRECISIONS: dict[str, tuple[str, ...]] = {
    "float32": ("--precision.compute_dtype=float32",),
    "bfloat16": ("--precision.compute_dtype=bfloat16", "--precision.param_dtype=float32"),
    "bf16-params": ("--precision.compute_dtype=bfloat16", "--precision.param_dtype=bfloat16"),
}
"""Row dtype: fp32; bf16 compute on fp32 parameters (autocast); bf16 parameters with FP32
masters in the optimizer."""
PEAK_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16-params": torch.bfloat16}

BENCH_14M = (
    "--model.vocab_size=1024",
    "--model.d_model=256",
    "--model.n_layers=4",
    "--model.n_heads=4",
    "--model.n_kv_heads=4",
    "--model.qk_norm=true",
    "--model.dense_layers=0",
    "--model.moe.num_experts=8",
    "--model.moe.top_k=2",
    "--model.moe.expert_hidden=512",
    "--model.moe.shared_experts=0",
    "--data.seq_len=256",
    "--data.global_batch_size=4",
    "--data.micro_batch_size=4",
)
"""The model of benchmarks/olmo_core_compare.py (14.2M parameters); tiny.yaml's other keys
(router, losses, optimizer) stay."""

ROWS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tiny": ("tiny", ()),
    "medium": ("medium", ()),
    "bench-14m": ("tiny", BENCH_14M),
}
"""Row name: (config file in configs/, overrides)."""

TIME_CLASSES: tuple[tuple[str, re.Pattern], ...] = (
    (
        "matmul",
        re.compile(
            r"aten::(mm|addmm|addbmm|bmm|baddbmm|_grouped_mm|_scaled_mm(_v2)?"
            r"|_scaled_grouped_mm(_v2)?)"
        ),
    ),
    (
        "attention",
        re.compile(
            r"aten::(_scaled_dot_product_\w+_attention\w*|_scaled_dot_product_attention_math\w*"
            r"|_(flash|efficient|cudnn)_attention_\w+)"
        ),
    ),
    ("copies+casts", re.compile(r"aten::(copy_|_to_copy)")),
    ("optimizer", re.compile(r"aten::_fused_adamw_")),
)
"""Profiler op names of each class (by self time); every other op counts as "other".

Only the ops that hold a product's work match, so none counts twice or takes its wrapper's
autocast casts: aten::matmul and aten::linear call aten::mm, addmm or bmm, and
aten::scaled_dot_product_attention one of the fused kernels (flash, efficient, cudnn, the
CPU's flash_attention_for_cpu) or the math fallback. aten::_grouped_mm runs moe_kernels'
grouped_mm, also inside the MXFP8 emulation (whose quantization counts as casts and other);
on the CPU it calls aten::mm once per group, and its own time is that loop. torchao's MXFP8
GEMMs are aten::_scaled_grouped_mm and aten::_scaled_mm."""

MATMUL_CLASSES = ("matmul", "attention")
"""The classes whose time MFU counts; the rest of the step is "outside"."""

TOP_OPS = 12
"""How many of the ops with the most self time outside matmul and attention a breakdown
lists per row."""


def profile_step(config: Config, peak: float, warmup: int) -> dict:
    """Time shares of one profiled optimizer step and the MFU ceiling of its matmuls."""
    keep_freed_host_memory()
    runtime = start_runtime(config)
    try:
        runner = StepRunner(config, runtime)
        data = config.data
        generator = torch.Generator().manual_seed(0)
        batch = torch.randint(
            0,
            config.model.vocab_size,
            (data.global_batch_size, data.seq_len + 1),
            generator=generator,
        )

        def step() -> None:
            runner.train_step(batch, 1e-4)

        for _ in range(warmup):
            step()
        started = time.perf_counter()
        step()
        plain_step_s = time.perf_counter() - started
        prefault_heap(min(allocated_host_bytes() or 0, PREFAULT_LIMIT_BYTES))
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        page_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    finally:
        runtime.close(clean=True)
    seconds = dict.fromkeys([name for name, _ in TIME_CLASSES] + ["other"], 0.0)
    outside_ops = []
    for event in prof.key_averages():
        name = next((c for c, pattern in TIME_CLASSES if pattern.fullmatch(event.key)), "other")
        seconds[name] += event.self_cpu_time_total / 1e6
        if name not in MATMUL_CLASSES:
            outside_ops.append((event.self_cpu_time_total / 1e6, event.count, event.key))
    total = sum(seconds.values())
    outside_ops.sort(reverse=True)
    matmul_s = sum(seconds[c] for c in MATMUL_CLASSES)
    step_flops = flops_per_token(config.model, data.seq_len) * data.global_batch_size * data.seq_len
    return {
        "profiled_step_s": total,
        "plain_step_s": plain_step_s,
        "page_faults": page_faults,
        "seconds": seconds,
        "shares": {name: s / total for name, s in seconds.items()},
        "outside_share": 1 - matmul_s / total,
        "mfu_ceiling": step_flops / (matmul_s * peak),
        "top_outside": [
            {"op": op, "calls": calls, "share": s / total} for s, calls, op in outside_ops[:TOP_OPS]
        ],
    }


PREFAULT_LIMIT_BYTES = 4 * 2**30
"""The most heap `prefault_heap` touches before the profiled step."""


def prefault_heap(num_bytes: int) -> None:
    """Grow the heap by `num_bytes` of touched pages and free them (they stay mapped, see
    `keep_freed_host_memory`). The profiler's own records fill holes the step's tensors
    reused, so under it tensors land on fresh pages and every first write page-faults:
    hundreds of thousands of faults in a medium step otherwise free of them, charged to
    whichever op wrote first (mostly elementwise ones). The breakdown reports the faults
    left."""
    if num_bytes > 0:
        torch.ones(num_bytes, dtype=torch.uint8)  # touched, then freed at once


def row_config(
    name: str, dtype: str, steps: int, peak: float, root: Path, compile_: bool = False
) -> Config:
    """The config of one row: its file and overrides, plus the benchmark's run settings."""
    file, overrides = ROWS[name]
    return load_config(
        CONFIG_DIR / f"{file}.yaml",
        [
            *overrides,
            *PRECISIONS[dtype],
            *benchmark_run_overrides(steps, root / f"{name}-{dtype}", peak),
            "--optim.warmup_steps=1",
            f"--train.compile={str(compile_).lower()}",  # eager unless asked, whatever the file says
        ],
    )


def run_one(name: str, dtype: str, args: argparse.Namespace, peak: float, root: Path) -> dict:
    """Train one row for ``args.steps`` steps; its medians, and with --breakdown its profile."""
    config = row_config(name, dtype, args.steps, peak, root, args.compile)
    result = train(config)
    records = read_metrics(result.run_dir / "metrics.jsonl")[args.warmup :]
    params = count_params(config.model)
    row = {
        "config": name,
        "dtype": dtype,
        "total_params": params.total,
        "active_params": params.active,
        "tokens_per_step": config.data.global_batch_size * config.data.seq_len,
        "steps_timed": len(records),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
        "mfu": statistics.median(r["mfu"] for r in records),
        "step_time_s": statistics.median(r["step_time_s"] for r in records),
        "peak_flops": peak,
    }
    if args.breakdown:
        row["breakdown"] = profile_step(config, peak, args.warmup)
    return row


def print_table(rows: list[dict], peaks: dict[str, float]) -> None:
    """One table: throughput and MFU, and with --breakdown the time shares per row."""
    breakdown = "breakdown" in rows[0]
    classes = list(rows[0]["breakdown"]["shares"]) if breakdown else []
    columns = [*classes, "outside", "ceiling"] if breakdown else []
    print("\npeak matmul FLOP/s: " + ", ".join(f"{d} {p / 1e12:.2f} T" for d, p in peaks.items()))
    if breakdown:
        print(
            "shares of one profiled step's self time; outside = not matmul or attention; "
            "ceiling = the MFU if only matmuls and attention took time"
        )
    cells = []
    for row in rows:
        line = [
            row["config"],
            row["dtype"],
            f"{row['total_params'] / 1e6:.1f}M",
            f"{row['active_params'] / 1e6:.1f}M",
            f"{row['tokens_per_s']:,.0f}",
            f"{100 * row['mfu']:.1f}%",
        ]
        if breakdown:
            parts = row["breakdown"]
            shares = [parts["shares"][c] for c in classes]
            shares += [parts["outside_share"], parts["mfu_ceiling"]]
            line += [f"{100 * share:.1f}%" for share in shares]
        cells.append(line)
    header = ["config", "dtype", "params", "active", "tokens/s", "MFU", *columns]
    output.print_table(header, cells)
    if breakdown:
        for row in rows:
            parts = row["breakdown"]
            print(
                f"\n{row['config']} {row['dtype']}: ops with the most self time outside "
                f"(step {parts['plain_step_s']:.2f} s, profiled {parts['profiled_step_s']:.2f} s, "
                f"{parts['page_faults']:,} page faults)"
            )
            for op in row["breakdown"]["top_outside"]:
                print(f"  {100 * op['share']:5.1f}%  {op['calls']:>6} calls  {op['op']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--dtypes", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (default 3)")
    parser.add_argument(
        "--breakdown", action="store_true", help="profile one step per row (time shares)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="rows with train.compile=true (default: every row eager)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/train_step.json"))
    parser.add_argument(
        "--one-row", nargs=3, metavar=("CONFIG", "DTYPE", "PEAK"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    if args.one_row:  # a row in this fresh process; its JSON to --out
        name, dtype, peak = args.one_row
        with tempfile.TemporaryDirectory() as tmp:
            row = run_one(name, dtype, args, float(peak), Path(tmp))
        output.write_json(args.out, row)
        return

    peaks = {
        dtype: measure_matmul_peak(PEAK_DTYPES[dtype], torch.device("cpu")) for dtype in args.dtypes
    }
    rows = []
    for name in args.configs:
        for dtype in args.dtypes:
            row = _run_in_fresh_process(name, dtype, peaks[dtype], args)
            rows.append(row)
            print(
                f"{row['config']:>9} {row['dtype']:>9}  {row['tokens_per_s']:>10,.0f} tok/s  "
                f"MFU {100 * row['mfu']:5.1f}%  step {row['step_time_s']:.3f} s",
                flush=True,
            )
    print_table(rows, peaks)
    print()
    output.write_json(args.out, {"peak_flops": peaks, "runs": rows})


def _run_in_fresh_process(name: str, dtype: str, peak: float, args: argparse.Namespace) -> dict:
    """One row (``run_one``) trained in a process of its own."""
    options = ["--one-row", name, dtype, repr(peak), "--steps", str(args.steps)]
    options += ["--warmup", str(args.warmup)]
    options += ["--breakdown"] * args.breakdown + ["--compile"] * args.compile
    return json_from_fresh_process(__file__, *options)


if __name__ == "__main__":
    main()
