"""Throughput cost of document masking: training steps with `data.document_masking` on and
off, in one run.

For each config (default: `configs/tiny.yaml` and `configs/medium.yaml`, one process, a fresh
one for each run, the built-in data, whose documents are Python modules ending at the byte
tokenizer's eos id), trains `--steps` steps with masking off and on, alternating over
`--rounds` rounds; the first `--skip` steps of each run (start-up) are left out. "tok/s" is the
median over the kept steps; "masked / plain" divides the masked median by the plain one of the
same config. Masking runs the causal attention kernel once per document (per row, or once
for all rows that split alike) instead of once per micro-batch; "docs/seq" is the mean number
of documents (pieces of them) in a training sequence of those steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from harness.output import print_table, write_json
from harness.processes import train_in_fresh_process
from moe_data import TokenDataset
from moe_plan.config import load_config

CONFIGS = Path(__file__).parents[1] / "configs"


def run_once(args: argparse.Namespace, config_name: str, masking: bool, run_dir: Path) -> list:
    """tokens/s of the kept steps of one run."""
    extra = [f"--data.document_masking={str(masking).lower()}", *args.override]
    config = CONFIGS / f"{config_name}.yaml"
    rows = train_in_fresh_process(config, args.steps, run_dir, args.peak_flops, extra)
    return [row["tokens_per_s"] for row in rows[args.skip :]]


def documents_per_sequence(args: argparse.Namespace, config_name: str) -> float:
    """Mean documents (or pieces of one) per training sequence over the measured steps."""
    config = load_config(CONFIGS / f"{config_name}.yaml", list(args.override))
    data = config.data
    dataset = TokenDataset(data.paths, data.seq_len)
    pieces = []
    for step in range(args.skip, args.steps):
        batch = dataset.batch(step, data.global_batch_size, config.train.seed)[:, :-1]
        pieces += (1 + (batch[:, :-1] == dataset.eos_id).sum(dim=1)).tolist()
    return statistics.mean(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "medium"])
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (start-up)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds")
    parser.add_argument("--peak-flops", type=float, default=1e12, help="MFU denominator")
    parser.add_argument("--override", action="append", default=[], help="a config override")
    parser.add_argument("--out", type=Path, default=Path("bench_results/document_masking.json"))
    args = parser.parse_args()
    if args.steps <= args.skip:
        parser.error(f"--steps={args.steps} must be more than --skip={args.skip}")

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for config_name in args.configs:
            speeds: dict[bool, list[float]] = {False: [], True: []}
            for round_index in range(args.rounds):
                for masking in (False, True):
                    run_dir = Path(work) / f"{config_name}-{round_index}-{masking}"
                    speeds[masking] += run_once(args, config_name, masking, run_dir)
            plain, masked = (statistics.median(speeds[m]) for m in (False, True))
            rows.append(
                {
                    "config": config_name,
                    "plain_tokens_per_s": plain,
                    "masked_tokens_per_s": masked,
                    "masked_over_plain": masked / plain,
                    "documents_per_sequence": documents_per_sequence(args, config_name),
                    "steps_kept": len(speeds[True]),
                    "plain_all": speeds[False],
                    "masked_all": speeds[True],
                }
            )

    print(f"{args.steps} steps per run ({args.skip} left out), {args.rounds} round(s)")
    print_table(
        ("config", "plain tok/s", "masked tok/s", "masked / plain", "docs/seq"),
        (
            [
                row["config"],
                f"{row['plain_tokens_per_s']:,.0f}",
                f"{row['masked_tokens_per_s']:,.0f}",
                f"{row['masked_over_plain']:.3f}",
                f"{row['documents_per_sequence']:.2f}",
            ]
            for row in rows
        ),
    )
    result = {"steps": args.steps, "skip": args.skip, "rounds": args.rounds, "rows": rows}
    result["overrides"] = args.override
    write_json(args.out, result)


if __name__ == "__main__":
    main()
