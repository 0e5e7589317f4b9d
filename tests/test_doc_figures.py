"""Figures of the pages and config headers that come from the code are what the code prints now.

- A fenced block of docs/ right under `<!-- output of: uv run moe-train ... -->` is an excerpt
  of that command's output: its lines, in runs cut by `...` lines, appear in the output as
  written and in order.
- A config header's `moe-train plan ...` figure (`: 103.8 MiB`, `predicts 73.9 GiB`) is the
  memory per device that command prints for the config's own layout.
- docs/planner.md's *Over memory here* figures are the memory the planner predicts.
- docs/interop.md names the keys `generate --json` prints and the stop reasons it can give.
- docs/package-graph.png draws the packages and arrows of packages/*/pyproject.toml.
- The quickstart's model, steps and shipped-config sizes are those of the configs, and its
  example error line (and the README's) is what the config loader says.
"""

import functools
import importlib.util
import json
import re
import shlex
import sys
import typing
from pathlib import Path

import pytest

from doc_commands import shell_blocks
from moe_train.cli import main

ROOT = Path(__file__).resolve().parents[1]
OUTPUT_OF = re.compile(r"^<!-- output of: uv run (moe-train [^>]*?) -->$")
ELLIPSIS = "..."
PLAN_FIGURE = re.compile(r"`(moe-train plan [^`]+)`(?::| predicts) ([\d.,]+ [KMG]iB)")


def excerpts(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number, command, lines) of each fenced block under an `output of` comment."""
    lines = text.splitlines()
    found = []
    for _info, start, body in shell_blocks(text):
        above = lines[start - 3] if start >= 3 else ""  # `start` is the body's first line
        if match := OUTPUT_OF.match(above.strip()):
            found.append((start - 1, match.group(1), body))
    return found


def runs(excerpt: list[str]) -> list[list[str]]:
    """The excerpt's runs of lines between `...` lines, without blank lines at their ends."""
    cut: list[list[str]] = [[]]
    for line in excerpt:
        if line.strip() == ELLIPSIS:
            cut.append([])
        else:
            cut[-1].append(line.rstrip())
    trimmed = []
    for run in cut:
        while run and not run[0]:
            run.pop(0)
        while run and not run[-1]:
            run.pop()
        if run:
            trimmed.append(run)
    return trimmed


def missing_runs(excerpt: list[str], output: str) -> list[list[str]]:
    """The runs of `excerpt` not found in `output`, each after the previous one found."""
    lines = [line.rstrip() for line in output.splitlines()]
    missing, at = [], 0
    for run in runs(excerpt):
        found = next(
            (i for i in range(at, len(lines) - len(run) + 1) if lines[i : i + len(run)] == run),
            None,
        )
        if found is None:
            missing.append(run)
        else:
            at = found + len(run)
    return missing


@functools.cache
def _printed(command: str) -> str:
    """What `command` (`moe-train ...`) prints on stdout, run in this process from the root."""
    import contextlib
    import io
    import os

    words = shlex.split(command, comments=True)
    assert words[0] == "moe-train"
    buffer = io.StringIO()
    before = Path.cwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(buffer):
            main(words[1:])
    finally:
        os.chdir(before)
    return buffer.getvalue()


def _doc_excerpts() -> list[tuple[str, str, list[str]]]:
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for line_no, command, body in excerpts(page.read_text()):
            found.append((f"{page.relative_to(ROOT)}:{line_no}", command, body))
    return found


def test_every_plain_block_of_the_planner_page_is_an_excerpt_of_its_command():
    """Its blocks without a language are what `moe-train plan` prints."""
    text = (ROOT / "docs" / "planner.md").read_text()
    plain = [start - 1 for info, start, _ in shell_blocks(text) if not info]
    annotated = [line_no for line_no, _, _ in excerpts(text)]
    assert plain and plain == annotated, (
        "docs/planner.md: each block of output needs the line "
        "`<!-- output of: uv run moe-train plan ... -->` above it"
    )


