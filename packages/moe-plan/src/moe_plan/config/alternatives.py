"""Keys the user set that nothing would read: one table of the keys that only one choice of
another option uses, and the checks `load_config` runs on the keys a config file and the
command line set.

These checks read which keys the user set, not only the resolved Config, so they run in
`load_config` alone: a config rebuilt from a saved run's full dictionary (`config_from_dict`:
resume, verify, eval, export) holds every key and is not checked by them. Which keys count:

- every key given on the command line;
- a key of the config file whose value is not its default, unless an option that decides
  whether it is used (its entry's `options`) is changed on the command line (switching an
  option there leaves the file's settings for the choice it replaced unused, not wrong:
  `moe-train train muon.yaml --optim.name=adamw`), or the file holds every key: then it is a
  resolved config as a run writes it (`dump_config`, RUN_DIR/config.yaml), whose values
  record the run rather than choices. A resolved config of an older version (without the
  keys added since) is checked as a hand-written file is (unused keys pass at their defaults).

Not listed: keys a layout size makes unused (parallel.pp_schedule at pp=1, parallel.dispatcher
at ep=1): the planner writes them with the sizes of each layout it prints, and plans one config
at many sizes. Pairings that the sections' own checks already refuse for any value but the
default are not repeated here: model.rope_scaling.* with type=none, optim.decay_steps with
schedule=constant, data.split_long_examples without data.label_mask, model.moe.shared_expert_gate
without shared experts, parallel.virtual_stages without the interleaved schedule. Nor are
keys that look unused but are read: model.dense_hidden without dense layers (the MTP blocks and
Hugging Face exports' intermediate_size), model.moe.lb_scope at lb_loss_weight=0 (the logged
lb_loss), data.cache_dir without built-in data (checksums of token files), optim.betas and
optim.eps with Muon (its AdamW part).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from moe_plan.config.changes import flatten_config
from moe_plan.config.root import Config
from moe_plan.errors import ConfigError


@dataclass(frozen=True)
class Alternative:
    """Keys used only when `holds(config)`: with another choice of `options` nothing reads
    them."""

    keys: tuple[str, ...]
    """Dotted keys used only when the condition holds."""
    options: tuple[str, ...]
    """The keys the condition reads (quoted with their values in the message)."""
    used_with: str
    """The condition in words, as the message ends: 'optim.name=muon'."""
    holds: Callable[[Config], bool]


ALTERNATIVES: tuple[Alternative, ...] = (
    Alternative(
        keys=("optim.muon_momentum", "optim.muon_ns_dtype", "optim.adamw_lr_ratio"),
        options=("optim.name",),
        used_with="optim.name=muon",
        holds=lambda c: c.optim.name == "muon",
    ),
    Alternative(
        keys=("optim.min_lr_ratio",),
        options=("optim.schedule",),
        used_with="a decaying optim.schedule (cosine, linear or wsd)",
        holds=lambda c: c.optim.schedule != "constant",
    ),
    Alternative(
        keys=("parallel.rowwise_transport",),
        options=("parallel.dispatcher", "model.moe.capacity_factor"),
        used_with="parallel.dispatcher=rowwise, or auto with a model.moe.capacity_factor",
        holds=lambda c: (
            c.parallel.dispatcher == "rowwise"
            or (c.parallel.dispatcher == "auto" and c.model.moe.capacity_factor is not None)
        ),
    ),
    Alternative(
        keys=("model.mtp_loss_weight",),
        options=("model.mtp_depth",),
        used_with="model.mtp_depth of 1 or more (multi-token prediction)",
        holds=lambda c: c.model.mtp_depth > 0,
    ),
    Alternative(
        keys=("train.routing_check.balanced_lb_loss",),
        options=("train.routing_check.max_rank_imbalance",),
        used_with="train.routing_check.max_rank_imbalance set (the check on)",
        holds=lambda c: c.train.routing_check.max_rank_imbalance is not None,
    ),
    Alternative(
        keys=("train.routing_check.logged_steps",),
        options=("train.routing_check.max_rank_imbalance", "train.routing_check.max_expert_share"),
        used_with="train.routing_check.max_rank_imbalance or max_expert_share set (a check on)",
        holds=lambda c: (
            c.train.routing_check.max_rank_imbalance is not None
            or c.train.routing_check.max_expert_share is not None
        ),
    ),
    Alternative(
        keys=("checkpoint.keep_last", "checkpoint.async_save"),
        options=("checkpoint.interval", "checkpoint.interval_minutes"),
        used_with="checkpoint.interval or checkpoint.interval_minutes above 0 (checkpointing on)",
        holds=lambda c: c.checkpoint.enabled,
    ),
    Alternative(
        keys=("checkpoint.allow_config_change",),
        options=("checkpoint.resume", "checkpoint.init_from"),
        used_with="checkpoint.resume other than never, or checkpoint.init_from",
        holds=lambda c: c.checkpoint.resume != "never" or c.checkpoint.init_from is not None,
    ),
    Alternative(
        keys=("eval.batches",),
        options=("eval.paths",),
        used_with="eval.paths (held-out data; eval.tasks score whole task files)",
        holds=lambda c: bool(c.eval.paths),
    ),
)
"""Every key that only one choice of another option uses, with that choice."""


def config_value(config: Any, dotted: str) -> Any:
    """The value of `config` at a dotted key ('optim.name')."""
    return functools.reduce(getattr, dotted.split("."), config)


def _shown(value: Any) -> str:
    """A value as YAML writes it: null, true, 0.95, rowwise."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def check_user_keys(
    config: Config, file_values: Mapping[str, Any], command_line: Collection[str], source: str
) -> None:
    """Refuse a key the user set that `config` would not use (see the module docstring).
    `file_values`: the config file's values by dotted key; `command_line`: the dotted keys
    of the overrides; `source`: the file's name, for the message."""
    _check_eval_interval(config, file_values.keys() | set(command_line))
    if _resolved_keys() <= file_values.keys():
        file_values = {}
    default = Config()
    for entry in ALTERNATIVES:
        if entry.holds(config):
            continue
        option_changed = any(option in command_line for option in entry.options)
        for key in entry.keys:
            if key in command_line:
                where = "on the command line"
            elif (
                key in file_values
                and not option_changed
                and config_value(config, key) != config_value(default, key)
            ):
                where = f"in {source}"
            else:
                continue
            now = ", ".join(f"{o}={_shown(config_value(config, o))}" for o in entry.options)
            raise ConfigError(
                f"{key} is set {where} but {now}; it is used only with {entry.used_with}"
            )


@functools.cache
def _resolved_keys() -> frozenset[str]:
    """The dotted keys of a resolved config as `dump_config` writes it."""
    return frozenset(flatten_config(Config().to_dict()))


def _check_eval_interval(config: Config, given: Collection[str]) -> None:
    """An eval.interval with nothing to evaluate, where neither eval.paths nor eval.tasks was
    given at all (an empty list given on purpose turns evaluation off, its interval unused)."""
    evaluation = config.eval
    if not evaluation.interval or evaluation.enabled:
        return
    if "eval.paths" in given or "eval.tasks" in given:
        return
    raise ConfigError(
        f"eval.interval={evaluation.interval} needs eval.paths (held-out data, e.g. a directory "
        f"written by moe-train prepare-data) or eval.tasks (task files); or set eval.interval=0"
    )
