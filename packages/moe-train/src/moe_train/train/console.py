"""What a person reads while a run goes on: a start banner, progress lines, and a summary.

On a terminal the progress line is redrawn in place after every step; elsewhere (a SLURM log,
`| tee`) one line is printed for every logged step (see cadence.py). Only rank 0 prints.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from moe_train.train.step_record import StepRecord

GIB = 2**30


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
        """One line of run facts (ends a live progress line first)."""
        if self.enabled:
            self._end_live_line()
            self.stream.write(text + "\n")
            self.stream.flush()

    def banner(self, rows: list[tuple[str, str]]) -> None:
        """The start banner: one `name  value` row per fact."""
        width = max(len(name) for name, _ in rows)
        self.message("\n".join(f"{name:<{width}}  {value}" for name, value in rows))

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
        line = progress_line(record, self.max_steps, self.world_size, eta)
        if self.live:
            self.stream.write(f"\r\033[K{line}")
            self._line_open = True
            if record.step == self.max_steps:
                self._end_live_line()
        else:
            self.stream.write(line + "\n")
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
        self.message("summary: " + " | ".join(parts))

    def _end_live_line(self) -> None:
        if self._line_open:
            self.stream.write("\n")
            self._line_open = False


def progress_line(record: StepRecord, max_steps: int, world_size: int, eta: float) -> str:
    """One progress line from a step's record."""
    parts = [f"step {record.step}/{max_steps}", f"loss {record.loss:.4f}"]
    if record.eval_loss is not None:
        parts.append(f"eval {record.eval_loss:.4f}")
    if record.task_metrics:
        parts.append(task_figures(record.task_metrics))
    parts += [
        f"lr {record.lr:.2e}",
        f"gnorm {record.grad_norm:.3f}",
        f"{record.tokens_per_s / world_size:,.0f} tok/s/dev",
        f"MFU {100 * record.mfu:.1f}%",
        f"load {record.expert_load_max_over_mean:.2f}",
        f"mem {record.peak_mem_bytes / GIB:.2f} GiB",
    ]
    if record.skipped_steps:
        parts.append(f"skipped {record.skipped_steps}")
    if record.hidden_imbalance_layers:
        parts.append(f"hidden imbalance {record.hidden_imbalance_layers} layers")
    parts.append(f"ETA {clock(eta)}")
    return " | ".join(parts)


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
