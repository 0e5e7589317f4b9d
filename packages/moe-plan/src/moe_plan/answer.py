"""What the planner's page receives: `moe-plan --json`'s answer with the rows it shows,
not every layout's. The layouts that fit come as `--json` lists them, the first ones only;
the rejected ones as one-line summaries; any layout's full row, and further rows of either
list, on request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_plan.layouts import GIB, Evaluated, with_figures
from moe_plan.report import Plan, layout_row, plan_json_with, ranked_to

FITTING_SHOWN = 25
"""Rows of layouts that fit in the page's first answer."""
REJECTED_SHOWN = 100
"""Summaries of rejected layouts in the page's first answer."""
MOST_ROWS = 1000
"""The most rows one request for more of a list may ask."""
LISTS = ("fitting", "rejected")


@dataclass
class Answered:
    """A plan the page asked for, with what it needs to answer further requests about it."""

    plan: Plan
    tokens: int | None
    argv: list[str]
    _by_label: dict[str, Evaluated] = field(default_factory=dict)

    def first(self) -> dict[str, Any]:
        """The page's answer: the plan as `--json` has it, with the first rows of layouts
        that fit, the first summaries of rejected ones, and how many each list has."""
        out = plan_json_with(
            self.plan,
            self.tokens,
            fitting=self.rows("fitting", 0, FITTING_SHOWN),
            rejected=self.rows("rejected", 0, REJECTED_SHOWN),
        )
        out["fitting_count"] = self.count("fitting")
        out["rejected_count"] = self.count("rejected")
        return out

    def count(self, which: str) -> int:
        """How many layouts fit, or are rejected."""
        return self.plan.fitting_count if which == "fitting" else len(self.plan.rejected)

    def rows(self, which: str, start: int, count: int) -> list[dict[str, Any]]:
        """Rows `start` to `start + count` of the layouts that fit (as `--json` lists them;
        ranked this far first, see `ranked_to`) or of the rejected ones (summaries)."""
        if which == "fitting":
            self.plan = ranked_to(self.plan, start + count)
            chosen = self.plan.fitting[start : start + count]
            return [layout_row(self.plan, r, self.tokens) for r in chosen]
        return [summary(self.plan, r) for r in self.plan.rejected[start : start + count]]

    def layout(self, label: str) -> dict[str, Any] | None:
        """The full row, as `--json` lists it, of the layout with this label: the config's
        own, one that fits or not, or the one found on more devices (None: no such layout)."""
        if not self._by_label:
            plan = self.plan
            best = plan.smallest.best if plan.smallest is not None else None
            found = [*plan.rejected, *plan.closest, *plan.unranked, *plan.fitting, plan.own]
            self._by_label = {r.label: r for r in found + ([best] if best else [])}
        result = self._by_label.get(label)
        if result is None:
            return None
        return layout_row(self.plan, with_figures(result, self.plan.device), self.tokens)


def summary(plan: Plan, r: Evaluated) -> dict[str, Any]:
    """A rejected layout in one line: why, and when it starts, its memory per device, how
    far over the device's that is and its largest part (the page asks for the rest)."""
    row: dict[str, Any] = {"layout": r.label, "starts": r.error is None, "fits": r.fits}
    row["reason"] = r.reason
    if r.error is None:
        row["memory_total_bytes"] = r.memory.total
        row["over_bytes"] = r.memory.total - plan.device.memory_gib * GIB
        row["largest_part"] = r.memory.largest_part
    return row
