"""What `moe-plan` prints: the config's own layout, then the layouts that fit, ranked;
when none fits, the layouts that come closest and the smallest device count that fits."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from moe_plan.config import Config
from moe_plan.hardware import Device
from moe_plan.layouts import (
    GIB,
    LEGEND,
    Evaluated,
    Shared,
    candidate_layouts,
    evaluate,
    format_bytes,
    layout_overrides,
    screen,
    with_figures,
)
from moe_plan.ranking import fastest, rank
from moe_plan.search import Smallest, smallest_fitting
from moe_plan.traffic import across_nodes, expert_nodes, node_limited_bound

CLOSEST = 5
"""Layouts shown (and listed in JSON) when none fits."""

REASON_GROUPS = 8
"""Groups of rejection reasons shown."""


@dataclass(frozen=True)
class Plan:
    world_size: int
    device: Device
    own: Evaluated
    """The config's own layout."""
    fitting: list[Evaluated]
    """Layouts that start and fit, fastest first (the fastest of them, see `unranked`)."""
    rejected: list[Evaluated]
    """Layouts that do not start or do not fit, screened: start error or memory, no traffic
    or time (`with_figures` adds them)."""
    base: Config | None = None
    """The config as given, against which each layout's overrides are written."""
    closest: list[Evaluated] = field(default_factory=list)
    """When none fits: the layouts that start, least memory first."""
    smallest: Smallest | None = None
    """When none fits: the smallest count of the same devices on which one does."""
    unranked: list[Evaluated] = field(default_factory=list)
    """Layouts that fit but are not yet in `fitting` (`make_plan`'s `ranked`): each ranks
    after all of `fitting` (slower, or as fast and tried later); screened (some with their
    figures), in the order tried. `ranked_to` ranks more of them."""

    @property
    def fitting_count(self) -> int:
        """How many layouts fit, ranked or not."""
        return len(self.fitting) + len(self.unranked)


def ranked_to(plan: Plan, n: int) -> Plan:
    """`plan` with at least its `n` fastest layouts that fit ranked in `fitting` (the same
    rows a full ranking puts first)."""
    if len(plan.fitting) >= n or not plan.unranked:
        return plan
    shared = Shared.of(plan.base if plan.base is not None else plan.own.config)
    more, unranked = fastest(plan.unranked, plan.device, n - len(plan.fitting), shared)
    return dataclasses.replace(plan, fitting=plan.fitting + more, unranked=unranked)


def make_plan(
    config: Config,
    world_size: int,
    device: Device,
    *,
    search: bool = True,
    ranked: int | None = None,
) -> Plan:
    """Evaluate the config's own layout and every candidate on `world_size` devices (the
    rejected ones as far as their memory); when none fits, find the closest and (with
    `search`) the smallest device count that fits. With `ranked`, only the fastest `ranked`
    that fit are ranked, the others left in `Plan.unranked` (`ranked_to` ranks more)."""
    own = evaluate(config, world_size, device)
    shared = Shared.of(config)
    with paused_gc():
        fitting, rejected = _screened(config, world_size, device, shared)
        unranked: list[Evaluated] = []
        if fitting and ranked is None:
            fitting = rank(fitting, device, shared)
        elif fitting:
            fitting, unranked = fastest(fitting, device, ranked, shared)
    if fitting:
        return Plan(world_size, device, own, fitting, rejected, config, unranked=unranked)
    starting = sorted((r for r in rejected if r.error is None), key=lambda r: r.memory.total)
    closest = [with_figures(r, device) for r in starting[:CLOSEST]]
    smallest = smallest_fitting(config, world_size, device) if search else None
    return Plan(world_size, device, own, [], rejected, config, closest, smallest)


