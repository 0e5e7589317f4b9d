"""What a person reads while a run goes on: a start banner, progress lines, and a summary.

On a terminal the progress line is redrawn in place after every step; elsewhere (a SLURM log,
`| tee`) one line is printed for every logged step (see cadence.py). Only rank 0 prints.

Every line fits the width of the terminal (`COLUMNS` when set, as for any terminal program):
the live progress line leaves out its least needed figures, other lines continue on indented
lines, broken between figures or words, never inside one. In a file or a pipe (no terminal,
no `COLUMNS`) lines are whole, one per step; metrics.jsonl holds every figure either way.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import TextIO

from moe_train.train.step_record import StepRecord

GIB = 2**30
SEPARATOR = " | "
INDENT = "  "
"""What a continuation line starts with."""


@dataclass
class RunTotals:
    """What the end-of-run summary reports, gathered as the run goes."""

    steps: int = 0
    """Steps this launch ran."""
    tokens_here: int = 0
    """Tokens of the steps this launch ran."""
    first_step: int = 0
    """The first step this launch ran (above 1 for a resumed run)."""
    last_step: int = 0
    """The run's newest step: its total steps, earlier launches' included."""
    tokens: int = 0
    """Tokens seen by the run so far (a resumed run counts its earlier steps)."""
    step_seconds: float = 0.0
    peak_mem_bytes: int = 0
    eval_losses: list[float] = field(default_factory=list)
    task_metrics: dict[str, float] = field(default_factory=dict)
    """The latest eval.tasks figures."""


class Console:
    """Banner, progress lines and summary on stderr (`enabled` on rank 0 only)."""

    def __init__(
        self,
        max_steps: int,
        *,
        enabled: bool,
        progress: bool,
        world_size: int,
        stream: TextIO | None = None,
    ) -> None:
        self.max_steps = max_steps
        self.enabled = enabled
        """Whether anything is printed (run facts: banner, resume, skipped steps, summary)."""
        self.progress = enabled and progress
        """Whether progress lines are printed too."""
        self.world_size = world_size
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.totals = RunTotals()
        self._first_step_at: float | None = None
        self._steps_here = 0
        self._line_open = False

    def message(self, text: str) -> None:
        """Run facts, a line each, wrapped between words to the width (ends a live progress
        line first)."""
        width = line_width(self.stream)
        self._write([part for line in text.splitlines() for part in wrap_words(line, width)])

    def banner(self, rows: list[tuple[str, str]]) -> None:
        """The start banner: one `name  value` row per fact (a long value continues under
        itself)."""
        column = max(len(name) for name, _ in rows) + 2
        width = line_width(self.stream)
        lines = []
        for name, value in rows:
            lines += wrap_words(f"{name:<{column}}{value}", width, " " * column)
        self._write(lines)

    def _write(self, lines: list[str]) -> None:
        if self.enabled:
            self._end_live_line()
            self.stream.write("".join(line + "\n" for line in lines))
            self.stream.flush()

    def step(self, record: StepRecord, *, logged: bool) -> None:
        """Account for one step and print its progress line when due (a `logged` step, or
        one that evaluated; after every step on a terminal)."""
        now = time.perf_counter()
        if self._first_step_at is None:
            self._first_step_at = now - record.step_time_s
        self._steps_here += 1
        totals = self.totals
        totals.steps += 1
        totals.first_step = totals.first_step or record.step
        totals.last_step = record.step
        totals.tokens = record.tokens_seen
        totals.tokens_here += record.tokens
        totals.step_seconds += record.step_time_s
        totals.peak_mem_bytes = max(totals.peak_mem_bytes, record.peak_mem_bytes)
        if record.eval_loss is not None:
            totals.eval_losses.append(record.eval_loss)
        if record.task_metrics:
            totals.task_metrics = record.task_metrics
        if not self.progress or not (self.live or logged or record.evaluated):
            return
        # This process's own pace (a resumed run counts only the steps it ran).
        eta = (now - self._first_step_at) / self._steps_here * (self.max_steps - record.step)
        fields = progress_fields(record, self.max_steps, self.world_size, eta)
        width = line_width(self.stream)
        if self.live:
            # One column spare: a line as wide as the terminal moves some terminals' cursor on.
            line = fit_fields(fields, width - 1 if width else None)
            self.stream.write(f"\r\033[K{line}")
            self._line_open = True
            if record.step == self.max_steps:
                self._end_live_line()
        else:
            lines = wrap_fields([text for _, text in fields], width)
            self.stream.write("".join(line + "\n" for line in lines))
        self.stream.flush()

    def summary(self, wall_seconds: float, checkpoint: str | None) -> None:
        """The end-of-run summary (one line). A resumed run's says what this launch did and
        where the run as a whole stands: `this launch 2 steps, ... | run total 6 steps, ...`."""
        totals = self.totals
        here = f"{totals.steps} steps, {totals.tokens_here:,} tokens in {clock(wall_seconds)}"
        if totals.first_step > 1:
            parts = [
                f"this launch {here}",
                f"run total {totals.last_step} steps, {totals.tokens:,} tokens",
            ]
        else:
            parts = [here]
        if totals.step_seconds:
            mean = totals.tokens_here / totals.step_seconds / self.world_size
            parts.append(f"{mean:,.0f} tok/s per device on average")
        if totals.eval_losses:
            parts.append(
                f"eval loss best {min(totals.eval_losses):.4f}, last {totals.eval_losses[-1]:.4f}"
            )
        if totals.task_metrics:
            parts.append(f"tasks last {task_figures(totals.task_metrics)}")
        parts.append(f"peak memory {totals.peak_mem_bytes / GIB:.2f} GiB")
        parts.append(f"checkpoint {checkpoint}" if checkpoint else "no checkpoint")
        parts[0] = "summary: " + parts[0]
        self._write(wrap_fields(parts, line_width(self.stream)))

    def _end_live_line(self) -> None:
        if self._line_open:
            self.stream.write("\n")
            self._line_open = False


def progress_line(record: StepRecord, max_steps: int, world_size: int, eta: float) -> str:
    """One progress line from a step's record, every figure."""
    return SEPARATOR.join(text for _, text in progress_fields(record, max_steps, world_size, eta))


