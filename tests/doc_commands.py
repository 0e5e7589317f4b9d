"""The shell commands of the README and the documentation pages, as a reader would type them."""

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHELL_FENCES = frozenset({"bash", "sh", "shell", "console"})
"""Info strings of the fenced blocks whose lines are commands."""
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_HEREDOC = re.compile(r"^<<-?\s*['\"]?(\w+)['\"]?$")
_PROMPT = "$ "
"""Where a `console` block has a command; its other lines are output."""


@dataclass(frozen=True)
class DocCommand:
    """One command of a page: where it starts, and its words with a leading `uv run` dropped."""

    where: str
    words: tuple[str, ...]
    uv_run: bool

    @property
    def key(self) -> str:
        """The words joined by spaces, each word's inner white space collapsed (a flow mapping
        over two lines reads the same on one): how a registry of commands names it."""
        return " ".join(" ".join(word.split()) for word in self.words)


def shell_blocks(text: str) -> Iterator[tuple[str, int, list[str]]]:
    """(info string, line number of the block's first line, its lines) per fenced block."""
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        index += 1
        if match is None:
            continue
        indent, fence, info = match.groups()
        start, body = index + 1, []
        while index < len(lines) and not lines[index].strip().startswith(fence):
            body.append(lines[index].removeprefix(indent))
            index += 1
        index += 1  # the closing fence
        yield info.lower(), start, body


def _split(text: str) -> list[str] | None:
    """The shell words of `text` (comments dropped), or None while a quote is open."""
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return None


def block_commands(info: str, start: int, lines: list[str]) -> Iterator[tuple[int, list[str]]]:
    """(line number, words) of each command of one block: continued over lines ending in a
    backslash and over line breaks inside quotes; a here-document's lines are its input."""
    index = 0
    while index < len(lines):
        line_no, text = start + index, lines[index]
        index += 1
        if info == "console":
            if not text.startswith(_PROMPT):
                continue
            text = text.removeprefix(_PROMPT)
        while index < len(lines) and (text.endswith("\\") or _split(text) is None):
            # a backslash joins the lines; a line break inside quotes stays in the word
            text = text.removesuffix("\\") if text.endswith("\\") else text + "\n"
            text += lines[index]
            index += 1
        words = _split(text)
        if not words:
            continue
        heredoc = next((m.group(1) for w in words if (m := _HEREDOC.match(w))), None)
        if heredoc is not None:
            while index < len(lines) and lines[index].strip() != heredoc:
                index += 1
            index += 1
        yield line_no, words


def doc_commands(root: Path, pages: list[Path]) -> list[DocCommand]:
    """Every command in a shell block of `pages` that starts with `uv run` or `moe-train`."""
    found = []
    for page in pages:
        for info, start, lines in shell_blocks(page.read_text()):
            if info not in SHELL_FENCES:
                continue
            for line_no, words in block_commands(info, start, lines):
                uv_run = words[:2] == ["uv", "run"]
                if uv_run or words[0] == "moe-train":
                    where = f"{page.relative_to(root)}:{line_no}"
                    found.append(DocCommand(where, tuple(words[2:] if uv_run else words), uv_run))
    return found
