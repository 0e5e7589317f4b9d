"""Figures of the routing (RUN_DIR/expert_load.jsonl): expert load, EP-rank load, balance
versus load. Shape suffixes: L MoE layers, E experts, R expert-parallel ranks, N logged steps.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from moe_train.plot.runs import Run
from moe_train.plot.style import new_figure, step_axis

MAX_PANELS = 16
"""Layers shown in the balance figure; a deeper model shows its most uneven ones."""


def _arrays(run: Run) -> dict[str, Any]:
    rows = run.routing
    load_NLE = np.array([r["load"] for r in rows], dtype=np.float64)
    rank_load_NLR = np.array([r["rank_load"] for r in rows], dtype=np.float64)
    return {
        "steps": np.array([r["step"] for r in rows]),
        "layers": rows[-1]["layers"],
        "load_NLE": load_NLE,
        "share_NLE": load_NLE / np.maximum(load_NLE.mean(axis=2, keepdims=True), 1e-300),
        "rank_share_NLR": rank_load_NLR / np.maximum(rank_load_NLR.sum(axis=2, keepdims=True), 1),
        "rank_imbalance_NL": np.array([r["rank_imbalance"] for r in rows], dtype=np.float64),
        "expert_imbalance_NL": np.array(
            [r.get("expert_imbalance") or [math.nan] * len(r["layers"]) for r in rows],
            dtype=np.float64,
        ),
        "lb_loss_NL": np.array(
            [[math.nan if v is None else v for v in r["lb_loss"]] for r in rows], dtype=np.float64
        ),
        "flagged_NL": np.array(
            [r.get("hidden_imbalance") or [0] * len(r["layers"]) for r in rows], dtype=bool
        ),
        "one_rank": rank_load_NLR.shape[2] == 1,
    }


def _edges(values: np.ndarray) -> np.ndarray:
    """Cell edges around sorted centres (steps or indices) for pcolormesh."""
    if len(values) == 1:
        return np.array([values[0] - 0.5, values[0] + 0.5])
    middle = (values[1:] + values[:-1]) / 2
    return np.concatenate(
        [[values[0] - (middle[0] - values[0])], middle, [values[-1] + (values[-1] - middle[-1])]]
    )


def _share_norm(share: np.ndarray) -> Any:
    from matplotlib.colors import TwoSlopeNorm

    return TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, float(np.nanmax(share))))


def expert_load_figure(run: Run) -> Any:
    """Layers x experts at the last logged step, and experts x steps of the most uneven layer,
    each cell the expert's routed copies over the even share (1.0: even)."""
    a = _arrays(run)
    figure, (last, over_time) = new_figure(1, 2, width=14, height=5.6)
    share_LE, layers = a["share_NLE"][-1], a["layers"]
    norm = _share_norm(a["share_NLE"])
    num_experts = share_LE.shape[1]
    mesh = last.pcolormesh(
        _edges(np.arange(num_experts, dtype=float)),
        _edges(np.arange(len(layers), dtype=float)),
        share_LE,
        cmap="RdBu_r",
        norm=norm,
    )
    last.set(
        title=f"Expert load at step {a['steps'][-1]}",
        xlabel="expert",
        ylabel="MoE layer",
    )
    _index_ticks(last.yaxis, layers)
    _index_ticks(last.xaxis, list(range(num_experts)))
    last.invert_yaxis()
    worst, why = _pick_layer(a["expert_imbalance_NL"], layers, "expert")
    over_time.pcolormesh(
        _edges(a["steps"].astype(float)),
        _edges(np.arange(num_experts, dtype=float)),
        a["share_NLE"][:, worst, :].T,
        cmap="RdBu_r",
        norm=norm,
    )
    over_time.set(title=f"{why}: expert load by step", ylabel="expert")
    step_axis(over_time, run.resumes)
    _index_ticks(over_time.yaxis, list(range(num_experts)))
    for axes in (last, over_time):
        axes.grid(False)
    figure.colorbar(
        mesh, ax=[last, over_time], label="routed copies / even share (1 = even)", shrink=0.9
    )
    return figure


