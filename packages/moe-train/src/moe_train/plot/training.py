"""Figures of the training curves: loss and eval loss, learning rate, throughput and MFU.

Each takes one or more runs and overlays them (one colour per run).
"""

from __future__ import annotations

from typing import Any

from moe_train.plot.runs import Run
from moe_train.plot.style import mark_resume, new_figure, run_colour, step_axis, tokens_axis


def loss_figure(runs: list[Run]) -> Any:
    """Training loss (lines) and eval loss (dashed, dots) against steps and tokens seen."""
    figure, (by_step, by_tokens) = new_figure(1, 2, width=13, height=4.8)
    for index, run in enumerate(runs):
        tokens = {r["step"]: r.get("tokens_seen") for r in run.metrics}
        for key in ("loss", "eval_loss"):
            steps, values = run.series(key)
            style = {"lw": 1.4} if key == "loss" else {"ls": "--", "marker": "o", "ms": 4}
            style["color"] = run_colour(index)
            label = f"{run.name}: {'eval loss' if key == 'eval_loss' else 'loss'}"
            if steps:
                by_step.plot(steps, values, label=label, **style)
            points = [(tokens[s], v) for s, v in zip(steps, values, strict=True) if tokens.get(s)]
            if points:
                by_tokens.plot(*zip(*points, strict=True), label=label, **style)
        _mark_resumes(by_step, runs, index)
        for step in run.resumes:
            if tokens.get(step):
                mark_resume(by_tokens, tokens[step], step, run_colour(index), _name(runs, index))
    by_step.set(title="Loss by step", ylabel="loss (nats per token)")
    by_tokens.set(title="Loss by tokens seen", xlabel="tokens seen", ylabel="loss (nats per token)")
    tokens_axis(by_tokens)
    by_step.legend(fontsize="small")
    return figure


def lr_figure(runs: list[Run]) -> Any:
    """The learning rate of every step logged."""
    figure, (axes,) = new_figure(1, 1, width=8, height=4.2)
    for index, run in enumerate(runs):
        axes.plot(*run.series("lr"), color=run_colour(index), label=run.name)
        _mark_resumes(axes, runs, index)
    axes.set(title="Learning rate", ylabel="learning rate")
    axes.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    axes.legend(fontsize="small")
    return figure


def throughput_figure(runs: list[Run]) -> Any:
    """Tokens per second (all ranks together) and MFU, by step."""
    figure, (speed, mfu) = new_figure(1, 2, width=13, height=4.6)
    for index, run in enumerate(runs):
        colour = run_colour(index)
        speed.plot(*run.series("tokens_per_s"), color=colour, label=run.name)
        steps, values = run.series("mfu")
        mfu.plot(steps, [100 * v for v in values], color=colour, label=run.name)
        for axes in (speed, mfu):
            _mark_resumes(axes, runs, index)
    speed.set(title="Throughput", ylabel="tokens/s (all ranks)")
    tokens_axis(speed, axis="y")
    mfu.set(title="Model FLOPs utilisation", ylabel="MFU (% of peak)")
    speed.set_ylim(bottom=0)
    mfu.set_ylim(bottom=0)
    speed.legend(fontsize="small")
    return figure


def _name(runs: list[Run], index: int) -> str:
    """The run's name on a marker when several runs share the axes."""
    return runs[index].name if len(runs) > 1 else ""


def _mark_resumes(axes: Any, runs: list[Run], index: int) -> None:
    """Whole-step ticks and the index-th run's resume markers, in its colour."""
    step_axis(axes, runs[index].resumes, run_colour(index), _name(runs, index))