@pytest.mark.parametrize(
    "where, command, body", [pytest.param(*excerpt, id=excerpt[0]) for excerpt in _doc_excerpts()]
)
def test_each_excerpt_is_what_its_command_prints_now(where, command, body):
    missing = missing_runs(body, _printed(command))
    assert not missing, (
        f"{where}: these lines are not in what `uv run {command}` prints now (in order); "
        "paste the current output:\n" + "\n\n".join("\n".join(run) for run in missing)
    )


def test_the_excerpt_check_finds_a_changed_or_reordered_line():
    output = "a\nb\n\nc 1\nd\ne\n"
    assert missing_runs(["a", "b", "...", "", "d", "e", ""], output) == []
    assert missing_runs(["a", "...", "c 2"], output) == [["c 2"]]
    assert missing_runs(["d", "...", "a"], output) == [["a"]]
    assert missing_runs(["a", "d"], output) == [["a", "d"]]  # not adjacent: needs a `...`
    text = "x\n<!-- output of: uv run moe-train plan c.yaml --gpus 8 -->\n```\nout\n```\n"
    assert excerpts(text) == [(3, "moe-train plan c.yaml --gpus 8", ["out"])]


def _header(path: Path) -> str:
    """The leading comment lines of a config, joined into one text."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines)


def test_config_headers_give_the_memory_plan_prints():
    checked = 0
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        for command, figure in PLAN_FIGURE.findall(_header(path)):
            printed = _printed(command)
            assert f"memory per device {figure} of" in printed, (
                f"{path.relative_to(ROOT)}: `{command}` prints "
                + next(line.strip() for line in printed.splitlines() if "memory per" in line)
                + f", not {figure}"
            )
            checked += 1
    assert checked >= 4, "the config headers lost their planner figures"


def _top_level_and_grouped(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """The `code` spans of `text` outside parentheses, and those inside the parenthesis that
    follows each one."""
    top: list[str] = []
    grouped: dict[str, list[str]] = {}
    depth, last = 0, ""
    for match in re.finditer(r"`([^`]+)`|\(|\)", text):
        if match.group(0) == "(":
            depth += 1
        elif match.group(0) == ")":
            depth -= 1
        elif depth == 0:
            last = match.group(1)
            top.append(last)
        else:
            grouped.setdefault(last, []).append(match.group(1))
    return top, grouped


def test_interop_names_what_generate_json_prints(monkeypatch, capsys):
    import moe_train.generate as generate_module

    page = (ROOT / "docs" / "interop.md").read_text()
    sentence = page.split("With `--json`, one\n  object:", 1)[1].split("\n\n", 1)[0]
    keys, grouped = _top_level_and_grouped(sentence)
    reasons = [word for word in grouped.get("stop_reason", []) if re.fullmatch(r"[a-z_]+", word)]

    result = generate_module.Generated(Path("ckpt"), [1], [2], None, "length")
    monkeypatch.setattr(generate_module, "generate", lambda *args, **kwargs: result)
    assert main(["generate", "ckpt", "--prompt-ids", "1", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert keys == list(printed), "docs/interop.md: the keys of `generate --json`"
    hints = typing.get_type_hints(generate_module.Generated)
    assert reasons == list(typing.get_args(hints["stop_reason"])), (
        "docs/interop.md: the stop reasons of `generate --json`"
    )


def test_the_quickstart_pages_describe_the_tiny_config():
    from moe_plan.config import load_config

    model = load_config(ROOT / "configs" / "tiny.yaml", []).model
    steps = load_config(ROOT / "configs" / "tiny.yaml", []).train.max_steps
    for page in (ROOT / "README.md", ROOT / "docs" / "quickstart.md"):
        text = " ".join(page.read_text().split())
        found = re.search(r"trains a (\d+)-layer, (\d+)-expert MoE for (\d+) steps", text)
        assert found, f"{page.name}: the sentence on the first command's model"
        said = tuple(int(n) for n in found.groups())
        assert said == (model.n_layers, model.moe.num_experts, steps), page.name


def test_the_quickstart_gives_the_shipped_configs_sizes():
    from moe_plan.config import load_config
    from moe_plan.config.accounting import count_params

    text = " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    sizes = re.findall(r"`([\w-]+)` \([^()]*?([\d.]+)B total, ([\d.]+)B active", text)
    assert len(sizes) >= 2, "docs/quickstart.md: the shipped configs' sizes"
    for name, total, active in sizes:
        counts = count_params(load_config(ROOT / "configs" / f"{name}.yaml", []).model)
        for said, count in ((total, counts.total), (active, counts.active)):
            decimals = len(said.partition(".")[2])
            assert float(said) == round(count / 1e9, decimals), f"{name}: {said}B, not {count:,}"


def test_the_over_memory_figures_are_the_planners():
    """docs/planner.md, *Over memory here*: each published layout's memory by category, and
    the totals its prose gives, from `predict_memory` at the config's published point."""
    from moe_plan.calibration import published_points
    from moe_plan.config import load_config
    from moe_plan.hardware import DEVICES
    from moe_plan.memory import predict_memory

    gib = 2**30
    points = {point.config.name: point for point in published_points(ROOT / "configs")}

    def memory(name: str):
        point = points[name]
        return predict_memory(load_config(point.config, []), point.gpus), DEVICES[point.gpu]

    section = (ROOT / "docs" / "planner.md").read_text().split("\n### Over memory here\n")[1]
    rows = re.findall(r"^\| `(published-[\w-]+\.yaml)` \|(.*)\|$", section, re.MULTILINE)
    assert len(rows) == 2, "docs/planner.md: the table of Over memory here"
    without_slack = []
    for name, cells in rows:
        m, device = memory(name)
        expected = [
            f"{m.weights / gib:.2f}",
            f"{m.gradients / gib:.2f}",
            f"{m.optimizer / gib:.2f}",
            f"{m.activations * m.in_flight / gib:.2f} (x {m.in_flight:g})",
            f"{m.slack / gib:.2f}",
            f"{m.total / gib:.1f}",
            f"{device.memory_gib:.1f}",
        ]
        assert [cell.strip() for cell in cells.split("|")] == expected, name
        without_slack.append(f"{(m.total - m.slack) / gib:.1f}")
    prose = " ".join(section.split())
    assert f"still over ({' and '.join(without_slack)} GiB)" in prose
    fits, _ = memory("published-qwen3-235b-a22b-b200.yaml")
    assert f"on 256 B200 ({fits.total / gib:.1f} GiB) fits" in prose


