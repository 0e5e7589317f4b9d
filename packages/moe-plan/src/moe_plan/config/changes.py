"""How two saved configs differ, key by key: the one comparison that resume and verify use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Change:
    """A config key whose value differs from the saved run's."""

    key: str
    """Dotted key (``model.moe.top_k``)."""
    saved: Any
    now: Any

    def describe(self) -> str:
        return f"{self.key} {self.saved!r} -> {self.now!r}"


def flatten_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested config dict, in its order: ``{'a': {'b': 1}}`` gives
    ``{'a.b': 1}``; an empty section stays a key with the value ``{}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[Change]:
    """Keys of both configs (as `Config.to_dict` writes them) whose values differ, in the
    order of `now`. A key only one of them has is not a change: a config saved by an older
    version lacks the keys added since, which hold their defaults."""
    old, new = flatten_config(saved), flatten_config(now)
    return [Change(key, old[key], new[key]) for key in new if key in old and old[key] != new[key]]
