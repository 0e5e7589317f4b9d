"""The layouts the planner proposes for a small config on 8 ranks start, and give the single
process's losses: the planner proposes only layouts the trainer runs as one process would."""

from __future__ import annotations

import itertools
import operator
from pathlib import Path
from unittest import mock

import pytest

from harness.ranks import run_distributed
from moe_plan import DEVICES, layout_overrides, make_plan
from moe_plan import layouts as planner_layouts
from moe_plan.config import Config, load_config
from moe_plan.config.key_rules import PLANNED_KEYS
from moe_plan.config.start_check import check_start
from moe_train.train import train
from training import assert_losses_match, save_config, small_config_data

WORLD = 8
STEPS = 2
"""The first loss checks each layout's forward, the second its backward and update (a fault
that changes the gradients' direction; Adam and clipping hide a uniform scale of them)."""
CHUNK = 8
"""Fewest positions per context-parallel chunk the planner tries here, in place of its
`MIN_CHUNK` (a judgement of speed, not of what runs): the 32 positions of this config's
sequences then give it cp2."""
RUNNING = [
    "--train.progress=false",
    "--eval.interval=0",
    "--checkpoint.interval=0",
    "--checkpoint.interval_minutes=0",
]
"""Overrides of every run: no bar, no scoring, no checkpoints."""


def _base_data(token_file: Path) -> dict:
    """A 4-layer model of 8 experts (pp 1, 2, 4; interleaved at pp2; ep up to 8), batches of
    16 sequences of 32 positions (cp2; micro-batches of 1, 2 and 4), fp32."""
    return small_config_data(
        Path("run"),
        token_file,
        model={"n_layers": 4, "d_model": 16, "moe": {"num_experts": 8, "expert_hidden": 16}},
        data={"global_batch_size": 16, "micro_batch_size": 16},
        train={"max_steps": STEPS},
    )


def planned_layouts(base: Config) -> dict[str, Config]:
    """The layouts the planner proposes for `base` on WORLD ranks (all that fit), by label."""
    with mock.patch.object(planner_layouts, "MIN_CHUNK", CHUNK):
        plan = make_plan(base, WORLD, DEVICES["h100"], search=False)
    return {r.label: r.config for r in plan.fitting}


def _choices(layout: Config) -> set[tuple]:
    """Each pair of the layout's values of two keys a layout sets."""
    values = [(key, operator.attrgetter(key)(layout)) for key in PLANNED_KEYS]
    return set(itertools.combinations(values, 2))


def covering(layouts: dict[str, Config]) -> list[str]:
    """Labels of a few of `layouts` that together hold every pair of choices (two keys' values)
    any of them holds: each next the one that adds the most pairs (the first, of equals)."""
    pairs = {label: _choices(layout) for label, layout in layouts.items()}
    missing = set().union(*pairs.values())
    chosen = []
    while missing:
        label = max(pairs, key=lambda label: len(pairs[label] & missing))
        chosen.append(label)
        missing -= pairs[label]
    return chosen


def _train_layouts(
    rank: int, world_size: int, config_path: str, run_root: str, layouts: dict[str, list[str]]
) -> dict[str, list[float]]:
    """Body for `run_distributed`: train each layout (its overrides) in turn; losses by label."""
    losses = {}
    for i, (label, overrides) in enumerate(layouts.items()):
        run = [*RUNNING, f"--train.run_dir={run_root}/{i}"]
        losses[label] = train(load_config(Path(config_path), [*overrides, *run])).losses
    return losses


@pytest.mark.slow
def test_planned_layouts_start_and_match_one_process(shared_token_file, tmp_path):
    """Of the 360 layouts the planner proposes, the 16 that hold every pair of its choices
    (pp, ep, cp, schedule, micro-batch size, recompute, distributed optimizer) are trained in
    one spawn of 8 ranks, each from the overrides the planner prints for it."""
    config_path = save_config(tmp_path / "base.yaml", _base_data(shared_token_file))
    base = load_config(config_path)
    layouts = planned_layouts(base)
    chosen = covering(layouts)
    assert (len(layouts), len(chosen)) == (360, 16)
    overrides = {label: layout_overrides(layout, base) for label, layout in layouts.items()}
    for label in layouts:  # each starts as `moe-train train` loads its overrides
        loaded = load_config(config_path, overrides[label])
        check_start(loaded, WORLD)
        assert planner_layouts.layout_label(loaded, WORLD) == label
    per_rank = run_distributed(
        _train_layouts,
        world_size=WORLD,
        args=(str(config_path), str(tmp_path / "runs"), {k: overrides[k] for k in chosen}),
        timeout=900,
    )
    single = {}
    for label in chosen:
        micro = layouts[label].data.micro_batch_size
        if micro not in single:
            run = [
                *RUNNING,
                f"--data.micro_batch_size={micro}",
                f"--train.run_dir={tmp_path}/{micro}",
            ]
            single[micro] = train(load_config(config_path, run)).losses
        assert all(r[label] == per_rank[0][label] for r in per_rank), f"{label}: ranks disagree"
        assert_losses_match(label, per_rank[0][label], single[micro])
