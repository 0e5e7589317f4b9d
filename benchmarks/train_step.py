"""Training-step throughput and MFU of the tiny and medium configs, fp32 and bf16.

MFU is model FLOPs (6 x active parameters + causal attention) per second over the peak
matmul rate of this machine, measured once per dtype at the start of this run and shared by
every row, so the rows compare within one run. The first steps of each run warm up caches
and kernel choices and are left out of the medians.

With ``--breakdown`` each row also profiles one optimizer step (after two warm-up steps) and
splits its time into the matmul and attention kernels (the work MFU counts), copies and dtype
casts (one class: both run as ``copy_``), the optimizer and everything else. The MFU ceiling is
model FLOPs over the matmul-and-attention time alone times the peak: the MFU this step would
reach if everything else took no time at all, with the kernels this torch build has for these
shapes.

    uv run python benchmarks/train_step.py [--steps 8] [--breakdown]
        [--out bench_results/train_step.json]
"""

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from moe_train.config import Config, load_config
from moe_train.model import count_params, flops_per_token
from moe_train.train import measure_matmul_peak, read_metrics, train
from moe_train.train.host_memory import keep_freed_host_memory
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner

CONFIGS = Path(__file__).parents[1] / "configs"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

TIME_CLASSES: tuple[tuple[str, re.Pattern], ...] = (
    ("matmul+attention", re.compile(r"aten::(mm|addmm|bmm|baddbmm|.*scaled_dot_product.*)")),
    ("copies+casts", re.compile(r"aten::(copy_|_to_copy)")),
    ("optimizer", re.compile(r"aten::_fused_adamw_")),
)
"""Profiler op names (self time) of each class; every other op counts as "other"."""


def profile_step(config: Config, peak: float) -> dict:
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

        for _ in range(2):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    finally:
        runtime.close(clean=True)
    seconds = dict.fromkeys([name for name, _ in TIME_CLASSES] + ["other"], 0.0)
    for event in prof.key_averages():
        name = next((c for c, pattern in TIME_CLASSES if pattern.fullmatch(event.key)), "other")
        seconds[name] += event.self_cpu_time_total / 1e6
    total = sum(seconds.values())
    step_flops = flops_per_token(config.model, data.seq_len) * data.global_batch_size * data.seq_len
    return {
        "profiled_step_s": total,
        "seconds": seconds,
        "shares": {name: s / total for name, s in seconds.items()},
        "mfu_ceiling": step_flops / (seconds["matmul+attention"] * peak),
    }


def run_one(
    name: str, dtype: str, steps: int, warmup: int, peak: float, root: Path, breakdown: bool
) -> dict:
    config = load_config(
        CONFIGS / f"{name}.yaml",
        [
            f"--precision.compute_dtype={dtype}",
            f"--train.max_steps={steps}",
            "--train.progress=false",
            f"--train.peak_flops={peak}",
            f"--train.run_dir={root / f'{name}-{dtype}'}",
            "--optim.warmup_steps=1",
        ],
    )
    result = train(config)
    records = read_metrics(result.run_dir / "metrics.jsonl")[warmup:]
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
    if breakdown:
        row["breakdown"] = profile_step(config, peak)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (default 3)")
    parser.add_argument("--configs", nargs="+", default=["tiny", "medium"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--breakdown", action="store_true", help="profile one step per row (time shares)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/train_step.json"))
    args = parser.parse_args()

    peaks = {
        dtype: measure_matmul_peak(DTYPES[dtype], torch.device("cpu")) for dtype in args.dtypes
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            for dtype in args.dtypes:
                rows.append(
                    run_one(
                        name,
                        dtype,
                        args.steps,
                        args.warmup,
                        peaks[dtype],
                        Path(tmp),
                        args.breakdown,
                    )
                )
                row = rows[-1]
                print(
                    f"{row['config']:>8} {row['dtype']:>9}  {row['tokens_per_s']:>10,.0f} tok/s  "
                    f"MFU {100 * row['mfu']:5.1f}%  step {row['step_time_s']:.3f} s",
                    flush=True,
                )

    print()
    print("peak matmul FLOP/s: " + ", ".join(f"{d} {p / 1e12:.2f} T" for d, p in peaks.items()))
    header = f"{'config':>8} {'dtype':>9} {'params':>8} {'active':>8} {'tokens/s':>10} {'MFU':>6}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['config']:>8} {row['dtype']:>9} {row['total_params'] / 1e6:>7.1f}M "
            f"{row['active_params'] / 1e6:>7.1f}M {row['tokens_per_s']:>10,.0f} "
            f"{100 * row['mfu']:>5.1f}%"
        )
    if args.breakdown:
        classes = list(rows[0]["breakdown"]["shares"])
        print(
            "\nshare of one profiled step's time, and the MFU if only matmuls+attention took time"
        )
        header = f"{'config':>8} {'dtype':>9}" + "".join(f" {c:>17}" for c in classes)
        print(header + f" {'MFU ceiling':>12}")
        for row in rows:
            shares = row["breakdown"]["shares"]
            print(
                f"{row['config']:>8} {row['dtype']:>9}"
                + "".join(f" {100 * shares[c]:>16.1f}%" for c in classes)
                + f" {100 * row['breakdown']['mfu_ceiling']:>11.1f}%"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"peak_flops": peaks, "runs": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
