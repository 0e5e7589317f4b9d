"""Resident experts against FSDP weight gathering: tokens/s, bytes moved per step by each kind
of collective and peak memory per rank, as the expert pool grows at a fixed active size.

The same model and data on 4 gloo ranks (one CPU thread each), trained two ways
(`vs_fsdp_support.py` has the details):
- ep: this trainer's step, data parallel with the experts resident on an expert-parallel
  group of 4 ranks (ep=4), with each dispatcher (all_to_all; rowwise, capacity-bounded, over
  its CPU transport, a padded all-to-all), with and without the distributed optimizer;
- fsdp: torch's FSDP2 (`fully_shard` on each block and on the root) over all parameters,
  experts included, which are computed locally with the same grouped GEMM.
Both keep fp32 parameters and compute in bf16 under autocast (`--dtype`). Tokens go to
top-k experts drawn at random (`model.moe.random_routing`, `--routing random`): every expert
gets an even share whatever the router has learnt in a few steps, so the all-to-all is
balanced and rowwise, capacity-bounded (`--capacity-factor`, default 2), drops next to
nothing; `--routing learned` uses the router's choice instead. For each expert
count (top-k and expert width fixed) all variants train from step 0 interleaved step by step
(the order rotates), and the `--timed-steps` after `--warmup` are timed (the slowest rank's
time per step); then each variant trains alone again, `--warmup` steps and `--counted-steps`
steps under a counter of every collective call (`vs_fsdp_comm.py`) and a heap probe.

What the figures say:
- bytes per step, counted at every collective call on each rank (mean over ranks): payload,
  the bytes of the inputs handed to the collectives (all-gather: the rank's shard), and
  wire, the bytes that leave the rank (all-to-all: the blocks for other ranks, exact; the
  others as ring algorithms send them). They are what a GPU run of the same layout moves;
  rowwise runs its padded all_to_all transport here, which sends every capacity slot (over
  symmetric memory only the routed rows and one byte per slot would move);
- tokens/s: on CPU cores with gloo over loopback, a proxy: the ratio between the
  designs depends on how compute compares with communication, which differs on GPUs with
  NVLink; the trend over expert counts is the point;
- peak memory: the most heap bytes in use (glibc's count, where CPU tensors live) after any
  op of the counted steps, above what the rank held before building the model: parameters,
  gradients, optimizer state, activations and communication buffers, not allocator slack.

    uv run python benchmarks/vs_fsdp.py            # experts 8..64
    uv run python benchmarks/vs_fsdp.py --quick    # smaller model, experts 8 and 16
    uv run python benchmarks/vs_fsdp.py --json bench_results/vs_fsdp.json --plot docs/vs_fsdp.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import output
from harness.output import write_json, write_whole
from vs_fsdp_variants import EP, VARIANTS, Variant

if TYPE_CHECKING:
    from vs_fsdp_support import BenchSetup

MIB = 2**20

MODEL = {
    "vocab_size": 320,
    "d_model": 128,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "moe": {"top_k": 2, "expert_hidden": 128},
}
# Both sizes: two micro-batches per rank and step (FSDP gathers the weights for each).
DATA = {"seq_len": 128, "micro_batch_size": 2, "global_batch_size": 16}
QUICK_MODEL = {**MODEL, "d_model": 64, "moe": {**MODEL["moe"], "expert_hidden": 64}}
QUICK_DATA = {"seq_len": 64, "micro_batch_size": 2, "global_batch_size": 16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, experts 8 and 16")
    parser.add_argument("--experts", type=int, nargs="+", help="expert counts (multiples of 4)")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=[v.name for v in VARIANTS],
        default=[v.name for v in VARIANTS],
        help="which designs and dispatchers to run (default: all)",
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--warmup", type=int, default=2, help="steps before counting or timing")
    parser.add_argument("--counted-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=None, help="default 10, quick 3")
    parser.add_argument(
        "--capacity-factor", type=float, default=2.0, help="model.moe.capacity_factor of rowwise"
    )
    parser.add_argument(
        "--routing",
        choices=["random", "learned"],
        default="random",
        help="random (default): top-k experts drawn at random per token, an even load; "
        "learned: the router's choice (deterministic: comparable with one process)",
    )
    parser.add_argument(
        "--data", default="builtin:stdlib", help="a data.paths entry (default builtin:stdlib)"
    )
    parser.add_argument("--json", type=Path, default=Path("bench_results/vs_fsdp.json"))
    parser.add_argument("--plot", type=Path, default=None, help="PNG of tokens/s and bytes")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments, as one line, or None."""
    top_k = (QUICK_MODEL if args.quick else MODEL)["moe"]["top_k"]
    for experts in args.experts:
        if experts < EP or experts % EP:
            return (
                f"--experts {experts}: each expert count must be a positive multiple of "
                f"ep={EP} (the ep design splits every MoE layer's experts over {EP} ranks)"
            )
        if experts < top_k:
            return f"--experts {experts} must be at least top_k={top_k}"
    if len(set(args.experts)) != len(args.experts):
        return f"--experts {' '.join(map(str, args.experts))} lists an expert count twice"
    for name in ("warmup", "counted_steps", "timed_steps"):
        low = 0 if name == "warmup" else 1
        if getattr(args, name) < low:
            flag = "--" + name.replace("_", "-")
            return f"{flag}={getattr(args, name)} must be at least {low}"
    if not args.capacity_factor > 0:
        return f"--capacity-factor={args.capacity_factor} must be positive"
    if not args.data.startswith("builtin:") and not Path(args.data).exists():
        return f"--data {args.data}: no such file or directory"
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        return f"--plot {args.plot}: the plot is written as PNG; give a path ending in .png"
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        if path.is_dir():
            return f"{flag} {path} is a directory; give a file path"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"{flag} {path}: cannot create its directory ({e.strerror})"
    return None


