"""The README and the site's index lead to every page and command, and what the pages' commands
write into a clone is ignored by git."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from doc_commands import doc_commands
from moe_train.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OUTPUT_FLAGS = ("--out", "--train.run_dir", ">")
"""Flags (and the shell's redirection) whose value a command writes: a directory or file."""
WRITTEN_BY_SCRIPTS = re.compile(r"\b(?:Path|save|save_pretrained)\(\"([^\"]+)\"\)")
"""Where the pages' Python snippets write: `Path("corpus").mkdir()`, `tokenizer.save("x")`."""


def _section(text: str, heading: str) -> str:
    """The text under `## heading`, up to the next heading of that level."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _links(text: str) -> set[str]:
    """The relative link targets of a Markdown text, without their #anchor."""
    return {target.split("#")[0] for target in re.findall(r"\]\(([^):]+)\)", text)} - {""}


def _nav_files(node: object) -> list[str]:
    """The page files of mkdocs.yml's nav, in order."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    return []


def _pages() -> set[str]:
    """Every page of the site, relative to docs/."""
    return {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}


def test_the_readme_commands_table_names_every_command():
    table = _section((ROOT / "README.md").read_text(), "Commands")
    listed = re.findall(r"^\| `moe-train ([\w-]+)", table, re.MULTILINE)
    (subparsers,) = [a for a in build_parser()._actions if a.dest == "command"]
    assert sorted(listed) == sorted(subparsers.choices), "README.md, Commands: one row a command"


def test_nav_readme_and_index_link_every_page():
    pages = _pages()
    nav = _nav_files(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert sorted(nav) == sorted(pages), "mkdocs.yml nav: every page of docs/, once"
    readme_text = (ROOT / "README.md").read_text()
    readme = _links(readme_text)
    index = _links((DOCS / "index.md").read_text())
    assert sorted(pages - {"index.md"} - {p.removeprefix("docs/") for p in readme}) == [], (
        "pages README.md does not link"
    )
    assert sorted(pages - {"index.md"} - index) == [], "pages docs/index.md does not link"
    broken = [target for target in readme if not (ROOT / target).exists()]
    broken += [target for target in index if not (DOCS / target).exists()]
    assert broken == [], "links to no file"


def test_readme_and_packages_page_show_the_same_packages():
    def tree(text: str) -> str:
        return text.split("\n```\n", 1)[1].split("\n```\n", 1)[0]

    readme = tree(_section((ROOT / "README.md").read_text(), "Packages"))
    assert readme == tree((DOCS / "packages.md").read_text()), "README.md's tree, packages.md's"
    names = {
        re.search(r'^name = "([^"]+)"', (path).read_text(), re.MULTILINE).group(1)
        for path in (ROOT / "packages").glob("*/pyproject.toml")
    }
    assert set(re.findall(r"^(moestack-\S+)", readme, re.MULTILINE)) == names


def _written_paths() -> dict[str, str]:
    """What the pages' commands and snippets write, relative to the working directory: path
    to where the page says so."""
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    written = {}
    for command in doc_commands(ROOT, pages):
        words = list(command.words)
        for i, word in enumerate(words):
            flag, _, value = word.partition("=")
            if flag in OUTPUT_FLAGS and (value or i + 1 < len(words)):
                written[value or words[i + 1]] = command.where
    for page in pages:
        for path in WRITTEN_BY_SCRIPTS.findall(page.read_text()):
            written[path] = str(page.relative_to(ROOT))
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        run_dir = yaml.safe_load(config.read_text()).get("train", {}).get("run_dir")
        if run_dir:
            written[run_dir] = str(config.relative_to(ROOT))
    return written


def _git(*args: str, stdin: str = "") -> str:
    try:
        result = subprocess.run(
            ["git", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60
        )
    except FileNotFoundError:
        pytest.skip("no git")
    if result.returncode > 1:  # check-ignore: 1 when nothing matched
        pytest.skip(f"not a git clone: {result.stderr.strip()}")
    return result.stdout


def test_what_the_pages_commands_write_is_ignored():
    written = _written_paths()
    assert {"data/chat-train", "imported", "plan.json", "tiny-chat-moe"} <= set(written)
    tracked = set(_git("ls-files").splitlines())
    paths = sorted(path for path in written if path not in tracked)  # e.g. a figure of docs/
    answer = _git("check-ignore", "--verbose", "--non-matching", "--stdin", stdin="\n".join(paths))
    not_ignored = [line.split("\t", 1)[1] for line in answer.splitlines() if line.startswith("::")]
    assert not not_ignored, "\n".join(
        f"{written[path]} writes {path}, which .gitignore does not cover" for path in not_ignored
    )
