"""What one training step reports: made once by the loop, read by the console, the metrics
file and the trackers. (The routing log, `expert_load.jsonl`, writes the step's per-layer
counts, `moe_train.train.routing.StepRouting`; its checks' verdicts come back here as
`hidden_imbalance_layers` and `collapsed_layers`.)"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

_NOT_IN_ROW = {"not_in_row": True}


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """The figures of step `step` (the state after that many optimizer steps).

    Every field but those marked otherwise is a key of its metrics.jsonl row, where a
    figure that is not finite (the loss of a skipped step) is written as null.
    """

    step: int
    """Optimizer steps done, this one included."""
    loss: float
    """LM loss, mean over the step's micro-batches (with data.label_mask, over the trained
    target tokens of the global batch)."""
    lb_loss: float
    """Unweighted load-balancing loss, mean over micro-batches and MoE layers."""
    z_loss: float
    """Unweighted router z-loss, mean over micro-batches and MoE layers."""
    lr: float
    """Learning rate the step used."""
    grad_norm: float
    """Global gradient norm before clipping."""
    tokens_per_s: float
    """Tokens of the step over its time, all ranks together."""
    mfu: float
    """Model FLOPs of the step over its time and the devices' peak."""
    expert_load_max_over_mean: float
    """Largest over MoE layers of (copies of the busiest expert / mean copies per expert)."""
    hidden_imbalance_layers: int
    """MoE layers the balance-versus-load check flags at this step."""
    collapsed_layers: int
    """MoE layers the collapse check flags at this step (routing collapsed onto one expert)."""
    dropped_token_frac: float
    """Token copies dropped by the capacity limit over copies routed, all layers."""
    peak_mem_bytes: int
    """Peak memory of the busiest rank."""
    step_time_s: float
    """Wall time of the step on the slowest rank."""
    data_wait_s: float
    """Time the slowest rank waited for its data."""
    skipped_steps: int
    """Steps skipped (not finite) since the run began, resumed launches included."""
    tokens_seen: int
    """Tokens of every step so far."""
    tokens_per_source: dict[str, int]
    """Target tokens trained on so far, per data source."""
    trained_tokens: int
    """Target tokens this step's loss is the mean over, the whole global batch: all of them,
    or with data.label_mask those the mask marks."""
    time: float
    """Unix time at the end of the step."""
    eval_loss: float | None = None
    """Held-out loss after the step; not in the row of a step that did not evaluate."""
    mtp_loss: float | None = None
    """Multi-token-prediction loss (unweighted, mean over micro-batches and MTP modules);
    only in the rows of runs with model.mtp_depth > 0."""
    dispatch_bytes: int | None = None
    """Bytes the writing rank's forward dispatches sent the other ranks of its expert-parallel
    group in the step (all its MoE layers and micro-batches, after deduplication where the
    dispatcher deduplicates; 0 without expert parallelism); not in the rows of runs whose
    dispatcher does not count them (deepep)."""
    exchange_bytes: int | None = None
    """Bytes all the writing rank's expert-parallel exchanges sent the other ranks in the step:
    dispatch and combine, forward and backward (recomputed forwards included); as
    dispatch_bytes, not in the rows of deepep runs."""
    task_metrics: dict[str, float] = field(default_factory=dict, metadata=_NOT_IN_ROW)
    """The eval.tasks figures after the step, keyed as in the row (`eval/<task>/acc`, ...,
    and `eval/tasks_s`, the seconds the scoring took); empty when it did not evaluate."""
    tokens: int = field(default=0, metadata=_NOT_IN_ROW)
    """Tokens of this step, all ranks together."""
    applied: bool = field(default=True, metadata=_NOT_IN_ROW)
    """Whether the update was applied (False: a skipped step)."""

    def row(self) -> dict[str, Any]:
        """The metrics.jsonl object of this step."""
        row = {f.name: _json_safe(getattr(self, f.name)) for f in fields(self) if not f.metadata}
        for optional in ("eval_loss", "mtp_loss", "dispatch_bytes", "exchange_bytes"):
            if row[optional] is None:
                del row[optional]
        row.update(self.task_metrics)
        return row

    @property
    def evaluated(self) -> bool:
        """Whether the step evaluated (held-out loss or tasks)."""
        return self.eval_loss is not None or bool(self.task_metrics)


def _json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: a non-finite figure is written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
