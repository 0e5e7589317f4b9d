"""Command-line argument types the benchmarks share."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


def names_among(valid: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names, each one of `valid` (else one line
    naming the unknown ones and the valid ones)."""

    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in valid]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown)}; valid: {', '.join(valid)}"
            )
        return names

    return parse
