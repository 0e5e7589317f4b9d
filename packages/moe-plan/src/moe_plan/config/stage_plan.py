"""Which stages and layers each pipeline rank holds: the layers split evenly into
pp x virtual stages, stage `s` on pp rank `s % pp`. Torch-free: the trainer's pipeline builds
its stages from it, and the planner counts each rank's layers with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePlan:
    """Which stages, layers and ends of the model one pp rank holds."""

    num_stages: int
    stages: tuple[int, ...]
    """Global indices of this rank's stages, in order."""
    layers_of_stage: dict[int, tuple[int, ...]]
    """Global layer indices of each of this rank's stages."""

    @property
    def layers(self) -> list[int]:
        return [layer for stage in self.stages for layer in self.layers_of_stage[stage]]

    @property
    def has_first(self) -> bool:
        return 0 in self.stages

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stages


def plan_stages(n_layers: int, pp: int, pp_rank: int, virtual_stages: int = 1) -> StagePlan:
    """The stages of pp rank `pp_rank` when `n_layers` split evenly into pp x virtual stages."""
    num_stages = pp * virtual_stages
    per_stage = n_layers // num_stages
    stages = tuple(pp_rank + v * pp for v in range(virtual_stages))
    return StagePlan(
        num_stages=num_stages,
        stages=stages,
        layers_of_stage={s: tuple(range(s * per_stage, (s + 1) * per_stage)) for s in stages},
    )