def check_data(setup: BenchSetup) -> str | None:
    """The first problem with the data (opened as the trainer opens it), as one line, or None.
    Prepares builtin:stdlib on first use, once, before the ranks start."""
    from moe_data import TokenDataset
    from moe_train.errors import MoeTrainError

    path = setup.data["paths"][0]
    try:
        dataset = TokenDataset(setup.data["paths"], setup.data["seq_len"])
    except MoeTrainError as e:
        return f"--data {path}: {e}"
    vocab = setup.model["vocab_size"]
    if dataset.vocab_size > vocab:
        return (
            f"--data {path} holds token ids up to {dataset.vocab_size - 1}; the benchmark's "
            f"model has a vocabulary of {vocab} (byte-level data fits)"
        )
    return None


def make_setup(args: argparse.Namespace) -> BenchSetup:
    from vs_fsdp_support import BenchSetup

    data = {**(QUICK_DATA if args.quick else DATA), "paths": [args.data]}
    return BenchSetup(
        model=QUICK_MODEL if args.quick else MODEL,
        data=data,
        compute_dtype=args.dtype,
        rowwise_capacity_factor=args.capacity_factor,
        random_routing=args.routing == "random",
        warmup_steps=args.warmup,
        counted_steps=args.counted_steps,
        timed_steps=args.timed_steps,
    )


def make_rows(ranks: list[dict], setup: BenchSetup, variant_names: list[str]) -> list[dict]:
    """One row per (expert count, variant) from every rank's results, with the ratios to
    FSDP at the same expert count."""
    rows = [
        _row(variant, experts, [r[experts][variant.name] for r in ranks], setup)
        for experts in ranks[0]
        for variant in VARIANTS
        if variant.name in variant_names
    ]
    for row in rows:
        fsdp = next(
            (r for r in rows if r["design"] == "fsdp" and r["experts"] == row["experts"]), None
        )
        for key in ("tokens_per_s", "bytes_per_step_total", "wire_bytes_per_step_total"):
            ratio_key = key.removesuffix("_total") + "_vs_fsdp"
            row[ratio_key] = row[key] / fsdp[key] if fsdp else None
    return rows


