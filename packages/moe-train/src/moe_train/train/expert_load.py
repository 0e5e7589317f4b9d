"""RUN_DIR/expert_load.jsonl: the routing of every logged step, and the checks over it.

One compact JSON object per logged step (rank 0): `step`; `layers` (global block index of
each MoE layer); per MoE layer and expert `load` (copies routed over the step's global batch)
and `kept` (copies kept after capacity drops); per MoE layer and expert-parallel rank
`rank_load` (copies processed); `lb_scope` (what the balancing loss counts its expert
frequencies over, `model.moe.lb_scope`); per MoE layer `lb_loss` (the balancing score:
unweighted load-balancing loss, mean over micro-batches), `expert_imbalance` (max over mean of `load`),
`rank_imbalance` (max over mean of `rank_load`), `hidden_imbalance` (1 while the balance check
of `routing_check.py` flags the layer, else 0) and `collapsed` (1 while its collapse check flags
the layer, else 0).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_plan.config import RoutingCheckConfig
from moe_train.train.metrics import read_metrics
from moe_train.train.routing import StepRouting
from moe_train.train.routing_check import BalanceCheck, CollapseCheck, collapse_text, warning_text
from moe_train.train.run_dir import truncate_metrics

FILE_NAME = "expert_load.jsonl"


def routing_row(step: int, routing: StepRouting) -> dict[str, Any]:
    """The row of one step, without the check's flags."""
    return {
        "step": step,
        "lb_scope": routing.lb_scope,
        "layers": list(routing.layers),
        "load": routing.load_LE.tolist(),
        "kept": routing.kept_LE.tolist(),
        "rank_load": routing.rank_load_LR.tolist(),
        "lb_loss": [_rounded(v) for v in routing.lb_loss_L.tolist()],
        "expert_imbalance": [_rounded(v) for v in routing.expert_imbalance_L.tolist()],
        "rank_imbalance": [_rounded(v) for v in routing.rank_imbalance_L.tolist()],
    }


def _rounded(value: float) -> float | None:
    """Six decimals (the ratios and losses are read, not recomputed); null if not finite."""
    return round(value, 6) if math.isfinite(value) else None


class ExpertLoadLog:
    """Appends the rows of logged steps and runs the routing checks on them (rank 0).

    A resumed run drops the rows of steps at or after the one it resumes at (the job that
    stopped may have written some past its checkpoint) and replays the rest through the check,
    so streaks continue and a layer already reported is not reported again. `top_k` is
    model.moe.top_k (the collapse check's scale).
    """

    def __init__(
        self,
        run_dir: Path,
        start_step: int,
        config: RoutingCheckConfig,
        warn: Callable[[str], None],
        *,
        top_k: int,
    ) -> None:
        self.path = run_dir / FILE_NAME
        self.config, self.warn, self.top_k = config, warn, top_k
        self.check = BalanceCheck(config)
        self.collapse = CollapseCheck(config, top_k)
        self.flagged_layers = 0
        """MoE layers flagged by the balance check at the latest logged step."""
        self.collapsed_layers = 0
        """MoE layers flagged by the collapse check at the latest logged step."""
        truncate_metrics(self.path, start_step)
        if self.path.exists():
            for row in read_metrics(self.path):
                self._observe(row, replay=True)
        self._file = self.path.open("a")

    def write(self, step: int, routing: StepRouting) -> None:
        """Write a logged step's row; warn about layers flagged for the first time."""
        row = routing_row(step, routing)
        row["hidden_imbalance"], row["collapsed"] = self._observe(row, replay=False)
        self._file.write(json.dumps(row, separators=(",", ":")) + "\n")
        self._file.flush()

    def _observe(self, row: dict[str, Any], *, replay: bool) -> tuple[list[int], list[int]]:
        """Both checks' flags per layer of one row (warnings only for a new row)."""
        flagged, first_time = self.check.observe(
            row["step"], row["layers"], row["lb_loss"], row["rank_imbalance"]
        )
        collapsed, first_collapsed = self.collapse.observe(row["step"], row["layers"], row["load"])
        self.flagged_layers, self.collapsed_layers = sum(flagged), sum(collapsed)
        if not replay:
            for event in first_time:
                self.warn(warning_text(event, self.config, row.get("lb_scope", "micro_batch")))
            num_experts = len(row["load"][0])
            for event in first_collapsed:
                self.warn(collapse_text(event, self.config, num_experts, self.top_k))
        return [int(f) for f in flagged], [int(f) for f in collapsed]

    def close(self) -> None:
        self._file.close()
