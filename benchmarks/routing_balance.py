"""Balance versus load: the balancing loss against the real imbalance, on a constructed case
and on ordinary data, from real 2-rank expert-parallel training runs.

Each case trains with `torchrun --nproc-per-node 2 ... --parallel.ep=2` (gloo on the CPU) and
reads RUN_DIR/expert_load.jsonl. Cases:

- ``alike``: the constructed case. Every document of the corpus repeats the same byte, so every
  token of a step has the same context in every layer, and top-1 routing sends all of a step's
  copies to one expert: one of the two EP ranks does all the work (rank imbalance exactly 2).
  The balancing loss E * sum_e f_e * P_e sees the one-hot routed fractions f only through the
  router's mean probabilities P; a top-1 router with normalised weights learns only from that
  loss, which flattens P, so the loss falls towards its even value 1.0 while the work stays on
  one rank. A small model (d_model 32, 4 experts, 2 layers).
- ``builtin_tiny``: configs/tiny.yaml (8 experts, top-2) on builtin:stdlib: ordinary routing.
- ``builtin_top1``: the small model of ``alike`` with the same top-1 routing on builtin:stdlib:
  ordinary data, but so few experts and so flat a router that the loss misses a real rank
  imbalance too.

It prints one table (per case and MoE layer: the balancing loss first, last and mean; the
busiest EP rank and the busiest expert over the mean; the logged steps the check flagged and
the step it warned at) and writes bench_results/routing_balance.json; the runs stay under
bench_results/routing_balance/ for `moe-train plot`.

    uv run python benchmarks/routing_balance.py
    uv run python benchmarks/routing_balance.py --cases alike --plot docs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from harness import output
from harness.ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS = 30

SMALL_MODEL = {
    "vocab_size": 256,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "qk_norm": True,
    "moe": {"num_experts": 4, "top_k": 1, "expert_hidden": 32},
}


def _small_config(run_dir: Path, data_path: str) -> dict:
    return {
        "model": SMALL_MODEL,
        "data": {
            "paths": [data_path],
            "seq_len": 32,
            "global_batch_size": 8,
            "micro_batch_size": 2,
        },
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {
            "max_steps": STEPS,
            "run_dir": str(run_dir),
            "progress": False,
            "peak_flops": 1e11,
        },
        "precision": {"compute_dtype": "float32"},
        "parallel": {"ep": 2},
        "checkpoint": {"interval": 0, "interval_minutes": 0},
    }


def _case_config(case: str, root: Path) -> tuple[Path, list[str]]:
    """The config file and overrides of a case."""
    run_dir = root / case
    if case == "builtin_tiny":
        overrides = [f"--train.run_dir={run_dir}", f"--train.max_steps={STEPS}", "--parallel.ep=2"]
        overrides += ["--data.micro_batch_size=4", "--train.progress=false"]
        overrides += ["--checkpoint.interval=0", "--checkpoint.interval_minutes=0"]
        return ROOT / "configs" / "tiny.yaml", overrides
    if case == "alike":
        tokens = root / "alike.npy"
        np.save(tokens, np.full(20000, ord("a"), dtype=np.uint16))
        data = _small_config(run_dir, str(tokens))
    else:
        data = _small_config(run_dir, "builtin:stdlib")
        data["model"] = {**SMALL_MODEL, "vocab_size": 320}
    path = root / f"{case}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, []


def run_case(case: str, root: Path) -> tuple[Path, list[str]]:
    """Train the case on 2 ranks; its run directory and the console's warning lines."""
    config, overrides = _case_config(case, root)
    shutil.rmtree(root / case, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    command += ["--master-port", str(free_port()), "-m", "moe_train.cli", "train", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command + overrides, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"{case}: training failed:\n{result.stderr[-3000:]}")
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    return root / case, warnings


def summarise(run_dir: Path) -> list[dict]:
    """Per MoE layer: the balancing loss and the real imbalance over the logged steps."""
    rows = [json.loads(line) for line in (run_dir / "expert_load.jsonl").read_text().splitlines()]
    layers = []
    for i, layer in enumerate(rows[0]["layers"]):
        lb = [r["lb_loss"][i] for r in rows]
        ranks = [r["rank_imbalance"][i] for r in rows]
        flagged = [r["step"] for r in rows if r["hidden_imbalance"][i]]
        layers.append(
            {
                "layer": layer,
                "lb_loss_first": lb[0],
                "lb_loss_last": lb[-1],
                "lb_loss_mean": statistics.fmean(lb),
                "rank_imbalance_mean": statistics.fmean(ranks),
                "rank_imbalance_min": min(ranks),
                "rank_imbalance_max": max(ranks),
                "expert_imbalance_mean": statistics.fmean(r["expert_imbalance"][i] for r in rows),
                "flagged_steps": len(flagged),
                "warned_at_step": flagged[0] if flagged else None,
            }
        )
    return layers


def print_table(results: dict[str, dict]) -> None:
    header = ("case", "layer", "lb_loss first -> last (mean)", "rank max/mean: mean (min-max)")
    header += ("expert max/mean", "flagged", "warned at")
    rows = []
    for case, result in results.items():
        for s in result["layers"]:
            lb = f"{s['lb_loss_first']:.3f} -> {s['lb_loss_last']:.3f} ({s['lb_loss_mean']:.3f})"
            ranks = (
                f"{s['rank_imbalance_mean']:.2f} ({s['rank_imbalance_min']:.2f}-"
                f"{s['rank_imbalance_max']:.2f})"
            )
            warned = "-" if s["warned_at_step"] is None else f"step {s['warned_at_step']}"
            flagged = f"{s['flagged_steps']}/{STEPS}"
            rows.append(
                [case, s["layer"], lb, ranks, f"{s['expert_imbalance_mean']:.2f}", flagged, warned]
            )
    output.print_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cases = ["alike", "builtin_tiny", "builtin_top1"]
    parser.add_argument("--cases", nargs="+", choices=cases, default=cases)
    parser.add_argument("--out", type=Path, default=Path("bench_results/routing_balance.json"))
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="DIR", help="also write each case's figures"
    )
    args = parser.parse_args()
    root = args.out.parent / "routing_balance"
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    for case in args.cases:
        run_dir, warnings = run_case(case, root)
        results[case] = {
            "run_dir": str(run_dir),
            "warnings": warnings,
            "layers": summarise(run_dir),
        }
    print_table(results)
    for case, result in results.items():
        for line in result["warnings"]:
            print(f"{case}: {line}")
    output.write_json(args.out, {"steps": STEPS, "cases": results})
    if args.plot is not None:
        from moe_train.plot.routing import balance_figure
        from moe_train.plot.runs import read_run

        args.plot.mkdir(parents=True, exist_ok=True)
        for case, result in results.items():
            path = args.plot / f"routing_balance_{case}.png"
            balance_figure(read_run(Path(result["run_dir"]))).savefig(path)
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
