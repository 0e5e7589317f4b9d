"""`moe-train inspect CKPT [--json] [--no-verify] [--all]`."""

import argparse
import json
import sys
from pathlib import Path

from moe_train.cli.command import Command
from moe_train.errors import MoeTrainError


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, metavar="CKPT")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="a quick listing: read no tensor data, check no data checksums",
    )
    parser.add_argument(
        "--all", action="store_true", help="also list the optimizer tensors (optim.*)"
    )


def _handle(args: argparse.Namespace) -> int:
    """Print the report; a failed verification then stops with its one-line error."""
    from moe_train.inspect_report import build_report, format_report

    report = build_report(args.checkpoint, verify=not args.no_verify, all_tensors=args.all)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if report["verification"] not in ("ok", None):
        sys.stdout.flush()
        raise MoeTrainError(report["verification"])
    return 0


INSPECT = Command(
    name="inspect",
    help="show what a checkpoint holds and verify its checksums",
    description="Show a checkpoint's step, save time, saving layout, data position, "
    "sizes by category, model config and tensors, and check every chunk checksum and "
    "file sha256; exit 2 when that fails. CKPT may be a checkpoints root: its newest "
    "committed checkpoint is shown.",
    add_arguments=_add_arguments,
    handle=_handle,
)
