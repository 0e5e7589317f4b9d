"""One subcommand of `moe-train`: its name, its help texts, its arguments and its handler."""

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Command:
    name: str
    """The word after `moe-train` that selects this command."""
    help: str
    """One line in the list of `moe-train --help`."""
    description: str
    """The paragraph at the top of `moe-train NAME --help`."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the command's own arguments to its parser."""
    handle: Callable[[argparse.Namespace], int]
    """Runs the command on the parsed arguments and returns the exit code."""
    takes_overrides: bool = False
    """Unknown `--section.key=value` arguments reach the handler as `args.overrides`; without
    this they are refused as unrecognized arguments."""
