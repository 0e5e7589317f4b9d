"""How a run executes and what it does beside training: parallel.*, precision.*,
checkpoint.* and eval.*."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moe_plan.config.checks import _non_negative, _positive
from moe_plan.config.task_names import BUILTIN_TASKS, TASK_SUFFIXES, task_name
from moe_plan.errors import ConfigError

EP_OVERLAP_CHUNKS = 2
"""Chunks parallel.ep_overlap cuts a MoE layer's routed tokens into: the exchange of one runs
while the experts compute another, so all but the first dispatch and the last combine of
each direction can hide."""


@dataclass(kw_only=True)
class ParallelConfig:
    ep: int = 1
    """Expert-parallel ranks; divides the data-parallel size (context ranks included: dp x
    cp) and model.moe.num_experts."""
    cp: int = 1
    """Context-parallel ranks: each sequence is split over cp ranks (2 x cp chunks, rank r
    holding chunks r and 2 cp - 1 - r, so that causal attention costs every rank the same).
    Attention gathers the keys and values of the whole sequence; everything else runs on the
    rank's own tokens. World size = pp x dp x cp; data.seq_len must be a multiple of 2 x cp."""
    pp: int = 1
    """Pipeline stages."""
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule."""
    virtual_stages: int = 1
    """Pipeline stages per pp rank; more than 1 only with pp_schedule=interleaved_1f1b."""
    dispatcher: Literal["auto", "local", "all_to_all", "rowwise", "deepep", "all_to_all_dedup"] = (
        "auto"
    )
    """Token dispatch backend between expert-parallel ranks: auto, or one by name; with ep = 1
    every one is local. auto at ep > 1: rowwise when model.moe.capacity_factor is set (static
    buffers, no host reads) and a peer-memory transport exists (see rowwise_transport),
    otherwise all_to_all. all_to_all sends one row per token copy and reads each layer's split
    sizes on the host; all_to_all_dedup sends a token once to each rank holding any of its
    experts (the rank sums its experts' weighted outputs and sends one row back), which saves
    bytes where tokens choose several experts on one rank, as node-limited routing
    (model.moe.topk_group) does when groups lie on ranks or nodes."""
    rowwise_transport: Literal["auto", "all_to_all", "symmetric_memory", "nvshmem"] = "auto"
    """How the rowwise dispatcher moves its rows. symmetric_memory: written straight into
    peers' buffers, only the slots that hold a row; every rank of an EP group on one node
    (torch symmetric memory on GPUs, not yet run on one; shared memory on CPUs). nvshmem: the
    same on NVSHMEM's symmetric heap, GPUs only, peers on other nodes reached by put (needs
    moestack-dispatch[nvshmem]; not yet run on a GPU). all_to_all: every capacity slot, filled
    or not, in an even all-to-all over the process group (any backend). auto: nvshmem where
    nvshmem4py imports on a GPU, else symmetric_memory where it connects; where neither
    does, dispatcher=auto falls back to the all_to_all dispatcher and dispatcher=rowwise to
    this all_to_all transport (the banner says which ran and why)."""
    ep_overlap: bool = False
    """With ep > 1, cut each MoE layer's routed tokens into two chunks and run one chunk's
    token exchange while the experts compute the other, forward and backward (the exchanges
    on a thread of their own, on GPUs on a side stream, not yet run on one): only the first
    dispatch and the last combine of each direction wait. Rowwise is cut by capacity slots,
    the other dispatchers by tokens; which copies a capacity keeps does not change. Losses
    equal those without to rounding (the expert weights' gradients are summed over two
    GEMMs). Not with parallel.recompute other than none."""
    distributed_optimizer: bool = False
    """Shard optimizer state over each gradient-reduction group."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute in backward."""
    timeout_s: float = 600.0
    """Seconds a collective waits for the other ranks (NCCL and gloo) before the run stops
    with an error that a rank was lost; a rank that dies outright is noticed sooner."""

    def validate(self, path: str) -> None:
        _positive(self, path, "ep", "cp", "pp", "virtual_stages", "timeout_s")