def rank_load_figure(run: Run) -> Any | None:
    """Each EP rank's share of the most uneven layer's processed copies by step, and every
    layer's busiest rank over the mean by step; None for a run with one EP rank (one rank
    holds every expert: nothing to compare)."""
    a = _arrays(run)
    num_ranks = a["rank_share_NLR"].shape[2]
    if a["one_rank"]:
        return None
    figure, (shares, heat) = new_figure(2, 1, width=11, height=8.5)
    steps, layers = a["steps"], a["layers"]
    worst, why = _pick_layer(a["rank_imbalance_NL"], layers, "EP rank")
    for rank in range(num_ranks):
        shares.plot(steps, a["rank_share_NLR"][:, worst, rank], label=f"EP rank {rank}")
    shares.axhline(1 / num_ranks, color="black", ls="--", lw=1, label="even share")
    shares.set(title=f"{why}: load per EP rank", ylabel="share of processed copies", ylim=(0, 1.05))
    shares.legend(fontsize="small", ncols=min(num_ranks + 1, 5))
    mesh = heat.pcolormesh(
        _edges(steps.astype(float)),
        _edges(np.arange(len(layers), dtype=float)),
        a["rank_imbalance_NL"].T,
        cmap="magma_r",
        vmin=1.0,
        vmax=max(float(num_ranks), 1.01),
    )
    heat.set(title="Busiest EP rank over the mean, every layer", ylabel="MoE layer")
    for axes in (shares, heat):
        step_axis(axes, run.resumes)
    _index_ticks(heat.yaxis, layers)
    heat.invert_yaxis()
    heat.grid(False)
    figure.colorbar(mesh, ax=heat, label="busiest rank / mean (1 = even)")
    return figure


def balance_figure(run: Run) -> Any:
    """Per layer over steps: the balancing score the loss sees against the real imbalance
    (EP ranks and experts), with the check's thresholds and the steps it flagged."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    a = _arrays(run)
    shown = _most_uneven(a, MAX_PANELS)
    cols = min(4, len(shown))
    rows = math.ceil(len(shown) / cols)
    figure, panels = new_figure(rows, cols, width=max(4.2 * cols, 9), height=3.1 * rows + 1.2)
    measures = [a[k][:, shown] for k in ("rank_imbalance_NL", "expert_imbalance_NL", "lb_loss_NL")]
    top = max(1.5, *(float(np.nanmax(m)) * 1.08 for m in measures))
    bottom = min(0.97, *(float(np.nanmin(m)) * 0.98 for m in measures))
    for axes, index in zip(panels, shown, strict=False):
        _balance_panel(axes, run, a, index, (bottom, top))
    for axes in panels[len(shown) :]:
        axes.set_visible(False)
    bottom_row = panels[(rows - 1) * cols :]
    for axes in panels:
        step_axis(axes, run.resumes)
        axes.set_xlabel("step" if axes in bottom_row else "")
    for axes in panels[::cols]:
        axes.set_ylabel("max / mean, or loss (1 = even)")
    handles, labels = panels[0].get_legend_handles_labels()
    extra = [
        (Line2D([], [], color="tab:blue", ls=":"), "check: loss counts as balanced at or below"),
        (Line2D([], [], color="tab:red", ls=":"), "check: rank imbalance limit"),
        (Patch(color="tab:red", alpha=0.15), "flagged: balanced to the loss, not to the ranks"),
        (Line2D([], [], color="darkred", ls="--"), "warned (once per layer)"),
    ]
    if a["one_rank"]:  # no rank line, so no rank limit and nothing flagged
        extra = extra[:1]
    handles += [h for h, _ in extra]
    labels += [label for _, label in extra]
    figure.suptitle(
        f"{run.name}: balancing loss versus real imbalance per MoE layer"
        f"{_shown_note(a, shown)}{' (one EP rank)' if a['one_rank'] else ''}"
    )
    figure.legend(handles, labels, loc="outside lower center", ncols=2 if cols < 3 else 4,
                  fontsize="small")  # fmt: skip
    return figure


def _balance_panel(
    axes: Any, run: Run, a: dict[str, Any], index: int, limits: tuple[float, float]
) -> None:
    steps = a["steps"]
    lines = [
        ("expert_imbalance_NL", "busiest expert / mean", "tab:gray", 1.0),
        ("rank_imbalance_NL", "busiest EP rank / mean", "tab:red", 1.8),
        ("lb_loss_NL", "balancing loss", "tab:blue", 1.8),
    ]
    if a["one_rank"]:  # one EP rank holds every expert: its imbalance is 1 by construction
        lines = [line for line in lines if line[0] != "rank_imbalance_NL"]
    for key, label, colour, width in lines:
        axes.plot(steps, a[key][:, index], color=colour, lw=width, label=label)
    thresholds = []
    if run.balanced_lb_loss is not None:
        axes.axhline(run.balanced_lb_loss, color="tab:blue", ls=":", lw=1.2)
        thresholds.append(run.balanced_lb_loss)
    if run.max_rank_imbalance is not None and not a["one_rank"]:
        axes.axhline(run.max_rank_imbalance, color="tab:red", ls=":", lw=1.2)
        thresholds.append(run.max_rank_imbalance)
    flagged = a["flagged_NL"][:, index]
    _shade(axes, steps, flagged)
    if flagged.any():
        axes.axvline(steps[int(np.argmax(flagged))], color="darkred", ls="--", lw=1.2)
    axes.set_title(f"MoE layer {a['layers'][index]}")
    _ratio_axis(axes, limits, thresholds)


def _pick_layer(imbalance_NL: np.ndarray, layers: list[int], what: str) -> tuple[int, str]:
    """The layer to show of a per-layer imbalance (the busiest `what` over the mean) and a
    title saying why: the most uneven on average when the layers differ; the first when there
    is one layer, when they are all alike, or when none has a value."""
    logged_NL = ~np.isnan(imbalance_NL)
    counts_L = logged_NL.sum(axis=0)
    mean_L = np.where(logged_NL, imbalance_NL, 0.0).sum(axis=0) / np.maximum(counts_L, 1)
    mean_L[counts_L == 0] = np.nan
    if len(layers) == 1:
        return 0, f"MoE layer {layers[0]}"
    if np.isnan(mean_L).all():
        return 0, f"MoE layer {layers[0]} (first of {len(layers)}; no {what} imbalance logged)"
    worst = int(np.nanargmax(mean_L))
    high, low = float(mean_L[worst]), float(np.nanmin(mean_L))
    if high - low <= 1e-3 * high:
        alike = "even" if high <= 1 + 1e-3 else f"busiest {what} {high:.2f}x the mean"
        return 0, f"MoE layer {layers[0]} (all {len(layers)} layers alike on average: {alike})"
    return worst, (
        f"MoE layer {layers[worst]} (most uneven of {len(layers)} on average: "
        f"busiest {what} {high:.2f}x the mean)"
    )


def _most_uneven(a: dict[str, Any], limit: int) -> list[int]:
    """Indices of up to `limit` layers, most flagged steps first, then highest mean rank
    (or expert) imbalance; returned in layer order."""
    scores = _uneven_scores(a)
    order = sorted(range(len(scores)), key=lambda i: tuple(-v for v in scores[i]))
    return sorted(order[:limit])


def _uneven_scores(a: dict[str, Any]) -> list[tuple[float, float]]:
    """Per layer: flagged steps, and mean rank imbalance plus a little of the expert one."""
    flagged_L = a["flagged_NL"].sum(axis=0)
    uneven_L = np.nan_to_num(a["rank_imbalance_NL"].mean(axis=0)) + 1e-3 * np.nan_to_num(
        a["expert_imbalance_NL"].mean(axis=0)
    )
    return [(float(f), float(u)) for f, u in zip(flagged_L, uneven_L, strict=True)]


def _shown_note(a: dict[str, Any], shown: list[int]) -> str:
    """What the balance figure's title says of its choice of layers (none when all shown)."""
    total = len(a["layers"])
    if len(shown) == total:
        return ""
    if len(set(_uneven_scores(a))) == 1:
        return f" (the first {len(shown)} of {total} layers: all alike)"
    return f" ({len(shown)} of {total} layers: the most uneven)"


