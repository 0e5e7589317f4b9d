"""`moe-train verify CKPT_A CKPT_B [--parallel.key=value ...]`."""

import argparse
from pathlib import Path

from moe_train.cli.command import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_a", type=Path, metavar="CKPT_A")
    parser.add_argument("checkpoint_b", type=Path, metavar="CKPT_B")


def _handle(args: argparse.Namespace) -> int:
    from moe_train.errors import MoeTrainError
    from moe_train.verify import format_verdict, verify

    try:
        verdict, a, b = verify(args.checkpoint_a, args.checkpoint_b, layout=args.overrides)
    except MoeTrainError as e:
        from moe_train.train.runtime import leave_report_to_rank_0

        leave_report_to_rank_0(e)  # rank 0 alone prints an error every rank raised alike
        raise
    if verdict is None:  # not rank 0
        return 0
    print(format_verdict(verdict, a, b))
    return 0 if verdict.ok else 1


VERIFY = Command(
    name="verify",
    help="replay a run from checkpoint A to checkpoint B's step and compare with B",
    description="Replay training from CKPT_A to CKPT_B's step with A's config, data and "
    "seeds (refused when a data file's sha256 no longer matches A's manifest) and compare "
    "every tensor with CKPT_B: bitwise on the layout that wrote B, within a stated "
    "tolerance on another. Run it as training runs (torchrun for several ranks); "
    "--parallel.key=value sets the replay's layout, and so does --data.micro_batch_size "
    "where the model's numbers do not depend on it (model.moe.lb_scope sequence or "
    "global_batch, no capacity_factor).",
    add_arguments=_add_arguments,
    handle=_handle,
    takes_overrides=True,
)
