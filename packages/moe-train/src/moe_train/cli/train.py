"""`moe-train train CONFIG.yaml [--section.key=value ...]`."""

import argparse
import sys
from pathlib import Path

from moe_train.cli.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="YAML config file")


def _handle(args: argparse.Namespace) -> int:
    """Train; exit 0 when the run reached train.max_steps (now or before), PREEMPTED_EXIT
    when a signal stopped it early."""
    from moe_train.config import load_config
    from moe_train.errors import MoeTrainError, on_every_rank
    from moe_train.signals import PREEMPTED_EXIT, StopRequests

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
            from moe_train.train.runtime import leave_report_to_rank_0

            leave_report_to_rank_0(e, stops)
            raise
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


TRAIN = Command(
    name="train",
    help="train a model from a YAML config",
    description="Train from CONFIG.yaml; override any key with --section.key=value.",
    add_arguments=_add_arguments,
    handle=_handle,
    takes_overrides=True,
)
