"""The generated reference pages (docs/reference/) are current, and complete: every key of a
run's config.yaml and every flag of every subcommand is on them."""

import importlib.util
import re
from pathlib import Path

import yaml

from moe_plan.config import dump_config, load_config
from moe_train.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    """scripts/gen_reference.py, loaded by path (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts" / "gen_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flat_keys(tree: dict, prefix: str = "") -> set[str]:
    """Dotted keys of a config mapping; the items of a list of sections as `key[].item`."""
    keys = set()
    for name, value in tree.items():
        keys.add(f"{prefix}{name}")
        if isinstance(value, dict):
            keys |= _flat_keys(value, f"{prefix}{name}.")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for item in value:
                keys |= _flat_keys(item, f"{prefix}{name}[].")
    return keys


def test_committed_reference_pages_are_current():
    generator = _generator()
    for path, text in generator.pages().items():
        committed = (ROOT / path).read_text()
        assert committed == text, f"{path} is stale: run `uv run python scripts/gen_reference.py`"
    assert generator.main(["--check"]) == 0


def test_check_names_the_stale_page(tmp_path, capsys):
    generator = _generator()
    for path, text in generator.pages().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert generator.stale_pages(tmp_path) == []
    edited = tmp_path / generator.CONFIG_PAGE
    edited.write_text(edited.read_text().replace("Routed experts per MoE layer.", "Experts."))
    assert generator.stale_pages(tmp_path) == [generator.CONFIG_PAGE]
    (tmp_path / generator.CLI_PAGE).unlink()
    assert generator.stale_pages(tmp_path) == [generator.CONFIG_PAGE, generator.CLI_PAGE]


def test_config_reference_lists_every_key_of_a_runs_config_yaml(tmp_path):
    mixture = "--data.mixture=[{name: a, paths: [builtin:stdlib], weight: 1}]"
    config = load_config(ROOT / "configs" / "tiny.yaml", [mixture])
    dump_config(config, tmp_path / "config.yaml")
    keys = _flat_keys(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert {"model.moe.top_k", "train.routing_check.logged_steps", "data.mixture[].weight"} <= keys
    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    sections = {key for key in keys if "." not in key}
    assert sections == set(re.findall(r"^## (\w+)$", page, re.MULTILINE))
    documented = set(re.findall(r"^\| `([^`]+)` \|", page, re.MULTILINE))
    assert sorted(keys - sections - documented) == []
    assert sorted(documented - keys) == []


def test_every_config_key_has_a_docstring():
    undocumented = [key.name for key in _generator().config_keys() if not key.doc]
    assert undocumented == [], "config fields without a docstring"


def test_cli_reference_lists_every_subcommand_and_flag():
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.choices and a.dest == "command"]
    for name, sub in subparsers.choices.items():
        section = page.split(f"\n## moe-train {name}\n", 1)[1].split("\n## ", 1)[0]
        assert sub.description in section
        for action in sub._actions:
            if "--help" in action.option_strings:
                continue
            for flag in action.option_strings:
                assert f"`{flag}" in section, f"{flag} of {name} is missing"
            if action.help:
                assert action.help in section, f"the help of {action.dest} of {name} is missing"
