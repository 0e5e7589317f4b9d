"""Training-step throughput and MFU of the tiny and medium configs, fp32 and bf16.

MFU is model FLOPs (6 x active parameters + causal attention) per second over the peak
matmul rate of this machine, measured once per dtype at the start of this run and shared by
every row, so the rows compare within one run. The first steps of each run warm up caches
and kernel choices and are left out of the medians.

    uv run python benchmarks/train_step.py [--steps 8] [--out bench_results/train_step.json]
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from moe_train.config import load_config
from moe_train.model import count_params
from moe_train.train import measure_matmul_peak, read_metrics, train

CONFIGS = Path(__file__).parents[1] / "configs"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_one(name: str, dtype: str, steps: int, warmup: int, peak: float, root: Path) -> dict:
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
    return {
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (default 3)")
    parser.add_argument("--configs", nargs="+", default=["tiny", "medium"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=Path("bench_results/train_step.json"))
    args = parser.parse_args()

    peaks = {
        dtype: measure_matmul_peak(DTYPES[dtype], torch.device("cpu")) for dtype in args.dtypes
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            for dtype in args.dtypes:
                rows.append(run_one(name, dtype, args.steps, args.warmup, peaks[dtype], Path(tmp)))
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"peak_flops": peaks, "runs": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
