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
and the keys under it. `planned`: the planner's candidate layouts set it.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL, SAMPLES, LAYOUT, RECORDS, NUMBERS = "model", "samples", "layout", "records", "numbers"


@dataclass(frozen=True)
class KeyRule:
    key: str
    changes: str
    """MODEL, SAMPLES, LAYOUT, RECORDS or NUMBERS (see the module's docstring)."""
    planned: bool = False


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
    KeyRule("data.micro_batch_size", NUMBERS, planned=True),
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
    KeyRule("checkpoint.", RECORDS),
    KeyRule("eval.", RECORDS),
)
"""Every key whose change is not NUMBERS, and every key the planner sets."""

PLANNED_KEYS: tuple[str, ...] = tuple(rule.key for rule in KEY_RULES if rule.planned)
"""The keys a layout sets (the planner's candidates differ in these alone)."""

LAYOUT_SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(k.split(".")[0] for k in PLANNED_KEYS))
"""The sections holding PLANNED_KEYS."""


def what_changes(key: str) -> str:
    """What a change of dotted `key` changes: the first row of KEY_RULES that covers it, else
    NUMBERS."""
    for rule in KEY_RULES:
        if rule.key.endswith(".") and key.startswith(rule.key):
            return rule.changes
        if key == rule.key or key.startswith(rule.key + "."):
            return rule.changes
    return NUMBERS


def resume_refuses(key: str) -> bool:
    """Whether a resumed run refuses a change of `key` (it changes the model or the samples)."""
    return what_changes(key) in (MODEL, SAMPLES)


def verify_allows(key: str) -> bool:
    """Whether the two checkpoints `moe-train verify` compares may differ in `key` (it changes
    neither what a step computes nor which samples it sees)."""
    return what_changes(key) in (LAYOUT, RECORDS)
