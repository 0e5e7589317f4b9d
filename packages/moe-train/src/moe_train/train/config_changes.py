"""Which config changes a resumed run accepts: it must see the same model and the same samples.

Refused (unless checkpoint.allow_config_change=true): anything under `model.`, and the data
keys that decide which tokens a step sees. Everything else (steps, layout, optimizer,
precision, checkpointing, logging) is allowed and reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_train.errors import ConfigError

SAMPLE_KEYS = (
    "data.paths",
    "data.mixture",
    "data.seq_len",
    "data.global_batch_size",
    "train.seed",
)
"""Keys that decide which samples a step sees."""


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    now: Any

    def describe(self) -> str:
        return f"{self.key} {self.saved!r} -> {self.now!r}"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def is_refused(key: str) -> bool:
    """Whether changing `key` changes the model or which samples a step sees."""
    return key.startswith("model.") or key in SAMPLE_KEYS


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[Change]:
    """Keys present in both configs whose values differ (keys added since are not changes)."""
    old, new = flatten(saved), flatten(now)
    return [Change(key, old[key], new[key]) for key in new if key in old and old[key] != new[key]]


def check_resume_config(
    saved: dict[str, Any], now: dict[str, Any], source: Path, allow: bool
) -> list[Change]:
    """The changes from the config saved in `source` (a checkpoint, or a run directory's
    config.yaml) that a resumed run may go on with; raises ConfigError on a refused one unless
    `allow`. Returns every change (refused ones too when allowed), for the report."""
    changes = config_changes(saved, now)
    refused = [c for c in changes if is_refused(c.key)]
    if refused and not allow:
        first = refused[0]
        what = "the model" if first.key.startswith("model.") else "which samples a step sees"
        more = f" (also changed: {', '.join(c.key for c in refused[1:])})" if refused[1:] else ""
        raise ConfigError(
            f"{first.key}={first.now!r} differs from {first.saved!r} in {source}: it "
            f"changes {what}{more}; restore it, or set checkpoint.allow_config_change=true"
        )
    return changes
