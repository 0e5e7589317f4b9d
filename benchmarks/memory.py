"""Memory per rank (parameters, gradients, optimizer state, activations, peak) and tokens/s,
per topology and activation-recompute mode, in one table (CPU, gloo).

Every row runs in fresh gloo processes, one CPU thread per rank (``harness.ranks``), in two
phases:

1. Throughput: the real trainer (`moe_train.train.train`) for `--warmup + --steps` steps;
   tokens/s is the median of its own `metrics.jsonl` records over the timed steps (all ranks).
2. Memory (`memory_probe.py`): the same model, optimizer, gradient reducer and pipeline, built
   the way the trainer builds them, run for `--probe-warmup` steps, then 3 instrumented steps whose forward and
   backward are the trainer's own (`StepRunner`'s phases: forward and backward, reduction and
   clipping, statistics, the update):
   - params: bytes of this rank's parameters;
   - grads: bytes of gradient storage the optimizer holds at the end of the step
     (`gradient_bytes()`: `.grad` tensors and reduction buffers; the distributed optimizer's
     reduced shards; FP32 accumulation buffers of bf16 parameters);
   - optim: the optimizer's `state_bytes()` (AdamW's moments, whole or sharded);
   - activations: bytes held for backward after the forward of this rank's first micro-batch
     of a step (the model's forward, or this rank's first pipeline-stage forward); the least
     over the instrumented steps, since caches keyed by shapes (routing changes the expert
     group sizes every step) can only add to it;
   - peak: most bytes in use at any op boundary of an instrumented step, above what the
     process held just before the model was built (the most over the steps), and where.
   Bytes in use are glibc's in-use heap bytes (as `allocated_host_bytes`; CPU tensors are
   malloc'd), read after every op of the instrumented steps by a dispatch mode.

Targets (the published figures for full recompute are ~2/3 less activation memory for ~1/5 of
the throughput): the distributed optimizer's state per rank within 10% of 1/dp of its
unsharded size (FP32 words per parameter: two moments, plus the master weight for bf16
parameters); full recompute cuts activation memory by >= 60% at >= 0.75x the tokens/s of no
recompute (single process). With `--param-dtype bfloat16` the parameters are bf16 (2 bytes),
their gradients FP32 (4) and the optimizer holds FP32 masters and moments (12 / dp sharded).

    uv run python benchmarks/memory.py            # bench_results/memory.json
    uv run python benchmarks/memory.py --quick    # smoke run: smaller model, fewer steps
    uv run python benchmarks/memory.py --param-dtype bfloat16   # bf16 parameters
    uv run python benchmarks/memory.py --mtp-depth 1   # with a multi-token-prediction module
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness.output import print_table, write_json
from harness.ranks import run_distributed
from memory_probe import CPU, probe_memory
from moe_plan.config import Config, load_config
from moe_train.train import read_metrics, train
from moe_train.train.step import DTYPES

MIB = 2**20
TARGETS = {
    "distributed_optimizer_state_over_ideal": 1.10,
    "full_recompute_activation_reduction": 0.60,
    "full_recompute_throughput_ratio": 0.75,
}

MODEL = [
    "--model.d_model=256",
    "--model.n_layers=4",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.moe.num_experts=8",
    "--model.moe.top_k=2",
    "--model.moe.expert_hidden=512",
    "--data.seq_len=256",
    "--data.micro_batch_size=4",
    "--data.global_batch_size=8",
]
QUICK_MODEL = [
    "--model.d_model=128",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.moe.num_experts=4",
    "--model.moe.top_k=2",
    "--model.moe.expert_hidden=256",
    "--data.seq_len=128",
    "--data.micro_batch_size=2",
    "--data.global_batch_size=4",
]

# name: (world size, config overrides, recompute modes measured)
TOPOLOGIES: dict[str, tuple[int, list[str], tuple[str, ...]]] = {
    "1 process": (1, [], ("none", "selective", "full")),
    "dp2": (2, [], ("none", "full")),
    "dp2 dist-opt": (2, ["--parallel.distributed_optimizer=true"], ("none",)),
    "pp2 1f1b": (2, ["--parallel.pp=2", "--parallel.pp_schedule=1f1b"], ("none",)),
    "ep2 all_to_all": (2, ["--parallel.ep=2", "--parallel.dispatcher=all_to_all"], ("none",)),
}


def row_config(overrides: list[str], recompute: str, run_dir: Path, max_steps: int) -> Config:
    """The config of one row: the model and topology ``overrides`` in a recompute mode."""
    return load_config(
        None,
        [
            *overrides,
            f"--parallel.recompute={recompute}",
            f"--train.max_steps={max_steps}",
            f"--train.run_dir={run_dir}",
            "--train.progress=false",
            "--train.peak_flops=1e12",  # MFU is not reported here: skip the peak measurement
            "--optim.warmup_steps=1",
        ],
    )


def measure_topology(
    rank: int,
    world_size: int,
    overrides: list[str],
    modes: tuple[str, ...],
    run_root: str,
    rounds: int,
    warmup: int,
    steps: int,
    probe_warmup: int,
) -> dict[str, dict]:
    """Per recompute mode: the trainer's tokens/s (rank 0) and this rank's memory probe.

    After one untimed run, the trainer runs of the modes alternate, `rounds` times in
    alternating order, so load from other processes on the machine falls on every mode alike;
    tokens/s is the median over all timed steps.
    """
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    # The first trainer run of a process is slow for several steps (lazy initialisation):
    # one untimed run first.
    train(row_config(overrides, modes[0], Path(run_root) / "warmup", warmup + steps), device=CPU)
    for round_index in range(rounds):
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            run_dir = Path(run_root) / f"{mode}-{round_index}"
            result = train(row_config(overrides, mode, run_dir, warmup + steps), device=CPU)
            if result.is_main:
                records = read_metrics(result.run_dir / "metrics.jsonl")[warmup:]
                samples[mode] += [r["tokens_per_s"] for r in records]
            del result
    out = {}
    for mode in modes:
        config = row_config(overrides, mode, Path(run_root) / "probe", warmup + steps)
        memory = asdict(probe_memory(config, probe_warmup))
        memory["tokens_per_s"] = statistics.median(samples[mode]) if samples[mode] else None
        memory["tokens_per_s_samples"] = samples[mode]
        out[mode] = memory
    return out


def _row_ratios(rows: list[dict]) -> dict[str, Any]:
    """The derived ratios and their verdicts."""

    def find(topology: str, recompute: str) -> dict | None:
        for row in rows:
            if row["topology"] == topology and row["recompute"] == recompute:
                return row
        return None

    out: dict[str, Any] = {}
    dopt = find("dp2 dist-opt", "none")
    if dopt is not None:
        world = dopt["world_size"]
        # Unsharded: two FP32 moments, and an FP32 master unless the parameters are FP32.
        words = 2 if dopt["param_dtype"] == "float32" else 3
        worst = max(r["optim"] / (words * 4 * r["num_params"] / world) for r in dopt["ranks"])
        out["distributed_optimizer_state_over_ideal"] = worst
        plain = find("dp2", "none")
        if plain is not None:
            out["distributed_optimizer_state_over_adamw_state"] = max(
                d["optim"] / p["optim"] for d, p in zip(dopt["ranks"], plain["ranks"], strict=True)
            )
    none = find("1 process", "none")
    for mode in ("selective", "full"):
        other = find("1 process", mode)
        if none is None or other is None:
            continue
        base, rank = none["ranks"][0], other["ranks"][0]
        out[f"{mode}_recompute_activation_reduction"] = (
            1 - rank["activations"] / base["activations"]
        )
        out[f"{mode}_recompute_peak_reduction"] = 1 - rank["peak"] / base["peak"]
        out[f"{mode}_recompute_throughput_ratio"] = rank["tokens_per_s"] / base["tokens_per_s"]
    verdicts = {}
    for key, target in TARGETS.items():
        if key not in out:
            continue
        ok = out[key] <= target if key.endswith("over_ideal") else out[key] >= target
        verdicts[key] = "PASS" if ok else "FAIL"
    out["verdicts"] = verdicts
    return out


def _print_table(rows: list[dict], dtype: str, param_dtype: str) -> None:
    print(f"\nper-rank memory in MiB, compute dtype {dtype}, parameters {param_dtype}")
    header = ("topology", "recompute", "rank", "params", "grads", "optim", "activ.", "peak")
    cells = []
    for row in rows:
        for rank, r in enumerate(row["ranks"]):
            keys = ("params", "grads", "optim", "activations", "peak")
            sizes = [f"{r[key] / MIB:.1f}" for key in keys]
            tokens = f"{row['tokens_per_s']:,.0f}" if rank == 0 else ""
            cells.append([row["topology"], row["recompute"], rank, *sizes, tokens, r["peak_at"]])
    print_table([*header, "tokens/s", "peak after"], cells, left=("recompute", "peak after"))


def _print_ratios(ratios: dict[str, Any]) -> None:
    print()
    lines = {
        "distributed_optimizer_state_over_ideal": "dist-opt state per rank / (FP32 state / dp)",
        "distributed_optimizer_state_over_adamw_state": "dist-opt state per rank / torch AdamW's",
        "selective_recompute_activation_reduction": "selective: activation reduction vs none",
        "selective_recompute_peak_reduction": "selective: peak reduction vs none",
        "selective_recompute_throughput_ratio": "selective: tokens/s over none",
        "full_recompute_activation_reduction": "full: activation reduction vs none",
        "full_recompute_peak_reduction": "full: peak reduction vs none",
        "full_recompute_throughput_ratio": "full: tokens/s over none",
    }
    for key, text in lines.items():
        if key not in ratios:
            continue
        verdict = ratios["verdicts"].get(key)
        bound = TARGETS.get(key)
        target = ""
        if bound is not None:
            target = f"target {'<=' if key.endswith('over_ideal') else '>='} {bound:.2f}  {verdict}"
        print(f"{text:<52} {ratios[key]:>6.3f}  {target}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `rounds` and `steps` defaulted by --quick."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--param-dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--rounds", type=int, default=None, help="trainer runs per mode")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of a run left out")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument(
        "--probe-warmup",
        type=int,
        default=4,
        help="steps before the instrumented ones (default 4: the first steps of a new model "
        "make lasting allocations)",
    )
    parser.add_argument(
        "--topologies", nargs="+", choices=list(TOPOLOGIES), default=list(TOPOLOGIES)
    )
    parser.add_argument(
        "--mtp-depth",
        type=int,
        default=0,
        help="multi-token-prediction modules of the model (model.mtp_depth)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/memory.json"))
    args = parser.parse_args(argv)
    if args.mtp_depth < 0:
        raise ValueError(f"--mtp-depth={args.mtp_depth} must be at least 0")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.steps is None:
        args.steps = 2 if args.quick else 3
    for name in ("rounds", "warmup", "steps", "probe_warmup"):
        if getattr(args, name) < 1:
            flag = name.replace("_", "-")
            raise ValueError(f"--{flag}={getattr(args, name)} must be at least 1")
    return args


def measure_rows(args: argparse.Namespace, model: list[str]) -> list[dict]:
    """One row per topology and recompute mode: throughput and every rank's memory."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for topology in args.topologies:
            world, overrides, modes = TOPOLOGIES[topology]
            ranks = run_distributed(
                measure_topology,
                world,
                args=(
                    [
                        *model,
                        *overrides,
                        f"--precision.compute_dtype={args.dtype}",
                        f"--precision.param_dtype={args.param_dtype}",
                    ],
                    modes,
                    str(Path(tmp) / topology.replace(" ", "_")),
                    args.rounds,
                    args.warmup,
                    args.steps,
                    args.probe_warmup,
                ),
                timeout=1800.0,
            )
            for mode in modes:
                row = {
                    "topology": topology,
                    "recompute": mode,
                    "world_size": world,
                    "param_dtype": args.param_dtype,
                    "tokens_per_s": ranks[0][mode]["tokens_per_s"],
                    "ranks": [r[mode] for r in ranks],
                }
                rows.append(row)
                worst = max(row["ranks"], key=lambda r: r["peak"])
                print(
                    f"{topology:<15} {mode:<9} peak {worst['peak'] / MIB:7.1f} MiB  activations "
                    f"{worst['activations'] / MIB:7.1f} MiB  {row['tokens_per_s']:9,.0f} tok/s",
                    flush=True,
                )
    return rows


def main() -> None:
    args = parse_args()
    model = [*(QUICK_MODEL if args.quick else MODEL), f"--model.mtp_depth={args.mtp_depth}"]
    rows = measure_rows(args, model)
    ratios = _row_ratios(rows)
    _print_table(rows, args.dtype, args.param_dtype)
    _print_ratios(ratios)
    document = {
        "dtype": args.dtype,
        "param_dtype": args.param_dtype,
        "quick": args.quick,
        "model": model,
        "rounds": args.rounds,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "threads_per_rank": 1,
        "rows": rows,
        "ratios": ratios,
        "targets": TARGETS,
    }
    print()
    write_json(args.out, document)


if __name__ == "__main__":
    main()
