"""`moe-train eval CKPT --tasks FILE... [--json] [--parallel.key=value ...]`."""

import argparse
import json
from pathlib import Path

from moe_train.cli.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, metavar="CKPT")
    parser.add_argument(
        "--tasks",
        nargs="+",
        required=True,
        type=Path,
        metavar="FILE",
        help="task files: multiple choice (.jsonl) or held-out text (.txt, .jsonl of text rows)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print per task its name and figures as JSON"
    )


def _handle(args: argparse.Namespace) -> int:
    from moe_train.errors import MoeTrainError
    from moe_train.task_eval import evaluate_checkpoint, results_json, results_table
    from moe_train.train.runtime import launched_rank, leave_report_to_rank_0

    try:
        ckpt, results = evaluate_checkpoint(args.checkpoint, args.tasks, layout=args.overrides)
    except MoeTrainError as e:
        leave_report_to_rank_0(e)  # rank 0 alone prints an error every rank raised alike
        raise
    if launched_rank() != 0:
        return 0
    if args.json:
        print(json.dumps({"checkpoint": str(ckpt), "tasks": results_json(results)}))
    else:
        print(results_table(ckpt, results))
    return 0


EVAL = Command(
    name="eval",
    help="score a checkpoint on downstream tasks",
    description="Score CKPT (or the newest checkpoint under a checkpoints root) on task "
    "files with the scorer of the training loop's eval.tasks: multiple choice (acc, "
    "acc_norm) or held-out text (bits_per_byte). Runs on any layout: one process, or "
    "torchrun with --parallel.key=value; the tokenizer is that of the run's data.paths.",
    add_arguments=_add_arguments,
    handle=_handle,
    takes_overrides=True,
)