@dataclass(kw_only=True)
class PrecisionConfig:
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the parameters the forward and backward use. float32: the parameters are
    their own master weights. bfloat16: the compute uses the bf16 parameters directly (no
    cast copies); each backward's gradients are summed into FP32 buffers, and the optimizer
    holds FP32 master weights and moments (sharded with parallel.distributed_optimizer) and
    writes the updated weights back in bf16. Checkpoints hold the FP32 masters either way.
    bfloat16 needs compute_dtype=bfloat16."""
    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Dtype of matmuls (bfloat16 runs under autocast; router logits and losses stay fp32)."""
    expert_gemm: Literal["torch", "triton", "auto", "mxfp8", "fp8_rowwise"] = "torch"
    """How the routed experts' grouped GEMMs (gate_up and down; forward, input and weight
    gradients) run. torch, triton: moe-kernels' grouped_mm in compute_dtype with torch's
    kernel (everywhere) or its Triton kernels (for GPUs; on a CPU only under the Triton
    interpreter, TRITON_INTERPRET=1, a slow test vehicle). mxfp8: moe-kernels'
    mxfp8_grouped_mm, the MX training recipe: each GEMM quantizes its bf16 operands along its
    reduction dimension (blocks of 32, e4m3 values, power-of-two scales); torchao's kernels on
    SM100 GPUs (the moestack-kernels[mxfp8] extra), elsewhere an exact emulation (the same
    numbers, slower than bf16). fp8_rowwise: moe-kernels' fp8_rowwise_grouped_mm, torchao's
    rowwise FP8 recipe: each GEMM quantizes its operands to e4m3 with one power-of-two scale
    per row along its reduction dimension, sums in FP32 and writes bf16; torch's
    _scaled_grouped_mm on SM90 and newer GPUs (H100, H200, B200), elsewhere an exact emulation.
    auto: mxfp8 on SM100 with torchao installed, fp8_rowwise on other SM90-and-newer GPUs, and
    elsewhere (or with compute_dtype=float32) the compute_dtype kernel measured faster per
    shape (torch on a CPU); the banner says which. Only the expert GEMMs: see linear for the
    other matrix products. mxfp8 and fp8_rowwise need compute_dtype=bfloat16."""
    linear: Literal["bf16", "fp8_rowwise", "fp8_tensorwise"] = "bf16"
    """How the linear layers of attention (qkv, out), shared experts and dense feed-forwards
    multiply (the router and the head stay in their dtypes). bf16: in compute_dtype.
    fp8_rowwise, fp8_tensorwise: torchao's float8 training (convert_to_float8_training)
    applied to the built model with its rowwise recipe (e4m3 operands, power-of-two scales per
    row, for each of the three products) or its tensorwise recipe (one scale per tensor,
    e5m2 output gradients); torch._scaled_mm on SM89-and-newer GPUs, torchao's emulation
    elsewhere (the same quantization, fp32 products). Needs torchao (the
    moestack-kernels[mxfp8] extra) and compute_dtype=bfloat16."""

    def validate(self, path: str) -> None:
        if self.param_dtype == "bfloat16" and self.compute_dtype != "bfloat16":
            raise ConfigError(
                f"{path}.param_dtype=bfloat16 needs {path}.compute_dtype=bfloat16 (fp32 "
                f"products of bf16 weights would only add casts), got "
                f"{path}.compute_dtype={self.compute_dtype}"
            )
        if self.expert_gemm == "mxfp8" and self.compute_dtype != "bfloat16":
            raise ConfigError(
                f"{path}.expert_gemm=mxfp8 needs {path}.compute_dtype=bfloat16 (MXFP8 is a bf16 "
                f"training recipe), got {path}.compute_dtype={self.compute_dtype}"
            )
        for key in ("expert_gemm", "linear"):
            value = getattr(self, key)
            if value.startswith("fp8_") and self.compute_dtype != "bfloat16":
                raise ConfigError(
                    f"{path}.{key}={value} needs {path}.compute_dtype=bfloat16 (FP8 training "
                    f"recipes quantize bf16 operands and write bf16), got "
                    f"{path}.compute_dtype={self.compute_dtype}"
                )


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory; null means RUN_DIR/checkpoints."""
    interval: int = 500
    """Save every this many steps (0: not by steps). While checkpointing is on (this or
    interval_minutes is not 0) a run also saves after its last step and when a signal stops
    it."""
    interval_minutes: float = 30.0
    """Also save when this many minutes have passed since the last save or the start,
    whichever of the two intervals comes first (0: not by time)."""
    keep_last: int = 3
    """Committed checkpoints to keep."""
    resume: str = "never"
    """auto (continue in train.run_dir from its newest committed checkpoint, if any; the
    command to relaunch a preempted job), never (a new run; a taken run_dir gets a numbered
    suffix), or a checkpoint path (or a directory of checkpoints: its newest)."""
    allow_config_change: bool = False
    """Let a resumed run change keys that alter the model or which samples a step sees
    (model.*, data.paths, data.seq_len, data.global_batch_size, train.seed)."""
    async_save: bool = False
    """Copy the state off the training tensors and write it while training goes on."""
    init_from: str | None = None
    """A checkpoint (or a directory of checkpoints: its newest) whose model tensors a new run
    starts from, at step 0 with a fresh optimizer and data position, in any layout: e.g. the
    directory `moe-train import-hf` writes. Its model config must equal model.* (but for
    kernel choices) unless allow_config_change=true. Ignored, with a note, when resume finds a
    checkpoint: a relaunch continues its own run."""

    @property
    def enabled(self) -> bool:
        """Whether the run saves checkpoints at all."""
        return bool(self.interval or self.interval_minutes)

    def validate(self, path: str) -> None:
        _non_negative(self, path, "interval", "interval_minutes")
        _positive(self, path, "keep_last")
        if not self.resume:
            raise ConfigError(f"{path}.resume is empty; use auto, never or a checkpoint path")
        if self.init_from is not None and not self.init_from:
            raise ConfigError(
                f"{path}.init_from is empty; use null or a checkpoint path (or a directory of "
                "checkpoints)"
            )


@dataclass(kw_only=True)
class EvalConfig:
    paths: list[str] = field(default_factory=list)
    """Held-out data, in the forms of data.paths (prepared directories, .npy token arrays or
    builtin:stdlib), tokenized like the training data."""
    interval: int = 0
    """Evaluate every this many steps, and after the last step; 0 turns evaluation off, and
    so do empty paths and tasks."""
    batches: int = 1
    """Global batches (data.global_batch_size sequences each) per evaluation: the same ones,
    in the same order, every time."""
    tasks: list[str] = field(default_factory=list)
    """Downstream task files scored at every evaluation, each reported as eval/<file
    stem>/<metric>: multiple choice (.jsonl rows {"context", "choices", "gold"}: acc and
    acc_norm) or held-out text (.txt, or .jsonl rows {"text"}: bits_per_byte), or
    builtin:code_order (which of four orderings of a span of held-out Python source is the
    real one). Needs the tokenizer of data.paths (prepared directories or builtin:stdlib)."""

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates: an interval, and held-out data or tasks to evaluate
        (with neither, the interval is unused: `load_config` refuses one that a user gave
        without either list)."""
        return bool(self.interval and (self.paths or self.tasks))

    def validate(self, path: str) -> None:
        _non_negative(self, path, "interval")
        _positive(self, path, "batches")
        names: dict[str, str] = {}
        for task in self.tasks:
            if task.startswith("builtin:"):
                if task not in BUILTIN_TASKS:
                    raise ConfigError(
                        f"{path}.tasks holds {task!r}; the built-in tasks are "
                        f"{', '.join(BUILTIN_TASKS)}"
                    )
            elif not task.endswith(TASK_SUFFIXES):
                raise ConfigError(
                    f"{path}.tasks holds {task!r}; a task file ends in .jsonl (multiple "
                    "choice, or text rows) or .txt (held-out text), or a built-in task is "
                    f"one of {', '.join(BUILTIN_TASKS)}"
                )
            name = task_name(task)
            if name in names:
                raise ConfigError(
                    f"{path}.tasks holds {names[name]!r} and {task!r}, both named {name!r} "
                    "in the metrics; rename one file"
                )
            names[name] = task
