"""`moe-train train CONFIG.yaml [--nproc-per-node N] [--section.key=value ...]`."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moe_train.cli.command import Command

if TYPE_CHECKING:
    from moe_plan.config import Config
    from moe_train.train import TrainResult


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="YAML config file")
    parser.add_argument(
        "--nproc-per-node",
        metavar="N",
        help="start N ranks on this machine, as `torchrun --standalone --nproc-per-node N` "
        "does, once the config passed the trainer's start check for N ranks; a failed launch "
        "ends with the failing rank's error line (default: train in this process, or as the "
        "rank a launcher started)",
    )


def _handle(args: argparse.Namespace) -> int:
    """Train (with --nproc-per-node: start the ranks that train); exit 0 when the run reached
    train.max_steps (now or before), PREEMPTED_EXIT when a signal stopped it early."""
    from moe_plan.config import load_config
    from moe_train.errors import MoeTrainError, on_every_rank
    from moe_train.signals import StopRequests

    if args.nproc_per_node is not None:
        return _launch(args)
    # Listening first: a launcher's SIGTERM during start-up (torchrun sends one to every rank
    # when another exits) then lets this rank finish what it is doing and report its own error.
    with StopRequests(announce=False) as stops:
        try:
            try:
                config = load_config(args.config, args.overrides)
            except MoeTrainError as e:  # every rank reads the same file and flags
                on_every_rank(e)
                raise
            from moe_train.train import train

            result = train(config, stops=stops)
        except MoeTrainError as e:
            from moe_train.train.runtime import leave_report_to_rank_0, tell_launcher

            tell_launcher(e)
            leave_report_to_rank_0(e, stops)
            raise
    code = _report(config, result)
    # The run's model and trainer hold the process groups (dispatchers, sequence parts,
    # pipeline stages), partly in reference cycles. Free them now: left to the interpreter's
    # exit, a gloo group's threads are torn down with the interpreter half gone, and a rank
    # that trained to the end can abort (SIGABRT) and fail the launch.
    del result
    gc.collect()
    return code


def _report(config: Config, result: TrainResult) -> int:
    """Say how the run ended (on the first rank); the exit code."""
    from moe_data import PREEMPTED_EXIT

    if not result.is_main:
        return PREEMPTED_EXIT if result.stopped_by else 0
    steps = config.train.max_steps
    if result.already_finished:
        _say(
            f"{result.run_dir} already finished: {result.checkpoint} is at step "
            f"{result.start_step} (train.max_steps={steps}); nothing to do"
        )
        return 0
    if result.stopped_by:
        saved = (
            f"saved {result.checkpoint}"
            if result.checkpoint
            else "nothing saved (checkpointing is off)"
        )
        _say(
            f"stopped by {result.stopped_by} after step {result.end_step} of {steps}; {saved}; "
            f"relaunch with --checkpoint.resume=auto to continue"
        )
        return PREEMPTED_EXIT
    final = f", final loss {result.losses[-1]:.4f}" if result.losses else ""
    ran = result.end_step - result.start_step
    launch = (
        f"{ran} steps this launch ({result.end_step} in the run)"
        if result.start_step
        else f"{ran} steps"
    )
    _say(f"done: {launch}{final}, metrics in {result.run_dir / 'metrics.jsonl'}")
    return 0


def _say(text: str) -> None:
    """A line on stdout, wrapped between words to the terminal's width."""
    from moe_train.train.console import line_width, wrap_words

    print("\n".join(wrap_words(text, line_width(sys.stdout))))


def _launch(args: argparse.Namespace) -> int:
    """--nproc-per-node N: refuse a config that cannot start on N ranks (nothing started),
    else start the N ranks, each running this command without the option."""
    from moe_plan.config import check_start, load_config
    from moe_train.cli.launch import launch_ranks, nproc_per_node
    from moe_train.errors import ConfigError
    from moe_train.train.runtime import launched_by_torchrun, launched_world_size

    nproc = nproc_per_node(args.nproc_per_node)
    if launched_by_torchrun() or launched_world_size() > 1:
        raise ConfigError(
            "--nproc-per-node starts the ranks itself: leave it out under torchrun or a "
            "cluster launcher"
        )
    config = load_config(args.config, args.overrides)
    check_start(config, nproc)
    return launch_ranks(nproc, ["train", str(args.config), *args.overrides])


TRAIN = Command(
    name="train",
    help="train a model from a YAML config",
    description="Train from CONFIG.yaml; override any key with --section.key=value. "
    "--nproc-per-node N starts N ranks on this machine (for several machines use torchrun "
    "or a cluster launcher, as docs/parallelism.md shows).",
    add_arguments=_add_arguments,
    handle=_handle,
    takes_overrides=True,
)
