"""The ways `vs_fsdp.py` trains the model: the designs, their dispatchers and optimizers.

Plain data with no torch import, so that the command line answers bad arguments at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EP = 4
"""Ranks of every run, and expert-parallel ranks of the "ep" design (the whole world)."""


@dataclass(frozen=True)
class Variant:
    """One way to train: a design, its token dispatcher and whether the optimizer is sharded."""

    design: Literal["ep", "fsdp"]
    dispatcher: Literal["all_to_all", "rowwise", "local"]
    distributed_optimizer: bool = False

    @property
    def name(self) -> str:
        if self.design == "fsdp":
            return "fsdp"
        return f"ep/{self.dispatcher}" + ("/dist-opt" if self.distributed_optimizer else "")


VARIANTS = (
    Variant("ep", "all_to_all"),
    Variant("ep", "all_to_all", distributed_optimizer=True),
    Variant("ep", "rowwise"),
    Variant("ep", "rowwise", distributed_optimizer=True),
    Variant("fsdp", "local"),
)
