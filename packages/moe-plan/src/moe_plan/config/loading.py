"""Building a Config from YAML and dotted command-line overrides, and writing it back."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from moe_plan.config.alternatives import check_user_keys
from moe_plan.config.changes import flatten_config
from moe_plan.config.root import Config
from moe_plan.errors import ConfigError

# ---- building a Config from plain data -------------------------------------------------------


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` to type `tp` or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if isinstance(tp, types.UnionType) or origin is typing.Union:  # `bool | Literal[...]`
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is list:
        (item_type,) = typing.get_args(tp)
        if isinstance(value, str | int | float) and item_type is str:
            value = [value]
        if dataclasses.is_dataclass(item_type) and isinstance(value, list | tuple):
            return [_build(item_type, v, f"{key}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, list | tuple):
            return [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}={value!r} must be {_type_name(tp)}")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise ConfigError(_unknown_key_message(full, str(key), names, path))
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, full)
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def _unknown_key_message(full: str, key: str, names: list[str], path: str) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    prefix = f"{path}." if path else ""
    if close:
        return f"unknown config key {full}; did you mean {prefix}{close[0]}?"
    return f"unknown config key {full}; valid keys here: {', '.join(prefix + n for n in names)}"


def _section_type(tp: Any) -> type | None:
    """The dataclass a field holds (directly, or as the items of a list), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return typing.get_args(tp)[0]
    return None


def _first_unknown_key(cls: type, data: Any, path: str) -> str | None:
    """The message for the first key of `data` (nested plain data) that `cls` does not have,
    or None; values are not checked (`_build` does that)."""
    if not isinstance(data, dict):
        return None
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in hints:
            return _unknown_key_message(full, str(key), list(hints), path)
        section = _section_type(hints[key])
        if section is None:
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            where = full if index is None else f"{full}[{index}]"
            found = _first_unknown_key(section, item, where)
            if found:
                return found
    return None


def known_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of `cls`, sections included: ['model', 'model.vocab_size', ...]."""
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            keys += known_keys(tp, f"{prefix}{name}.")
    return keys


def _suggest_keys(dotted: str, known: list[str]) -> list[str]:
    """The known keys a mistyped `dotted` most likely meant: the key of that name when the
    section was left out (`max_steps` -> `train.max_steps`), else the closest dotted key,
    else the closest by last name. Dashes count as underscores (`max-steps`)."""
    wanted = dotted.replace("-", "_")
    by_name: dict[str, list[str]] = {}
    for key in known:
        by_name.setdefault(key.rsplit(".", 1)[-1], []).append(key)
    if "." not in wanted and wanted in by_name:
        return by_name[wanted]
    close = difflib.get_close_matches(wanted, known, n=1, cutoff=0.6)
    if close:
        return close
    name = difflib.get_close_matches(wanted.rsplit(".", 1)[-1], list(by_name), n=1, cutoff=0.8)
    return by_name[name[0]] if name else []


def _check_override_key(flag: str, keys: list[str]) -> None:
    """Refuse an override whose dotted key is not a config key, naming the flag as written
    and the flag it most likely meant."""
    dotted = ".".join(keys)
    known = known_keys()
    if dotted in known:
        return
    guesses = _suggest_keys(dotted, known)
    if guesses:
        hint = "did you mean " + " or ".join(f"--{g}" for g in guesses) + "?"
    else:
        sections = ", ".join(f.name for f in dataclasses.fields(Config))
        hint = f"config keys are written --section.key=value, with sections {sections}"
    raise ConfigError(f"{flag}: unknown config key {dotted}; {hint}")


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from nested plain data (as read from YAML)."""
    config = _build(Config, data, "")
    config.validate()
    return config


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ['--optim.lr=3e-4', '--model.moe.top_k', '2'] into a nested dict."""
    nested: dict[str, Any] = {}
    for flag, keys, value in _split_overrides(args):
        node = nested
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {flag!r} conflicts with another override of {k}")
        node[keys[-1]] = value
    return nested


def _split_overrides(args: list[str]) -> list[tuple[str, list[str], Any]]:
    """Each override as (the flag as written, its dotted key split, its value read as YAML)."""
    overrides = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"override {arg!r} must look like --section.key=value")
        if "=" in arg:
            dotted, raw = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            dotted, raw = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value; write {arg}=VALUE")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        keys = dotted.split(".")
        if any(not k for k in keys):
            raise ConfigError(f"override {arg!r} has an empty key")
        overrides.append((f"--{dotted}", keys, value))
        i += 1
    return overrides


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or start from defaults when `path` is None), apply overrides, and
    refuse a key the user set that the config would not use (`alternatives.check_user_keys`)."""
    data: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {path} is not valid YAML{where}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        unknown = _first_unknown_key(Config, data, "")
        if unknown:
            raise ConfigError(f"{path}: {unknown}")
    for flag, keys, _ in _split_overrides(overrides or []):
        _check_override_key(flag, keys)
    given = parse_overrides(overrides or [])
    config = config_from_dict(_merge(data, given))
    source = str(path) if path is not None else "the config file"
    check_user_keys(config, flatten_config(data), flatten_config(given).keys(), source)
    return config


def dump_config(config: Config, path: Path) -> None:
    """Write the resolved config as YAML that `load_config` reads back to the same Config."""
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
