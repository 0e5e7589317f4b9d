"""The planner against published operating points. Each `configs/published-*.yaml` names in
one header line the devices the point ran on and what was published for it:

    # Calibration: 8 x b200, 27136 tokens/s per GPU, 619 model TFLOP/s per GPU

(either figure may be left out; a line that ends in ", layout not published" marks a point
whose layout was not given, for which the config holds one of the planner's choosing, and the
table also shows the planner's fastest fitting layout there). Those lines are the one place
the published figures live: the calibration table in docs/planner.md and its test both read
them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from moe_plan.config import Config, load_config
from moe_plan.config.accounting import flops_per_token
from moe_plan.hardware import DEVICES
from moe_plan.layouts import GIB, evaluate
from moe_plan.report import make_plan

HEADER = re.compile(
    r"^# Calibration: (?P<gpus>\d+) x (?P<gpu>\w+)"
    r"(?:, (?P<tokens>\d+) tokens/s per GPU)?(?:, (?P<tflops>\d+) model TFLOP/s per GPU)?"
    r"(?P<unpublished>, layout not published)?\s*$",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Point:
    """One published operating point, as its config's header gives it."""

    config: Path
    gpus: int
    gpu: str
    tokens_per_s: float | None
    """Published tokens/s per GPU, where given."""
    tflops: float | None
    """Published model TFLOP/s per GPU (the publisher's FLOPs of its own model), where given."""
    layout_published: bool = True
    """Whether the point's layout was published (the config's is then that one)."""


@dataclass(frozen=True)
class Fastest:
    """The planner's fastest fitting layout on a point's devices, against the config's own."""

    label: str
    tokens_per_s: float
    tflops: float
    fitting: int
    """Layouts that fit on the point's devices."""
    own_rank: int | None
    """The config's own layout's place among them, fastest first (None: it does not fit)."""


@dataclass(frozen=True)
class Calibrated:
    point: Point
    predicted_tokens_per_s: float
    predicted_tflops: float
    """Predicted tokens/s x the planner's FLOPs per token of the config's model."""
    published_tflops: float
    """The published model TFLOP/s, or (where only tokens/s was published, for a config of
    the published model's size) the published tokens/s x the planner's FLOPs per token."""
    fits: bool
    """Whether the planner finds the config's layout within the device's memory."""
    memory_gib: float = 0.0
    """The planner's peak memory per device of the config's layout, GiB."""
    fastest: Fastest | None = None
    """For a point whose layout was not published: the planner's fastest fitting layout."""

    @property
    def ratio(self) -> float:
        """Predicted over published work rate: above 1 the planner is optimistic."""
        return self.predicted_tflops / self.published_tflops


def published_points(configs: Path) -> list[Point]:
    """The points of the `published-*.yaml` configs in `configs` that carry a calibration
    line, in file-name order. Raises ValueError naming a config whose line is missing."""
    points = []
    for path in sorted(configs.glob("published-*.yaml")):
        match = HEADER.search(path.read_text())
        if match is None or not (match["tokens"] or match["tflops"]):
            raise ValueError(f"{path}: no '# Calibration: N x GPU, ...' line with a figure")
        tokens, tflops = match["tokens"], match["tflops"]
        points.append(
            Point(
                path,
                int(match["gpus"]),
                match["gpu"],
                float(tokens) if tokens else None,
                float(tflops) if tflops else None,
                layout_published=not match["unpublished"],
            )
        )
    return points


def calibrate(point: Point) -> Calibrated:
    """The planner's prediction of the point's own layout on its devices."""
    config = load_config(point.config)
    result = evaluate(config, point.gpus, DEVICES[point.gpu])
    if result.error is not None:
        raise ValueError(f"{point.config}: {result.error}")
    flops = flops_per_token(config.model, config.data.seq_len)
    published = point.tflops if point.tflops else point.tokens_per_s * flops / 1e12
    fastest = None if point.layout_published else fastest_layout(config, point, result.label)
    return Calibrated(
        point,
        result.tokens_per_s,
        result.tokens_per_s * flops / 1e12,
        published,
        result.fits,
        result.memory.total / GIB,
        fastest,
    )


def fastest_layout(config: Config, point: Point, own: str) -> Fastest | None:
    """The fastest layout that fits on the point's devices (None: none fits), and where the
    config's own layout (labelled `own`) ranks among those that fit."""
    fitting = make_plan(config, point.gpus, DEVICES[point.gpu], search=False).fitting
    if not fitting:
        return None
    best = fitting[0]
    rank = next((i for i, r in enumerate(fitting, 1) if r.label == own), None)
    flops = flops_per_token(config.model, config.data.seq_len)
    return Fastest(
        best.label, best.tokens_per_s, best.tokens_per_s * flops / 1e12, len(fitting), rank
    )


def calibration_table(rows: list[Calibrated]) -> str:
    """The rows as a Markdown table: published and predicted figures per GPU and their ratio."""
    lines = [
        "| config | devices | published tokens/s | published TFLOP/s | predicted tokens/s "
        "| predicted TFLOP/s | ratio |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        p = r.point
        tokens = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-"
        tflops = f"{p.tflops:,.0f}" if p.tflops else f"({r.published_tflops:,.0f})"
        device = DEVICES[p.gpu]
        over = f" (over memory: {r.memory_gib:.1f} of {device.memory_gib:.1f} GiB)"
        fits = "" if r.fits else over
        devices = f"{p.gpus} {device.name}"
        name = f"`{p.config.name}`"
        if r.fastest is not None:
            place = r.fastest.own_rank
            ranked = f"#{place}" if place else "not"
            name += f" (its layout {ranked} of the {r.fastest.fitting} that fit)"
        lines.append(
            f"| {name} | {devices} | {tokens} | {tflops} "
            f"| {r.predicted_tokens_per_s:,.0f}{fits} | {r.predicted_tflops:,.0f} "
            f"| {r.ratio:.2f} |"
        )
        if r.fastest is not None:
            f = r.fastest
            lines.append(
                f"| same, the planner's fastest layout: {f.label} | {devices} | {tokens} "
                f"| {tflops} | {f.tokens_per_s:,.0f} | {f.tflops:,.0f} "
                f"| {f.tflops / r.published_tflops:.2f} |"
            )
    return "\n".join(lines)
