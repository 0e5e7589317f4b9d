"""Checks shared by the config sections: fields that must be positive or non-negative."""

from __future__ import annotations

from typing import Any

from moe_plan.errors import ConfigError


def _positive(obj: Any, path: str, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(f"{path}.{name}={getattr(obj, name)} must be positive")


def _non_negative(obj: Any, path: str, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ConfigError(f"{path}.{name}={getattr(obj, name)} must be >= 0")