def _row(variant: Variant, experts: int, per_rank: list[dict], setup: BenchSetup) -> dict:
    """The JSON row of one run: bytes per step (payload and wire, mean over ranks), time of
    the slowest rank, peak memory of the fullest rank."""
    from vs_fsdp_comm import KINDS

    counted, first = setup.counted_steps, per_rank[0]
    by_rank = {
        measure: [{k: r["collectives"][measure][k] / counted for k in KINDS} for r in per_rank]
        for measure in ("payload", "wire")
    }
    mean = {
        measure: {k: statistics.fmean(b[k] for b in ranks) for k in KINDS}
        for measure, ranks in by_rank.items()
    }
    times = first["timed"]["step_times_s"]
    step_time = statistics.median(times)
    return {
        "design": variant.design,
        "dispatcher": variant.dispatcher,
        "distributed_optimizer": variant.distributed_optimizer,
        "variant": variant.name,
        "experts": experts,
        "tokens_per_s": setup.data["global_batch_size"] * setup.data["seq_len"] / step_time,
        "step_time_s": step_time,
        "step_times_s": times,
        "bytes_per_step": mean["payload"],
        "bytes_per_step_total": sum(mean["payload"].values()),
        "bytes_per_step_by_rank": by_rank["payload"],
        "wire_bytes_per_step": mean["wire"],
        "wire_bytes_per_step_total": sum(mean["wire"].values()),
        "wire_bytes_per_step_by_rank": by_rank["wire"],
        "calls_per_step": {k: first["collectives"]["calls"][k] / counted for k in KINDS},
        "collective_ops": first["collectives"]["ops"],
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in per_rank),
        "peak_mem_bytes_by_rank": [r["peak_mem_bytes"] for r in per_rank],
        "params_per_rank": [r["params"] for r in per_rank],
        "dropped_fraction": first["dropped_fraction"],
        "losses": first["timed"]["losses"],
        "counted_run": {"losses": first["losses"], "grad_norms": first["grad_norms"]},
    }


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def print_table(rows: list[dict]) -> None:
    """Wire MiB per step and rank by kind; ratios are this row over FSDP at the same experts."""
    print(
        "\nMiB per step and rank: sent over links by collective kind (ring algorithms; "
        "all-to-all exact), their total (wire) and the bytes handed to the collectives "
        "(payload); ratios: this row / fsdp; dropped: token copies over capacity"
    )
    header = ("design", "dispatcher", "dist-opt", "experts", "tokens/s", "vs fsdp", "all-gather")
    header += ("red-scat", "all-red", "all-to-all", "wire", "vs fsdp", "payload", "peak MiB")
    output.print_table([*header, "dropped"], map(_table_row, rows), left=header[:3])


def _table_row(r: dict) -> list:
    w = r["wire_bytes_per_step"]
    return [
        r["design"],
        r["dispatcher"],
        "yes" if r["distributed_optimizer"] else "no",
        r["experts"],
        f"{r['tokens_per_s']:,.0f}",
        _ratio(r["tokens_per_s_vs_fsdp"]),
        *(f"{w[kind] / MIB:.2f}" for kind in ("all_gather", "reduce_scatter", "all_reduce")),
        f"{w['all_to_all'] / MIB:.2f}",
        f"{r['wire_bytes_per_step_total'] / MIB:.2f}",
        _ratio(r["wire_bytes_per_step_vs_fsdp"]),
        f"{r['bytes_per_step_total'] / MIB:.2f}",
        f"{r['peak_mem_bytes'] / MIB:.1f}",
        f"{r['dropped_fraction']:.2%}",
    ]


def _line_style(variant: str) -> dict[str, Any]:
    """FSDP black and dashed; ours by dispatcher, dotted with the distributed optimizer (whose
    bytes equal the plain run's: a reduce-scatter and an all-gather send what an all-reduce
    sends)."""
    if variant == "fsdp":
        return {"color": "black", "linestyle": "--", "linewidth": 2, "marker": "o"}
    rowwise = "rowwise" in variant
    return {
        "color": "tab:green" if rowwise else "tab:blue",
        "linestyle": ":" if variant.endswith("dist-opt") else "-",
        "marker": "s" if variant.endswith("dist-opt") else "^",
        "markerfacecolor": "none" if variant.endswith("dist-opt") else None,
    }


