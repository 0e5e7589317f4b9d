"""`moe-train plot RUN_DIR... [--out DIR]`."""

import argparse
from pathlib import Path

from moe_train.cli.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the PNG files go (default RUN_DIR/plots for one run, ./plots for several)",
    )


def _handle(args: argparse.Namespace) -> int:
    from moe_train.plot import plot_runs

    result = plot_runs(args.run_dirs, args.out)
    for note in result.notes:
        print(f"note: {note}")
    print(
        f"wrote {len(result.files)} figures to {result.out}: "
        f"{', '.join(path.name for path in result.files)}"
    )
    return 0


PLOT = Command(
    name="plot",
    help="draw PNG figures of runs: loss, learning rate, throughput, routing",
    description="Write PNG figures of RUN_DIR (metrics.jsonl, expert_load.jsonl): loss "
    "and eval loss by step and by tokens, learning rate, tokens/s and MFU, expert load, "
    "EP-rank load (with several EP ranks), and the balancing loss against the real imbalance "
    "with the routing check's warnings; the steps a resumed run continued from are marked. "
    "Several RUN_DIRs overlay their curves. Needs matplotlib (moestack-train[plot]).",
    add_arguments=_add_arguments,
    handle=_handle,
)
