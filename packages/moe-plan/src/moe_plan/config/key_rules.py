"""What a change of each config key changes: the one table that resume, verify and the
planner read (and `Config.validate_layout`, for the sections a layout sets).

- MODEL and SAMPLES keys change the model or which samples a step sees: a resumed run refuses
  a change of them (unless checkpoint.allow_config_change), and verify refuses a pair whose
  configs differ in them.
- LAYOUT keys change how a step is split over ranks, not what it computes (but for the order
  of sums): verify replays on another one, within a tolerance.
- RECORDS keys change only logging and where files go.
- Any other key (steps, optimizer settings, precision, micro-batch size) changes the numbers a
  step computes: a resumed run goes on with it (and reports it), verify refuses it.

A row's key ending in "." stands for every key under it; the others stand for the key itself
and the keys under it. `planned`: the planner's candidate layouts set it. `layout_unless`: of a
NUMBERS key that changes only the order of sums in some models, why it changes the numbers of
a given config (None: there it is a LAYOUT key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_plan.config.root import Config

MODEL, SAMPLES, LAYOUT, RECORDS, NUMBERS = "model", "samples", "layout", "records", "numbers"


@dataclass(frozen=True)
class KeyRule:
    key: str
    changes: str
    """MODEL, SAMPLES, LAYOUT, RECORDS or NUMBERS (see the module's docstring)."""
    planned: bool = False
    layout_unless: Callable[[Config], str | None] | None = None


def _micro_batch_counts(config: Config) -> str | None:
    """Why the micro-batch size changes what `config`'s steps compute (None: it changes only
    the order of sums)."""
    moe = config.model.moe
    if moe.lb_scope == "micro_batch" and moe.lb_loss_weight:
        return "model.moe.lb_scope=micro_batch balances the experts over each micro-batch"
    if moe.capacity_factor is not None:
        return (
            f"model.moe.capacity_factor={moe.capacity_factor} caps each expert's tokens "
            "per micro-batch"
        )
    return None


KEY_RULES: tuple[KeyRule, ...] = (
    KeyRule("model.", MODEL),
    KeyRule("data.paths", SAMPLES),
    KeyRule("data.mixture", SAMPLES),
    KeyRule("data.seq_len", SAMPLES),
    KeyRule("data.global_batch_size", SAMPLES),
    KeyRule("train.seed", SAMPLES),
    KeyRule("parallel.pp", LAYOUT, planned=True),
    KeyRule("parallel.ep", LAYOUT, planned=True),
    KeyRule("parallel.cp", LAYOUT, planned=True),
    KeyRule("parallel.pp_schedule", LAYOUT, planned=True),
    KeyRule("parallel.virtual_stages", LAYOUT, planned=True),
    KeyRule("data.micro_batch_size", NUMBERS, planned=True, layout_unless=_micro_batch_counts),
    KeyRule("parallel.recompute", LAYOUT, planned=True),
    KeyRule("parallel.distributed_optimizer", LAYOUT, planned=True),
    KeyRule("precision.param_dtype", NUMBERS, planned=True),
    KeyRule("precision.expert_gemm", NUMBERS, planned=True),
    KeyRule("parallel.", LAYOUT),
    KeyRule("train.run_dir", RECORDS),
    KeyRule("train.progress", RECORDS),
    KeyRule("train.log_interval", RECORDS),
    KeyRule("train.peak_flops", RECORDS),
    KeyRule("train.tensorboard", RECORDS),
    KeyRule("train.wandb_project", RECORDS),
    KeyRule("train.routing_check", RECORDS),
    KeyRule("train.profile", RECORDS),
    KeyRule("checkpoint.", RECORDS),
    KeyRule("eval.", RECORDS),
)
"""Every key whose change is not NUMBERS, and every key the planner sets."""

PLANNED_KEYS: tuple[str, ...] = tuple(rule.key for rule in KEY_RULES if rule.planned)
"""The keys a layout sets (the planner's candidates differ in these alone)."""

LAYOUT_SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(k.split(".")[0] for k in PLANNED_KEYS))
"""The sections holding PLANNED_KEYS."""


def _rule(key: str) -> KeyRule | None:
    """The first row of KEY_RULES that covers dotted `key`."""
    for rule in KEY_RULES:
        if rule.key.endswith(".") and key.startswith(rule.key):
            return rule
        if key == rule.key or key.startswith(rule.key + "."):
            return rule
    return None


def what_changes(key: str, config: Config | None = None) -> str:
    """What a change of dotted `key` changes (in `config`'s run, where given): its row of
    KEY_RULES, else NUMBERS."""
    rule = _rule(key)
    if rule is None:
        return NUMBERS
    if rule.layout_unless is not None and config is not None and not rule.layout_unless(config):
        return LAYOUT
    return rule.changes


def why_numbers(key: str, config: Config) -> str | None:
    """Of a key that changes the numbers only in some models, why it does in `config`'s."""
    rule = _rule(key)
    return rule.layout_unless(config) if rule and rule.layout_unless else None


def resume_refuses(key: str) -> bool:
    """Whether a resumed run refuses a change of `key` (it changes the model or the samples)."""
    return what_changes(key) in (MODEL, SAMPLES)


def verify_allows(key: str, config: Config | None = None) -> bool:
    """Whether the two checkpoints `moe-train verify` compares (of `config`'s run, where given)
    may differ in `key` (it changes neither what a step computes, but for the order of sums,
    nor which samples it sees)."""
    return what_changes(key, config) in (LAYOUT, RECORDS)
