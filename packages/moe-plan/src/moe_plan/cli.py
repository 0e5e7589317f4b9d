"""`moe-plan CONFIG --gpus N [--gpu NAME] [--tokens N] [--json] [--overrides]
[--section.key=value ...]`, and `moe-plan [CONFIG] --serve [--port P]` (the page): the command
line of the planner, which `moe-train plan` runs too (with `add_arguments` and `handle`)."""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moe_data import run_command
from moe_plan.config import load_config
from moe_plan.errors import ConfigError
from moe_plan.hardware import device_with, parse_capability
from moe_plan.report import format_plan, make_plan, plan_json
from moe_plan.serve import serve

DEFAULT_PORT = 8037
MAX_PORT = 65535
MAX_GPUS = 1 << 20
"""The most devices planned for (the layouts of a count are found by trying its divisors)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", type=Path, nargs="?", help="YAML config file (with --serve: the one preselected)"
    )
    parser.add_argument("--gpus", type=int, default=None, metavar="N", help="devices in all")
    parser.add_argument(
        "--gpu", default=None, help="h100, h200, b200 or b300 (default h100, or the figures below)"
    )
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="G")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, metavar="M")
    parser.add_argument("--gpu-tflops", type=float, default=None, metavar="F", help="dense bf16")
    parser.add_argument(
        "--gpu-fp8-tflops",
        type=float,
        default=None,
        metavar="F",
        help="dense FP8 (e4m3); 0: no native FP8 (a custom device's default)",
    )
    parser.add_argument(
        "--gpu-capability",
        default=None,
        metavar="MAJOR.MINOR",
        help="CUDA compute capability, which says the FP8 kernels that run (a custom device's "
        "default: 9.0 with an FP8 rate, else 8.0)",
    )
    parser.add_argument("--intra-node-gbps", type=float, default=None, metavar="B", help="GB/s")
    parser.add_argument("--inter-node-gbps", type=float, default=None, metavar="B", help="GB/s")
    parser.add_argument(
        "--tokens",
        type=token_count,
        default=None,
        metavar="N",
        help="a token budget (2000000000000 or 2e12): the GPU-hours and days to train on it",
    )
    parser.add_argument("--top", type=int, default=15, help="rows of the ranked table")
    parser.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    parser.add_argument(
        "--overrides",
        action="store_true",
        dest="show_overrides",
        help="also print, for each row shown, the --section.key=value overrides that give "
        "its layout to `moe-train train`",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="serve the planner as a page on http://127.0.0.1:PORT (the repository's and the "
        "working directory's configs/*.yaml listed)",
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        help=f"the page's port, 0 to {MAX_PORT} (0: any free port)",
    )


def port_number(text: str) -> int:
    """A TCP port, 0 to MAX_PORT (0: any free one). Raises ConfigError, which argparse lets
    through, so that the CLI prints one line rather than its usage."""
    if not text.isdecimal() or int(text) > MAX_PORT:
        raise ConfigError(
            f"--port {text} must be a whole number from 0 to {MAX_PORT} (0: any free port)"
        )
    return int(text)


def token_count(text: str) -> int:
    """A positive count of tokens written as an integer or in scientific notation."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 1 and value < 1e30 and value == int(value)):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive whole number of tokens (e.g. 2000000000000 or 2e12)"
        )
    return int(value)


def plan_of(args: argparse.Namespace, *, search: bool = True, ranked: int | None = None) -> Any:
    """The Plan the arguments ask for (config, devices, overrides), checked as the CLI checks
    them; raises ConfigError with the CLI's words. `ranked`: rank only the fastest that many
    layouts that fit (`make_plan`)."""
    if args.config is None:
        raise ConfigError("give a CONFIG file (or --serve for the page)")
    if args.gpus is None:
        raise ConfigError("--gpus N is required (or --serve for the page)")
    if not 1 <= args.gpus <= MAX_GPUS:
        raise ConfigError(f"--gpus {args.gpus} must be between 1 and {MAX_GPUS:,}")
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
            fp8_tflops=args.gpu_fp8_tflops,
            capability=None
            if args.gpu_capability is None
            else parse_capability(args.gpu_capability),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    config = load_config(args.config, args.overrides)
    return make_plan(config, args.gpus, device, search=search, ranked=ranked)


class _Refusal(Exception):
    """An argument the parser refuses, in argparse's words."""


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _Refusal(message)


def plan_json_of(argv: list[str], *, search: bool = True) -> dict[str, Any]:
    """What `moe-plan ARGV --json` prints, as data. Raises ConfigError with the
    message the command would print."""
    return plan_json(*plan_words_of(argv, search=search))


def plan_words_of(
    argv: list[str], *, search: bool = True, ranked: int | None = None
) -> tuple[Any, int | None]:
    """The Plan and the token budget that `moe-plan ARGV` works from (the page's
    server calls this, with the rows it shows first `ranked`). Raises ConfigError with the
    message the command would print."""
    parser = _RaisingParser(prog="moe-plan", add_help=False)
    add_arguments(parser)
    try:
        args, extra = parser.parse_known_args(argv)
    except _Refusal as e:
        raise ConfigError(str(e)) from e
    args.overrides = extra
    return plan_of(args, search=search, ranked=ranked), args.tokens


def handle(args: argparse.Namespace) -> int:
    """Run the command on the parsed arguments (`args.overrides`: the --section.key=value
    words); the exit code: 0 when the config's own layout starts and fits, else 1."""
    if args.serve:
        serve(args.port, plan_words_of, args.config)
        return 0
    plan = plan_of(args)
    if args.json:
        print(json.dumps(plan_json(plan, args.tokens), indent=1))
    else:
        command = " ".join(["uv run moe-train train", str(args.config), *args.overrides])
        print(format_plan(plan, args.top, command if args.show_overrides else None, args.tokens))
    return 0 if plan.own.error is None and plan.own.fits else 1


HELP = "predict memory, traffic and throughput of a config's layouts on N devices"
"""One line in a list of commands."""
DESCRIPTION = (
    "Check CONFIG's layout at --gpus N with the trainer's own start checks, "
    "then rank every layout that fits by predicted tokens/s per device: memory per "
    "device by category, bytes per step by collective kind, pipeline bubble, a roofline "
    "step time and MFU; with --tokens, the GPU-hours and days to that budget. When none "
    "fits, list the closest and the smallest count of the same devices that fits. Override "
    "config keys with --section.key=value. --serve shows the same on a local page."
)
"""The paragraph at the top of the command's --help."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of `moe-plan`: user errors print one line `error: ...` and exit with the
    error's code (2 for bad input)."""
    parser = argparse.ArgumentParser(prog="moe-plan", description=DESCRIPTION)
    add_arguments(parser)

    def run() -> int:
        args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
        args.overrides = extra
        return handle(args)

    return run_command(run)