def _screened(
    config: Config, world_size: int, device: Device, shared: Shared
) -> tuple[list[Evaluated], list[Evaluated]]:
    """The candidate layouts screened, one per label: those that fit and the others, each in
    the order tried."""
    seen: set[str] = set()
    fitting, rejected = [], []
    for candidate in candidate_layouts(config, world_size, device):
        result = screen(candidate, world_size, device, shared=shared)
        if result.label in seen:
            continue
        seen.add(result.label)
        (fitting if result.fits else rejected).append(result)
    return fitting, rejected


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector (if on): screening makes tens of thousands of small
    objects, in no reference cycle (reference counts free them), and the collector's passes
    over them while they are made took a fifth of a large plan's time. The first of
    concurrent plans (or pauses around one) to pause it turns it back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def format_plan(
    plan: Plan, top: int = 15, overrides_for: str | None = None, tokens: int | None = None
) -> str:
    """The plan as text: the own layout's verdict and breakdown, a ranked table of the layouts
    that fit (or of the closest, with the device count that would fit), a legend of the layout
    codes and the rejection reasons grouped. With `overrides_for` (the command the overrides
    are added to), each shown row's overrides too; with `tokens`, the config's own layout's
    GPU-hours and days to train on that many tokens."""
    plan = ranked_to(plan, plan.fitting_count)
    device = plan.device
    lines = [
        f"{plan.world_size} x {device.name} ({format_bytes(device.memory_gib * GIB)}, "
        f"{device.bf16_tflops:.0f} bf16 TFLOP/s"
        + (f", {device.fp8_tflops:.0f} FP8" if device.fp8_tflops > 0 else "")
        + f", {device.gpus_per_node} per node)",
        "",
        "this config: " + plan.own.label,
    ]
    if plan.own.error:
        lines.append(f"  cannot start: {plan.own.error}")
    else:
        lines += _details(plan.own, device)
        if tokens is not None:
            hours, days = time_to_tokens(plan.own, tokens)
            lines.append(
                f"  {tokens:,} tokens: {hours:,.0f} GPU-hours, {days:,.1f} days on "
                f"{plan.world_size} devices"
            )
    lines.append("")
    if plan.fitting:
        shown = plan.fitting[:top]
        lines.append(f"layouts that fit ({len(plan.fitting)}), fastest first:")
        lines += _table(shown, device)
        if len(plan.fitting) > top:
            lines.append(f"... and {len(plan.fitting) - top} more (--json lists all)")
    else:
        shown = plan.closest
        lines.append(
            f"no layout fits {format_bytes(device.memory_gib * GIB)} per device; the closest, "
            "least memory first:"
        )
        lines += _table(shown, device, over=True) if shown else ["  (none starts)"]
    if plan.smallest is not None:
        lines.append(_smallest_line(plan.smallest, device))
    lines += _legend()
    lines += ["", f"layouts that do not fit or cannot start ({len(plan.rejected)}):"]
    lines += [f"  {count} {_plural(count)}: {text}" for count, text in _grouped(plan)]
    if overrides_for is not None:
        lines += _overrides_section(plan, shown, overrides_for)
    return "\n".join(lines)


HEADERS = ["#", "layout", "memory", "tok/s/dev", "MFU", "bubble", "exch."]
LEFT_ALIGNED = 2
"""The first columns (row number and layout) are aligned left, the figures right."""


def table_lines(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A table whose columns are as wide as their widest cell, two spaces apart: header,
    rule, rows."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        padded = [
            c.ljust(w) if i < LEFT_ALIGNED else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded).rstrip()

    header = line(headers)
    return [header, "-" * len(header), *(line(r) for r in rows)]


def _table(rows: list[Evaluated], device: Device, over: bool = False) -> list[str]:
    headers = list(HEADERS)
    if over:
        headers.insert(3, "over")
    cells = []
    for i, r in enumerate(rows, 1):
        t = r.time
        row = [
            str(i),
            r.label,
            format_bytes(r.memory.total),
            f"{r.tokens_per_s:,.0f}",
            _percent(r.mfu),
            _percent(t.bubble_s / t.total_s),
            _percent(t.exchange_s / t.total_s),
        ]
        if over:
            row.insert(3, "+" + format_bytes(r.memory.total - device.memory_gib * GIB))
        cells.append(row)
    return table_lines(headers, cells)


def _percent(share: float) -> str:
    return "<0.1%" if 0 < share < 0.0005 else f"{100 * share:.1f}%"


def _smallest_line(smallest: Smallest, device: Device) -> str:
    best = smallest.best
    if best is None:
        how = (
            ""
            if smallest.tried_to == smallest.searched_to
            else (f" (every count up to {smallest.searched_to} tried, then doubling)")
        )
        return f"no count up to {smallest.tried_to} x {device.name} fits{how}"
    line = (
        f"fits on {best.world_size} x {device.name}: {best.label} "
        f"({format_bytes(best.memory.total)}, {best.tokens_per_s:,.0f} tokens/s per device)"
    )
    if not smallest.every_count_below:
        line += (
            f"\n  (every count up to {smallest.searched_to} tried, then doubling and halving: "
            f"a count between {smallest.searched_to} and {best.world_size} may also fit)"
        )
    return line


def _legend() -> list[str]:
    width = max(len(code) for code in LEGEND)
    return [
        "",
        "layout codes:",
        *(f"  {code:<{width}}  {meaning}" for code, meaning in LEGEND.items()),
        "columns: memory, the predicted peak per device; tok/s/dev, tokens/s per device by a "
        "roofline",
        "  calibrated against published runs (docs/planner.md); bubble and exch., the step's "
        "share idle in",
        "  the pipeline bubble and in the expert-parallel exchanges",
    ]


