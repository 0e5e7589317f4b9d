"""What `moe-train plan` prints: the config's own layout, then the layouts that fit, ranked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_train.plan.hardware import Device
from moe_train.plan.layouts import GIB, Evaluated, candidate_layouts, evaluate
from moe_train.plan.roofline import across_nodes


@dataclass(frozen=True)
class Plan:
    world_size: int
    device: Device
    own: Evaluated
    """The config's own layout."""
    fitting: list[Evaluated]
    """Layouts that start and fit, fastest first."""
    rejected: list[Evaluated]
    """Layouts that do not start or do not fit."""


def make_plan(config: Any, world_size: int, device: Device) -> Plan:
    """Evaluate the config's own layout and every candidate on `world_size` devices."""
    own = evaluate(config, world_size, device)
    seen: set[str] = set()
    fitting, rejected = [], []
    for candidate in candidate_layouts(config, world_size, device):
        result = evaluate(candidate, world_size, device)
        if result.label in seen:
            continue
        seen.add(result.label)
        (fitting if result.fits else rejected).append(result)
    fitting.sort(key=lambda r: -r.tokens_per_s)
    return Plan(world_size, device, own, fitting, rejected)


def format_plan(plan: Plan, top: int = 15) -> str:
    """The plan as text: the own layout's verdict and breakdown, then a ranked table."""
    device = plan.device
    lines = [
        f"{plan.world_size} x {device.name} ({device.memory_gib:.0f} GiB, "
        f"{device.bf16_tflops:.0f} bf16 TFLOP/s, {device.gpus_per_node} per node)",
        "",
        "this config: " + plan.own.label,
    ]
    if plan.own.error:
        lines.append(f"  cannot start: {plan.own.error}")
    else:
        lines += _details(plan.own, device)
    lines += ["", f"layouts that fit ({len(plan.fitting)}), fastest first:"]
    header = f"{'layout':<58} {'GiB':>6} {'tok/s/dev':>10} {'MFU':>6} {'bubble':>7} {'exch.':>6}"
    lines += [header, "-" * len(header)]
    for r in plan.fitting[:top]:
        bubble = r.time.bubble_s / r.time.total_s
        exchange = r.time.exchange_s / r.time.total_s
        lines.append(
            f"{r.label:<72} {r.memory.total / GIB:>6.1f} {r.tokens_per_s:>10,.0f} "
            f"{100 * r.mfu:>5.1f}% {100 * bubble:>6.1f}% {100 * exchange:>5.1f}%"
        )
    if len(plan.fitting) > top:
        lines.append(f"... and {len(plan.fitting) - top} more (--json lists all)")
    lines += ["", f"layouts that do not fit or cannot start ({len(plan.rejected)}), e.g.:"]
    for r in plan.rejected[:8]:
        lines.append(f"  {r.label}: {r.reason}")
    return "\n".join(lines)


def _details(result: Evaluated, device: Device) -> list[str]:
    memory = result.memory
    verdict = "fits" if result.fits else "does NOT fit"
    lines = [
        f"  memory per device {memory.total / GIB:.1f} GiB of {device.memory_gib:.0f}: {verdict}"
        f" (busiest pipeline rank {memory.pp_rank})",
        "    "
        + ", ".join(f"{name} {value / GIB:.2f}" for name, value in memory.categories().items())
        + " GiB",
        f"    activations {memory.activations / GIB:.2f} GiB per micro-batch x "
        f"{memory.in_flight:g} in flight",
        "  bytes per step per device by kind (sent over links; of them across nodes):",
    ]
    p = result.config.parallel
    for kind, wire in result.traffic.wire.items():
        network = across_nodes(kind, wire, p.ep, result.dp, device.gpus_per_node)
        lines.append(f"    {kind:<28} {wire / 1e9:9.2f} GB  ({network / 1e9:.2f} GB)")
    t = result.time
    lines.append(
        f"  step {t.total_s:.3f} s: compute {t.compute_s:.3f}, exchange {t.exchange_s:.3f}, "
        f"reductions {t.reduction_s:.3f}, bubble {t.bubble_s:.3f}, pipeline {t.pipeline_s:.3f}"
        + (f", Muon's iterations {t.optimizer_s:.3f}" if t.optimizer_s else "")
    )
    lines.append(f"  {result.tokens_per_s:,.0f} tokens/s per device, MFU {100 * result.mfu:.1f}%")
    return lines


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data: every evaluated layout with its figures."""
    return {
        "world_size": plan.world_size,
        "device": plan.device.__dict__,
        "own": _row(plan.own, plan.device),
        "fitting": [_row(r, plan.device) for r in plan.fitting],
        "rejected": [_row(r, plan.device) for r in plan.rejected],
    }


def _row(r: Evaluated, device: Device) -> dict[str, Any]:
    row: dict[str, Any] = {"layout": r.label, "starts": r.error is None, "fits": r.fits}
    if r.reason:
        row["reason"] = r.reason
    if r.error:
        return row
    row["memory_bytes"] = {**r.memory.categories(), "total": r.memory.total}
    row["activations_per_micro_batch"] = r.memory.activations
    row["in_flight_micro_batches"] = r.memory.in_flight
    row["payload_bytes_per_step"] = r.traffic.payload
    row["wire_bytes_per_step"] = r.traffic.wire
    row["across_nodes_bytes_per_step"] = {
        kind: across_nodes(kind, wire, r.config.parallel.ep, r.dp, device.gpus_per_node)
        for kind, wire in r.traffic.wire.items()
    }
    row["step_s"] = r.time.__dict__
    row["tokens_per_s_per_device"] = r.tokens_per_s
    row["mfu"] = r.mfu
    return row