def progress_fields(
    record: StepRecord, max_steps: int, world_size: int, eta: float
) -> list[tuple[int, str]]:
    """The figures of a progress line in order, each with its rank among those a narrow
    live line leaves out: the highest goes first, 0 never."""
    fields = [(0, f"step {record.step}/{max_steps}"), (1, f"loss {record.loss:.4f}")]
    if record.eval_loss is not None:
        fields.append((3, f"eval {record.eval_loss:.4f}"))
    if record.task_metrics:
        fields.append((11, task_figures(record.task_metrics)))
    fields += [
        (8, f"lr {record.lr:.2e}"),
        (7, f"gnorm {record.grad_norm:.3f}"),
        (5, f"{record.tokens_per_s / world_size:,.0f} tok/s/dev"),
        (10, f"MFU {100 * record.mfu:.1f}%"),
        (6, f"load {record.expert_load_max_over_mean:.2f}"),
        (9, f"mem {record.peak_mem_bytes / GIB:.2f} GiB"),
    ]
    if record.skipped_steps:
        fields.append((2, f"skipped {record.skipped_steps}"))
    if record.hidden_imbalance_layers:
        fields.append((2, f"hidden imbalance {record.hidden_imbalance_layers} layers"))
    if record.collapsed_layers:
        fields.append((2, f"collapsed {record.collapsed_layers} layers"))
    fields.append((4, f"ETA {clock(eta)}"))
    return fields


def line_width(stream: TextIO) -> int | None:
    """The columns a console line may take: `COLUMNS` when set, else the width of the
    terminal `stream` writes to; None (no limit) for a file or a pipe."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if not stream.isatty():
        return None
    try:
        return os.get_terminal_size(stream.fileno()).columns or None
    except (OSError, ValueError):
        return None


def fit_fields(fields: list[tuple[int, str]], width: int | None) -> str:
    """One line of the fields within `width`, in their order: taken by rank, lowest first
    (of equal ranks the earlier), each that still fits; a field ranked 0 always."""

    def line(indices: set[int]) -> str:
        return SEPARATOR.join(text for i, (_, text) in enumerate(fields) if i in indices)

    chosen: set[int] = set()
    for i in sorted(range(len(fields)), key=lambda i: (fields[i][0], i)):
        if fields[i][0] == 0 or width is None or len(line(chosen | {i})) <= width:
            chosen.add(i)
    return line(chosen)


def wrap_fields(fields: list[str], width: int | None) -> list[str]:
    """The fields joined by " | " into lines of at most `width` columns, continuation lines
    indented; a field wider than a line on its own is broken between its words."""
    if width is None:
        return [SEPARATOR.join(fields)]
    lines: list[str] = []
    current = ""
    for text in fields:
        joined = f"{current}{SEPARATOR}{text}" if current else text
        if len(joined) <= width or not current:
            current = joined
        else:
            lines.append(current)
            current = INDENT + text
        if len(current) > width:  # a field too wide for any line: break it between words
            *done, current = wrap_words(current, width)
            lines += done
    return [*lines, current]


def wrap_words(text: str, width: int | None, indent: str = INDENT) -> list[str]:
    """`text` in lines of at most `width` columns, broken between words only (a word wider
    than a line stands alone), each continuation line starting with `indent`."""
    if width is None or len(text) <= width:
        return [text]
    return textwrap.wrap(
        text,
        width,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
        drop_whitespace=True,
    ) or [text]


def task_figures(task_metrics: dict[str, float]) -> str:
    """`name acc 0.412 acc_norm 0.398, other bpb 2.31`: the task figures of a step."""
    tasks: dict[str, list[str]] = {}
    for key, value in task_metrics.items():
        parts = key.split("/")
        if len(parts) != 3:  # eval/tasks_s
            continue
        label = "bpb" if parts[2] == "bits_per_byte" else parts[2]
        tasks.setdefault(parts[1], []).append(f"{label} {value:.3f}")
    return ", ".join(f"{name} {' '.join(figures)}" for name, figures in tasks.items())


def load_scale(num_experts: int, top_k: int) -> str:
    """The range of the progress line's `load` (the busiest expert's tokens over the mean,
    worst MoE layer): 1 when every expert gets as many, num_experts / top_k at most (every
    token on the same top_k experts: an expert gets at most one copy of a token)."""
    return f"load from 1.00 (even) to at most {num_experts / top_k:.2f}"


def clock(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