def _plural(count: int) -> str:
    return "layout" if count == 1 else "layouts"


def _grouped(plan: Plan) -> list[tuple[int, str]]:
    """Rejection reasons, one line per kind with its count, most common first: start errors
    alike but for their figures together, memory overruns by their largest category."""
    groups: dict[str, list[Evaluated]] = {}
    for r in plan.rejected:
        key = re.sub(r"\d+", "#", r.error) if r.error else "memory " + r.memory.largest_part
        groups.setdefault(key, []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    lines = [(len(members), _group_text(key, members, plan.device)) for key, members in ordered]
    if len(lines) > REASON_GROUPS:
        rest = sum(count for count, _ in lines[REASON_GROUPS:])
        lines = [*lines[:REASON_GROUPS], (rest, "other reasons (--json lists each)")]
    return lines


CATEGORY_NAMES = {"optimizer": "optimizer state", "dispatch": "dispatch buffers"}


def _group_text(key: str, members: list[Evaluated], device: Device) -> str:
    if not key.startswith("memory "):
        return members[0].error + ("" if len(members) == 1 else f" (e.g. {members[0].label})")
    category = key.removeprefix("memory ")
    totals = [r.memory.total for r in members]
    span = format_bytes(min(totals))
    if len(members) > 1:
        span += f" to {format_bytes(max(totals))}"
    return (
        f"need {span} per device, over {format_bytes(device.memory_gib * GIB)}; "
        f"largest part: {CATEGORY_NAMES.get(category, category)}"
    )


def _overrides_section(plan: Plan, shown: list[Evaluated], command: str) -> list[str]:
    lines = ["", f"overrides of each row, to add to `{command}`:"]
    for i, r in enumerate(shown, 1):
        lines.append(f"  {i:<3}" + (" ".join(_overrides(plan, r)) or "(none: the config's own)"))
    best = plan.smallest.best if plan.smallest is not None else None
    if best is not None:
        overrides = " ".join(_overrides(plan, best)) or "(none)"
        lines.append(f"  on {best.world_size} devices: {overrides}")
    return lines


def _overrides(plan: Plan, r: Evaluated) -> list[str]:
    return layout_overrides(r.config, plan.base if plan.base is not None else plan.own.config)


def _details(result: Evaluated, device: Device) -> list[str]:
    memory = result.memory
    verdict = "fits" if result.fits else "does NOT fit"
    unit, size = ("GiB", GIB) if memory.total >= GIB else ("MiB", 2**20)
    lines = [
        f"  memory per device {format_bytes(memory.total)} of "
        f"{format_bytes(device.memory_gib * GIB)}: "
        f"{verdict} (busiest pipeline rank {memory.pp_rank})",
        "    "
        + ", ".join(f"{name} {value / size:.2f}" for name, value in memory.categories().items())
        + f" {unit}",
        f"    activations {memory.activations / size:.2f} {unit} per micro-batch x "
        f"{memory.in_flight:g} in flight",
        "  bytes per step per device by kind (sent over links; of them across nodes):",
    ]
    for kind, wire in result.traffic.wire.items():
        network = across_nodes(result.config, result.world_size, kind, wire, device.gpus_per_node)
        lines.append(f"    {kind:<28} {wire / 1e9:9.2f} GB  ({network / 1e9:.2f} GB)")
    lines += _expert_node_lines(result, device)
    t = result.time
    lines.append(
        f"  step {t.total_s:.3f} s: compute {t.compute_s:.3f}, exchange {t.exchange_s:.3f}, "
        f"reductions {t.reduction_s:.3f}, bubble {t.bubble_s:.3f}, pipeline {t.pipeline_s:.3f}"
        + (f", Muon's iterations {t.optimizer_s:.3f}" if t.optimizer_s else "")
        + (f", cp K/V {t.context_s:.3f}" if t.context_s else "")
    )
    lines.append(f"  {result.tokens_per_s:,.0f} tokens/s per device, MFU {_percent(result.mfu)}")
    return lines


def _expert_node_lines(result: Evaluated, device: Device) -> list[str]:
    """Where the experts lie on nodes, when the EP group spans several."""
    config = result.config
    nodes = expert_nodes(config, device.gpus_per_node)
    if nodes.nodes == 1 or config.parallel.ep == 1:
        return []
    moe = config.model.moe
    limited = (
        f"node-limited routing on nodes (n_group={moe.n_group}, topk_group={moe.topk_group})"
        if nodes.groups_on_nodes
        else "no node-limited routing on nodes"
    )
    bound = node_limited_bound(config, device.gpus_per_node) or 0.0
    lines = [
        f"  experts over {nodes.nodes} nodes per EP group; {limited}: a token's copies reach at "
        f"most {nodes.nodes_per_token} of them",
        "    (the exchange sends one row per copy, so the bytes across nodes above are the same "
        "with or without the limit;",
        f"    one row per token and node would send at most {bound / 1e6:.2f} MB per layer and "
        "micro-batch)",
    ]
    if nodes.warning:
        lines.append(f"  warning: {nodes.warning}")
    return lines


def plan_json(plan: Plan, tokens: int | None = None) -> dict[str, Any]:
    """The plan as JSON-ready data: every evaluated layout with its figures and overrides
    (with `tokens`, the GPU-hours and days each takes to train on that many tokens); when none
    fits, the closest and the smallest device count that fits."""
    plan = ranked_to(plan, plan.fitting_count)
    return plan_json_with(
        plan,
        tokens,
        fitting=[layout_row(plan, r, tokens) for r in plan.fitting],
        rejected=[layout_row(plan, with_figures(r, plan.device), tokens) for r in plan.rejected],
    )


def plan_json_with(
    plan: Plan, tokens: int | None, fitting: list[dict], rejected: list[dict]
) -> dict[str, Any]:
    """`plan_json` with the given rows in place of the lists of layouts that fit and that
    are rejected (the page's answer sends the first of them, and summaries)."""
    out: dict[str, Any] = {
        "world_size": plan.world_size,
        "device": {
            **plan.device.__dict__,
            "capability": list(plan.device.capability),  # as JSON reads it back
            "mxfp8": plan.device.mxfp8,
        },
        "tokens": tokens,
        "own": layout_row(plan, plan.own, tokens),
        "fitting": fitting,
        "rejected": rejected,
        "legend": LEGEND,
        "rejected_groups": [{"count": c, "reason": text} for c, text in _grouped(plan)],
    }
    if not plan.fitting:
        limit = plan.device.memory_gib * GIB
        out["closest"] = [
            {**layout_row(plan, r, tokens), "over_bytes": r.memory.total - limit}
            for r in plan.closest
        ]
    if plan.smallest is not None:
        best = plan.smallest.best
        out["smallest_fitting"] = {
            "world_size": plan.smallest.world_size,
            "searched_to": plan.smallest.searched_to,
            "tried_to": plan.smallest.tried_to,
            "every_count_below": plan.smallest.every_count_below,
            "layout": layout_row(plan, best, tokens) if best is not None else None,
        }
    return out


def layout_row(plan: Plan, r: Evaluated, tokens: int | None = None) -> dict[str, Any]:
    """One layout as `plan --json` lists it (`r` with its figures, unless it cannot start)."""
    device = plan.device
    row: dict[str, Any] = {"layout": r.label, "starts": r.error is None, "fits": r.fits}
    row["world_size"] = r.world_size
    row["overrides"] = _overrides(plan, r)
    if r.reason:
        row["reason"] = r.reason
    if r.error:
        return row
    row["memory_bytes"] = {**r.memory.categories(), "total": r.memory.total}
    row["activations_per_micro_batch"] = r.memory.activations
    row["in_flight_micro_batches"] = r.memory.in_flight
    row["payload_bytes_per_step"] = r.traffic.payload
    row["wire_bytes_per_step"] = r.traffic.wire
    row["collective_calls_per_step"] = r.traffic.calls
    per_node = device.gpus_per_node
    row["across_nodes_bytes_per_step"] = {
        kind: across_nodes(r.config, r.world_size, kind, wire, per_node)
        for kind, wire in r.traffic.wire.items()
    }
    nodes = expert_nodes(r.config, per_node)
    if r.config.parallel.ep > 1 and nodes.nodes > 1:
        row["expert_nodes"] = {
            "nodes": nodes.nodes,
            "groups_on_nodes": nodes.groups_on_nodes,
            "nodes_per_token": nodes.nodes_per_token,
            "per_node_dispatch_bound_bytes": node_limited_bound(r.config, per_node),
            "warning": nodes.warning,
        }
    row["step_s"] = {**r.time.__dict__, "total_s": r.time.total_s}
    row["tokens_per_s_per_device"] = r.tokens_per_s
    row["mfu"] = r.mfu
    if tokens is not None:
        row["gpu_hours"], row["days"] = time_to_tokens(r, tokens)
    return row


def time_to_tokens(r: Evaluated, tokens: int) -> tuple[float, float]:
    """GPU-hours (all devices together) and days of wall-clock time that layout `r` takes to
    train on `tokens` tokens at its predicted speed."""
    seconds = tokens / (r.tokens_per_s * r.world_size)
    return seconds * r.world_size / 3600, seconds / 86400