def _ratio_axis(axes: Any, limits: tuple[float, float], marks: list[float]) -> None:
    """A log-scaled y axis over `limits` (ratios: 2x above even is as far as 4x above 2x),
    ticked at round ratios and at `marks`."""
    from matplotlib.ticker import FixedLocator, NullLocator

    bottom, top = limits
    axes.set_yscale("log")
    axes.set_ylim(bottom, top)
    ticks = {1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, *marks}
    close = {t for t in ticks if t not in marks and any(0 < abs(t - m) < 0.05 for m in marks)}
    axes.yaxis.set_major_locator(FixedLocator(sorted(t for t in ticks - close if t <= top)))
    axes.yaxis.set_minor_locator(NullLocator())
    axes.yaxis.set_major_formatter(lambda value, _: f"{value:g}")


def _shade(axes: Any, steps: np.ndarray, flagged: np.ndarray) -> None:
    """Shade the runs of flagged logged steps."""
    edges = _edges(steps.astype(float))
    start = None
    for i, on in enumerate([*flagged.tolist(), False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            axes.axvspan(edges[start], edges[i], color="tab:red", alpha=0.15, lw=0)
            start = None


def _index_ticks(axis: Any, labels: list[int]) -> None:
    """At most about 16 integer ticks at cell centres, labelled with `labels`."""
    stride = max(1, math.ceil(len(labels) / 16))
    positions = list(range(0, len(labels), stride))
    axis.set_ticks(positions, [str(labels[p]) for p in positions])