def write_plot(path: Path, rows: list[dict], note: str) -> None:
    """Tokens/s and bytes per step against the expert count, one line per variant; `note`
    says what the runs share (under the title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["experts"])
        experts = [r["experts"] for r in mine]
        style = _line_style(variant)
        left.plot(experts, [r["tokens_per_s"] for r in mine], label=variant, **style)
        right.plot(
            experts, [r["wire_bytes_per_step_total"] / MIB for r in mine], label=variant, **style
        )
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted({r["experts"] for r in rows}))
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_xlabel("routed experts per MoE layer (top-k and expert width fixed)")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    left.set_ylim(bottom=0)
    left.set_ylabel("tokens/s (all 4 ranks)")
    left.set_title("Throughput (4 gloo ranks on CPU: a proxy)")
    right.set_yscale("log")
    right.set_ylabel("MiB sent per step and rank (all collectives)")
    right.set_title("Bytes sent over links per step (counted calls)")
    fig.suptitle(f"Resident experts (ep=4) against FSDP2 weight gathering\n{note}", fontsize=11)
    fig.tight_layout()
    write_whole(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def plot_note(setup: BenchSetup) -> str:
    model, data = setup.model, setup.data
    routing = "random" if setup.random_routing else "learned"
    return (
        f"d_model {model['d_model']}, {model['n_layers']} layers, top-{model['moe']['top_k']} "
        f"experts of width {model['moe']['expert_hidden']}, {routing} routing; "
        f"{data['global_batch_size'] * data['seq_len']:,} tokens a step; fp32 parameters, "
        f"{setup.compute_dtype} compute"
    )


def describe(setup: BenchSetup) -> dict[str, Any]:
    """The run's settings and the definitions of its figures, for the JSON document."""
    return {
        "world_size": EP,
        "ep": EP,
        "threads_per_rank": 1,
        "model": setup.model,
        "data": setup.data,
        "compute_dtype": setup.compute_dtype,
        "param_dtype": "float32",
        "rowwise_capacity_factor": setup.rowwise_capacity_factor,
        "routing": "random" if setup.random_routing else "learned",
        "warmup_steps": setup.warmup_steps,
        "counted_steps": setup.counted_steps,
        "timed_steps": setup.timed_steps,
        "tokens_per_step": setup.data["global_batch_size"] * setup.data["seq_len"],
        "bytes_definition": (
            "bytes_per_step: per kind, the bytes of the inputs this rank hands to the "
            "collectives in a step (all-gather: its shard; reduce-scatter: the full input; "
            "all-reduce: the tensor; all-to-all: the send buffer), counted at the dispatcher, "
            "mean over ranks; wire_bytes_per_step: the bytes that leave the rank (all-to-all: "
            "the blocks for other ranks, exact; others: ring algorithms, all-gather (g-1) "
            "shards, reduce-scatter (g-1)/g of the input, all-reduce 2(g-1)/g)"
        ),
        "peak_mem_definition": (
            "most glibc heap bytes in use after any op of the counted steps, above the bytes in "
            "use before the model was built; the largest over ranks"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.experts is None:
        args.experts = [8, 16] if args.quick else [8, 16, 32, 64]
    if args.timed_steps is None:
        args.timed_steps = 3 if args.quick else 10
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # Imported once the arguments are known good: bad ones are answered without loading torch.
    import torch

    from harness.ranks import run_distributed
    from vs_fsdp_support import measure_rank

    setup = make_setup(args)
    problem = check_data(setup)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    ranks = run_distributed(
        measure_rank, EP, args=(setup, args.experts, args.variants), timeout=3600.0
    )
    rows = make_rows(ranks, setup, args.variants)
    print_table(rows)
    document = {
        "benchmark": "vs_fsdp",
        "quick": args.quick,
        "torch": torch.__version__,
        **describe(setup),
        "rows": rows,
    }
    print()
    write_json(args.json, document)
    if args.plot is not None:
        write_plot(args.plot, rows, plot_note(setup))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
