"""The `moe-train` command line: train, prepare-data, inspect, export, import-hf, generate,
eval, plot, plan, verify. Each command is one module (its arguments and its handler) listed in
COMMANDS; `run` parses a command line and calls the chosen command's handler."""

import argparse
import difflib
import sys

from moe_data import run_command
from moe_train.cli.command import Command
from moe_train.cli.evaluate import EVAL
from moe_train.cli.export import EXPORT
from moe_train.cli.generate import GENERATE
from moe_train.cli.import_hf import IMPORT_HF
from moe_train.cli.inspect_checkpoint import INSPECT
from moe_train.cli.plan import PLAN
from moe_train.cli.plot import PLOT
from moe_train.cli.prepare_data import PREPARE_DATA
from moe_train.cli.train import TRAIN
from moe_train.cli.upcycle import UPCYCLE
from moe_train.cli.verify import VERIFY
from moe_train.errors import MoeTrainError

COMMANDS: tuple[Command, ...] = (
    TRAIN,
    PREPARE_DATA,
    INSPECT,
    EXPORT,
    IMPORT_HF,
    UPCYCLE,
    GENERATE,
    EVAL,
    PLOT,
    PLAN,
    VERIFY,
)
"""Every subcommand, in the order `moe-train --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The `moe-train` parser with one subparser per entry of COMMANDS."""
    parser = argparse.ArgumentParser(
        prog="moe-train", description="Train Mixture-of-Experts language models."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_arguments(
            subparsers.add_parser(command.name, help=command.help, description=command.description)
        )
    return parser


def run(argv: list[str]) -> int:
    """Parse `argv` (without the program name) and run the chosen command."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = next(c for c in COMMANDS if c.name == args.command)
    if extra and not command.takes_overrides:
        # The command's own usage line, not the list of commands.
        sub = _command_parser(parser, command.name)
        sub.error(f"unrecognized arguments: {' '.join(extra)}{_flag_hint(sub, extra)}")
    args.overrides = extra
    return command.handle(args)


def _command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subparser of command `name`."""
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def _flag_hint(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """'; did you mean --workers?' for the first unknown flag close to one of `parser`'s."""
    flags = [flag for action in parser._actions for flag in action.option_strings]
    for arg in extra:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def _error_line(message: str) -> None:
    # One write call: lines of several ranks sharing a pipe do not interleave.
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def _launched_rank() -> int:
    from moe_train.train.runtime import launched_rank

    try:
        return launched_rank()
    except MoeTrainError:
        return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors print one line `error: ...` and exit with the error's code
    (2 for bad input; see moe_train.errors). An error every rank of a launch raises alike is
    printed by rank 0 alone; every rank exits with its code."""

    def report(error: MoeTrainError) -> None:
        if not (error.same_on_every_rank and _launched_rank() != 0):
            _error_line(str(error))  # once per launch for an error every rank raised alike

    return run_command(lambda: run(sys.argv[1:] if argv is None else argv), report)


__all__ = ["COMMANDS", "Command", "build_parser", "main", "run"]
