"""`moe-train plan CONFIG --gpus N [--gpu NAME] [--json] [--overrides] [--section.key=value ...]`."""

import argparse
import json
from pathlib import Path

from moe_train.cli.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="YAML config file")
    parser.add_argument("--gpus", type=int, required=True, metavar="N", help="devices in all")
    parser.add_argument(
        "--gpu", default=None, help="h100, h200, b200 or b300 (default h100, or the figures below)"
    )
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="G")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, metavar="M")
    parser.add_argument("--gpu-tflops", type=float, default=None, metavar="F", help="dense bf16")
    parser.add_argument("--intra-node-gbps", type=float, default=None, metavar="B", help="GB/s")
    parser.add_argument("--inter-node-gbps", type=float, default=None, metavar="B", help="GB/s")
    parser.add_argument("--top", type=int, default=15, help="rows of the ranked table")
    parser.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    parser.add_argument(
        "--overrides",
        action="store_true",
        dest="show_overrides",
        help="also print, for each row shown, the --section.key=value overrides that give "
        "its layout to `moe-train train`",
    )


def _handle(args: argparse.Namespace) -> int:
    from moe_train.config import load_config
    from moe_train.errors import ConfigError
    from moe_train.plan import device_with, format_plan, make_plan, plan_json

    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus} must be at least 1")
    custom = [args.gpu_memory_gib, args.gpu_tflops, args.intra_node_gbps, args.inter_node_gbps]
    name = args.gpu or (None if all(v is not None for v in custom) else "h100")
    try:
        device = device_with(
            name,
            memory_gib=args.gpu_memory_gib,
            tflops=args.gpu_tflops,
            intra_node_gbps=args.intra_node_gbps,
            inter_node_gbps=args.inter_node_gbps,
            gpus_per_node=args.gpus_per_node,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    plan = make_plan(load_config(args.config, args.overrides), args.gpus, device)
    if args.json:
        print(json.dumps(plan_json(plan), indent=1))
    else:
        command = " ".join(["uv run moe-train train", str(args.config), *args.overrides])
        print(format_plan(plan, args.top, command if args.show_overrides else None))
    return 0 if plan.own.error is None and plan.own.fits else 1


PLAN = Command(
    name="plan",
    help="predict memory, traffic and throughput of a config's layouts on N devices",
    description="Check CONFIG's layout at --gpus N with the trainer's own start checks, "
    "then rank every layout that fits by predicted tokens/s per device: memory per "
    "device by category, bytes per step by collective kind, pipeline bubble, a roofline "
    "step time and MFU. When none fits, list the closest and the smallest count of the same "
    "devices that fits. Override config keys with --section.key=value.",
    add_arguments=_add_arguments,
    handle=_handle,
    takes_overrides=True,
)
