"""The invariance matrix's rows and columns: the features (what a run trains with), the
layouts (how many ranks and how they split the work), the small model every cell trains,
and the fixed subset of cells that CI runs.

A cell is one feature on one layout; it is compared with the single-process run of the same
feature and seed (`harness.invariance_compare`). Both tables are plain data: a feature or a
layout is a name, the config keys it sets (dotted, as `--section.key=value` names them) and a
docstring.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FP32_RTOL = 1e-5
"""Every fp32 cell, every metric at every step and the final parameters: a layout changes
only the order of fp32 sums, which moves a few-step run by well under this."""
BF16_RTOL = 5e-3
"""bf16 cells (bf16 parameters, bf16 compute), every metric at every step: set from the
spread of three seeds over every layout (`--spread`, docs/verification.md: twice the worst,
rounded up). Context-parallel layouts part the most (attention's sums over other chunks)."""
BF16_PARAMS_RTOL = 2e-1
"""The final parameters of bf16 cells, by norm, from the same spread. After a few steps a
weight has moved by about as much as its initial size (lr times steps, per element, under
AdamW) and each update carries the low-precision gradients' noise, so the masters part by
far more than the metrics; layouts that split no sum over tokens (dp, pp) part far less
than this, expert and context parallelism the most (docs/verification.md gives each)."""
FP8_RTOL = 5e-3
"""FP8 rowwise cells (emulated on a CPU), every metric at every step: from the seed spread,
as BF16_RTOL. Layouts that split an expert's rows re-scale the quantized operands over other
rows."""
FP8_PARAMS_RTOL = 2e-1
"""The final parameters of FP8 rowwise cells, by norm: from the seed spread, as
BF16_PARAMS_RTOL."""


@dataclass(frozen=True)
class Feature:
    """A training choice: the config keys it sets over the base model's."""

    keys: Mapping[str, Any] = field(default_factory=dict)
    """Dotted config keys and their values."""
    doc: str = ""
    """What the feature is, in a line."""
    precision: bool = False
    """Whether the feature is a precision (it then sets its own dtypes; other features run
    fp32)."""
    rtol: float = FP32_RTOL
    """Relative tolerance of every metric at every step."""
    params_rtol: float = FP32_RTOL
    """Relative tolerance of the final parameters (by tensor norm)."""


@dataclass(frozen=True)
class Layout:
    """A parallel layout: its number of ranks and the parallel.* keys it sets."""

    ranks: int
    """Processes torchrun starts."""
    keys: Mapping[str, Any] = field(default_factory=dict)
    """Dotted config keys (parallel.*) and their values."""
    doc: str = ""
    """What the layout splits, in a line."""


BF16_KEYS = {"precision.param_dtype": "bfloat16", "precision.compute_dtype": "bfloat16"}
"""The keys of bf16 training."""

FEATURES: dict[str, Feature] = {
    "plain": Feature(doc="the base model: softmax top-2 of 8 experts, AdamW, fp32"),
    "aux_free": Feature(
        {"model.moe.bias_update_rate": 0.01, "model.moe.lb_loss_weight": 0.0},
        doc="auxiliary-loss-free balancing: a per-expert bias stepped after every step",
    ),
    "lb_global": Feature(
        {"model.moe.lb_scope": "global_batch"},
        doc="the load-balancing loss counted over the previous step's global batch",
    ),
    "z_loss": Feature({"model.moe.z_loss_weight": 0.01}, doc="the router z-loss in the objective"),
    "shared_experts": Feature(
        {"model.moe.shared_experts": 1, "model.moe.shared_expert_gate": True},
        doc="one always-active shared expert per MoE layer, gated per token",
    ),
    "capacity": Feature(
        {"model.moe.capacity_factor": 1.0},
        doc="a capacity of the even share per expert: token copies above it are dropped",
    ),
    "mtp": Feature({"model.mtp_depth": 1}, doc="one multi-token-prediction module"),
    "document_masking": Feature(
        {"data.document_masking": True},
        doc="attention kept inside each document of a packed sequence",
    ),
    "label_mask": Feature(
        {"data.label_mask": True},
        doc="SFT: the loss over the completions the data's label mask marks",
    ),
    "muon": Feature(
        {"optim.name": "muon", "optim.muon_ns_dtype": "float32", "optim.lr": 0.02},
        doc="Muon on the hidden matrices (fp32 Newton-Schulz), AdamW on the rest",
    ),
    "recompute_selective": Feature(
        {"parallel.recompute": "selective"}, doc="selective activation recompute"
    ),
    "recompute_full": Feature({"parallel.recompute": "full"}, doc="full activation recompute"),
    "node_limited": Feature(
        {"model.moe.n_group": 4, "model.moe.topk_group": 2},
        doc="node-limited routing: 4 groups of 2 experts, each token within 2 groups",
    ),
    "bf16_distopt": Feature(
        {**BF16_KEYS, "parallel.distributed_optimizer": True},
        doc="bf16 parameters and compute, FP32 masters in the distributed optimizer",
        precision=True,
        rtol=BF16_RTOL,
        params_rtol=BF16_PARAMS_RTOL,
    ),
    "fp8_rowwise": Feature(
        {
            "precision.compute_dtype": "bfloat16",
            "precision.expert_gemm": "fp8_rowwise",
            "precision.linear": "fp8_rowwise",
        },
        doc="rowwise FP8 expert GEMMs and linears (emulated on a CPU), bf16 compute",
        precision=True,
        rtol=FP8_RTOL,
        params_rtol=FP8_PARAMS_RTOL,
    ),
    "dispatch_rowwise": Feature(
        {"parallel.dispatcher": "rowwise", "model.moe.capacity_factor": 2.0},
        doc="the rowwise dispatcher (fixed-size blocks sized by a capacity of twice the even "
        "share); local without ep",
    ),
    "dispatch_dedup": Feature(
        {"parallel.dispatcher": "all_to_all_dedup"},
        doc="the deduplicating all-to-all dispatcher; local without ep",
    ),
    "ep_overlap": Feature(
        {"parallel.ep_overlap": True, "model.moe.capacity_factor": 1.0},
        doc="each MoE layer in two chunks whose exchanges overlap the experts, on the "
        "default path (rowwise, a capacity of the even share: copies dropped); nothing "
        "to overlap without ep",
    ),
    "fp8_dispatch": Feature(
        {"model.moe.dispatch_dtype": "fp8", "model.moe.capacity_factor": 2.0},
        doc="token rows dispatched as FP8 (e4m3, a scale per row) on the default path: "
        "rowwise (a capacity of twice the even share) with ep, local rounding without",
    ),
}
"""Every feature the matrix runs, by name."""

LAYOUTS: dict[str, Layout] = {
    "dp2": Layout(2, doc="two data-parallel ranks"),
    "dp2_distopt": Layout(
        2, {"parallel.distributed_optimizer": True}, doc="dp2, optimizer state sharded"
    ),
    "ep2": Layout(2, {"parallel.ep": 2}, doc="experts split over the two data ranks"),
    "ep4": Layout(4, {"parallel.ep": 4}, doc="experts split over four data ranks"),
    "pp2": Layout(2, {"parallel.pp": 2}, doc="two pipeline stages, 1F1B"),
    "pp2_interleaved": Layout(
        2,
        {
            "parallel.pp": 2,
            "parallel.pp_schedule": "interleaved_1f1b",
            "parallel.virtual_stages": 2,
        },
        doc="two pipeline ranks of two stages each, interleaved 1F1B",
    ),
    "cp2": Layout(2, {"parallel.cp": 2}, doc="each sequence split over two context ranks"),
    "dp2_ep2": Layout(4, {"parallel.ep": 2}, doc="four data ranks, experts over pairs"),
    "pp2_ep2": Layout(
        4, {"parallel.pp": 2, "parallel.ep": 2}, doc="two stages, each two data ranks with ep2"
    ),
    "cp2_ep2": Layout(
        2, {"parallel.cp": 2, "parallel.ep": 2}, doc="two context ranks, experts over them"
    ),
    "cp2_pp2": Layout(
        4, {"parallel.cp": 2, "parallel.pp": 2}, doc="two stages, each two context ranks"
    ),
    "pp2_dp2_ep2": Layout(
        8,
        {"parallel.pp": 2, "parallel.ep": 2},
        doc="two stages, each two data ranks of ep2 pairs (8 ranks)",
    ),
}
"""Every layout the matrix runs, by name."""

CI_CELLS: tuple[tuple[str, str], ...] = (
    ("plain", "dp2"),
    ("aux_free", "ep2"),
    ("lb_global", "dp2_ep2"),
    ("z_loss", "pp2_ep2"),
    ("shared_experts", "pp2_dp2_ep2"),
    ("capacity", "cp2"),
    ("mtp", "cp2_pp2"),
    ("document_masking", "cp2"),
    ("label_mask", "pp2_interleaved"),
    ("muon", "dp2_distopt"),
    ("recompute_selective", "pp2"),
    ("recompute_full", "pp2_interleaved"),
    ("node_limited", "ep4"),
    ("bf16_distopt", "dp2_ep2"),
    ("fp8_rowwise", "ep2"),
    ("dispatch_rowwise", "cp2_ep2"),
    ("dispatch_dedup", "dp2_ep2"),
    ("fp8_dispatch", "ep2"),
    ("ep_overlap", "ep4"),
)
"""The fixed subset CI runs: every feature once and every layout at least once, each feature
on a layout where it does something (the dispatchers, node-limited routing and capacity
where experts are split over ranks or capacity counts the copies of sequences split over
ranks, MTP under context and pipeline parallelism, label masks under a pipeline)."""

STEPS = 4
"""Optimizer steps of a cell by default (the first checks the forward, the later ones the
backward and the updates)."""


def base_config(data_dir: Path, steps: int) -> dict[str, Any]:
    """The config every cell starts from: a 4-layer model of 8 experts (pp2 with two virtual
    stages each, ep4), 16 sequences of 32 tokens per step in micro-batches of 2 (whole on
    every batch rank of every layout, at least 2 per pipeline), fp32, evaluated after every
    step, checkpointed after the last; `data_dir` is its training and held-out data."""
    data = str(data_dir)
    return {
        "model": {
            "vocab_size": 320,
            "d_model": 32,
            "n_layers": 4,
            "n_heads": 4,
            "n_kv_heads": 2,
            "qk_norm": True,
            "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "z_loss_weight": 0.0},
        },
        "data": {"paths": [data], "seq_len": 32, "global_batch_size": 16, "micro_batch_size": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"max_steps": steps, "log_interval": 1, "progress": False, "peak_flops": 1e11},
        "precision": {"param_dtype": "float32", "compute_dtype": "float32"},
        "checkpoint": {"interval": steps, "interval_minutes": 0},
        "eval": {"paths": [data], "interval": 1, "batches": 1},
    }


def with_keys(config: Mapping[str, Any], *key_sets: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the nested `config` with each dotted key of `key_sets` set, in order."""
    result = _deep_copy(config)
    for keys in key_sets:
        for dotted, value in keys.items():
            *sections, last = dotted.split(".")
            node = result
            for section in sections:
                node = node.setdefault(section, {})
            node[last] = value
    return result


def _deep_copy(node: Any) -> Any:
    """A copy of nested dicts and lists (leaves shared)."""
    if isinstance(node, Mapping):
        return {key: _deep_copy(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_deep_copy(value) for value in node]
    return node


def select_cells(
    features: Sequence[str] | None, layouts: Sequence[str] | None, every: bool = False
) -> list[tuple[str, str]]:
    """The cells to run: `features` x `layouts` (either None: all of them); with neither
    given, all cells if `every`, else CI_CELLS. Raises ValueError naming an unknown name."""
    _check_names(features or (), FEATURES, "feature")
    _check_names(layouts or (), LAYOUTS, "layout")
    if features is None and layouts is None and not every:
        return list(CI_CELLS)
    return [(f, lay) for f in features or FEATURES for lay in layouts or LAYOUTS]


def _check_names(names: Iterable[str], known: Mapping[str, object], what: str) -> None:
    """ValueError for the first of `names` not in `known`."""
    for name in names:
        if name not in known:
            raise ValueError(f"unknown {what} {name!r}; the {what}s are {', '.join(known)}")