def test_the_error_line_of_readme_and_quickstart_is_the_configs():
    from moe_plan.config import load_config
    from moe_train.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        load_config(ROOT / "configs" / "tiny.yaml", ["--model.moe.top_k=999"])
    line = f"error: {error.value}"
    for page in (ROOT / "README.md", ROOT / "docs" / "quickstart.md"):
        assert f"`{line}`" in " ".join(page.read_text().split()), page.name


def _package_graph_script():
    spec = importlib.util.spec_from_file_location(
        "package_graph", ROOT / "scripts/package_graph.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_package_picture_draws_the_pyproject_dependencies(tmp_path):
    graph = _package_graph_script()
    packages = graph.read_packages()
    assert len(packages) == len(list((ROOT / "packages").glob("*/pyproject.toml")))
    assert graph.drawn_graph(graph.PICTURE) == graph.described(packages), (
        "docs/package-graph.png is out of date: run `uv run python scripts/package_graph.py`"
    )
    # A package gaining an arrow makes the stored graph differ.
    first = packages[0]
    changed = [first.__class__(first.name, first.module, (*first.siblings, "moestack-x"), False)]
    assert graph.described(changed + packages[1:]) != graph.described(packages)
    # What draw() stores is what drawn_graph() reads back.
    graph.draw(packages[:2], tmp_path / "two.png")
    assert graph.drawn_graph(tmp_path / "two.png") == graph.described(packages[:2])
