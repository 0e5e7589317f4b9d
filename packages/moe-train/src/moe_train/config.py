"""Typed, validated training configuration: YAML plus dotted command-line overrides."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from moe_train.data.token_files import split_dtype_suffix
from moe_train.errors import ConfigError


@dataclass(kw_only=True)
class MoEConfig:
    num_experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Experts each token is sent to."""
    expert_hidden: int = 256
    """Hidden width of each expert's SwiGLU."""
    shared_experts: int = 0
    """Always-active shared experts per MoE layer (each of width expert_hidden)."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """Scoring function over the router logits."""
    normalize_topk: bool = True
    """Rescale the chosen experts' scores to sum to one."""
    lb_loss_weight: float = 0.01
    """Weight of the load-balancing auxiliary loss (0 turns it off)."""
    z_loss_weight: float = 0.001
    """Weight of the router z-loss on the logits (0 turns it off)."""
    bias_update_rate: float = 0.0
    """Step of the auxiliary-loss-free balancing bias per optimizer step (0 turns it off)."""
    capacity_factor: float | None = None
    """Cap on token copies per expert as a multiple of the even share; None means dropless."""
    random_routing: bool = False
    """Route each token to top_k experts drawn uniformly at random (for system benchmarks)."""
    group_alignment: int = 32
    """Pad each expert's group of rows with zero rows to a multiple of this, so grouped GEMM
    shapes repeat and libraries reuse their compiled kernels; 1 turns padding off."""

    def validate(self, path: str) -> None:
        _positive(self, path, "num_experts", "expert_hidden", "group_alignment")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"{path}.top_k={self.top_k} must be between 1 and "
                f"{path}.num_experts={self.num_experts}"
            )
        _non_negative(
            self, path, "shared_experts", "lb_loss_weight", "z_loss_weight", "bias_update_rate"
        )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(
                f"{path}.capacity_factor={self.capacity_factor} must be positive, "
                f"or null for dropless routing"
            )


@dataclass(kw_only=True)
class ModelConfig:
    vocab_size: int = 320
    """Embedding rows; must cover every token id in the data."""
    d_model: int = 256
    """Residual stream width."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads; must divide d_model."""
    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide n_heads."""
    qk_norm: bool = False
    """RMS-normalise queries and keys per head before RoPE."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    dense_layers: int = 0
    """The first this many blocks use a dense SwiGLU feed-forward instead of MoE."""
    dense_hidden: int = 1024
    """Hidden width of the dense feed-forward blocks."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """The mixture-of-experts feed-forward blocks."""

    def validate(self, path: str) -> None:
        _positive(self, path, "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads")
        _positive(self, path, "rope_theta", "norm_eps", "init_std", "dense_hidden")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"{path}.n_heads={self.n_heads} must divide {path}.d_model={self.d_model}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError(
                f"{path}.d_model / {path}.n_heads = {self.d_model // self.n_heads} "
                f"(the head size) must be even for rotary embeddings"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"{path}.n_kv_heads={self.n_kv_heads} must divide {path}.n_heads={self.n_heads}"
            )
        if not 0 <= self.dense_layers <= self.n_layers:
            raise ConfigError(
                f"{path}.dense_layers={self.dense_layers} must be between 0 and "
                f"{path}.n_layers={self.n_layers}"
            )
        self.moe.validate(f"{path}.moe")


@dataclass(kw_only=True)
class MixtureSourceConfig:
    paths: list[str] = field(default_factory=list)
    """The source's data, in the forms of data.paths; its windows are shuffled together."""
    weight: float | None = None
    """The source's share of the training tokens, relative to the other sources' weights
    (they are divided by their sum, so 0.7 and 0.3 or 7 and 3 mix alike)."""
    name: str | None = None
    """Its label in metrics.jsonl and checkpoints; null means its paths joined by '+'."""

    @property
    def label(self) -> str:
        """`name`, or the paths joined by '+'."""
        return self.name if self.name is not None else "+".join(self.paths)

    def validate(self, path: str) -> None:
        if not self.paths:
            raise ConfigError(f"{path}.paths is empty; give the source's data paths")
        for index, entry in enumerate(self.paths):
            try:
                split_dtype_suffix(entry)
            except ValueError as e:
                raise ConfigError(f"{path}.paths[{index}]={entry!r}: {e}") from e
        if self.weight is None:
            raise ConfigError(
                f"{path}.weight is missing; give the source's share of tokens, e.g. 0.3"
            )
        if not self.weight > 0 or self.weight == float("inf"):
            raise ConfigError(f"{path}.weight={self.weight} must be a positive number")
        if self.name is not None and not self.name:
            raise ConfigError(f"{path}.name is empty; give a label or null")


@dataclass(kw_only=True)
class DataConfig:
    paths: list[str] = field(default_factory=lambda: ["builtin:stdlib"])
    """Directories written by prepare-data, .npy token arrays, headerless token files named
    with their dtype (`path.npy:uint32`; also uint16, int32, int64: raw little-endian ids, as
    OLMo-core's and dolma's tooling write them), or builtin:stdlib (no download). With
    data.mixture, every path of its sources (filled in; leave it out)."""
    mixture: list[MixtureSourceConfig] = field(default_factory=list)
    """Sources mixed by weight (`[{paths: [...], weight: 0.7}, ...]`): each step takes that
    share of its sequences from each source; empty means data.paths shuffled as one."""
    seq_len: int = 256
    """Tokens per training sequence."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass; steps accumulate global/micro of them."""
    cache_dir: str | None = None
    """Where built-in data is tokenised on first use; null means ~/.cache/moe-stack."""
    prefetch: bool = True
    """Read the next step's sequences in a background thread while this step trains (each
    rank reads only those it trains on); false reads them at the start of the step."""
    document_masking: bool = False
    """Keep attention inside each document of a packed sequence (documents end at the data's
    end-of-document id, which prepare-data records): each document is trained on as if it
    ran alone. Not with pipeline parallelism (parallel.pp > 1)."""

    def validate(self, path: str) -> None:
        if self.mixture:
            self._validate_mixture(path)
        if not self.paths:
            raise ConfigError(f"{path}.paths is empty; give at least one data path")
        for index, entry in enumerate(self.paths):
            try:
                split_dtype_suffix(entry)
            except ValueError as e:
                raise ConfigError(f"{path}.paths[{index}]={entry!r}: {e}") from e
        _positive(self, path, "seq_len", "global_batch_size", "micro_batch_size")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"{path}.micro_batch_size={self.micro_batch_size} must divide "
                f"{path}.global_batch_size={self.global_batch_size}"
            )

    def _validate_mixture(self, path: str) -> None:
        """Check the sources, and fill data.paths with their paths in order."""
        for index, source in enumerate(self.mixture):
            source.validate(f"{path}.mixture[{index}]")
        labels = [source.label for source in self.mixture]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ConfigError(
                f"{path}.mixture names the source {repeated[0]!r} twice; give each a unique name"
            )
        every_path = [entry for source in self.mixture for entry in source.paths]
        shared = sorted({entry for entry in every_path if every_path.count(entry) > 1})
        if shared:
            raise ConfigError(
                f"{path}.mixture lists {shared[0]!r} in more than one source; list each path once"
            )
        if self.paths not in (DataConfig().paths, [], every_path):
            raise ConfigError(
                f"{path}.paths={self.paths} and {path}.mixture are both set; with a mixture, "
                f"list every path in its sources and leave {path}.paths out"
            )
        self.paths = every_path


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms or biases)."""
    warmup_steps: int = 10
    """Steps of linear warmup up to lr (warmup step s, 0-based, runs at lr * (s + 1) / warmup_steps)."""
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Learning rate after the warmup: cosine or linear decay from lr to lr * min_lr_ratio over
    decay_steps steps, then flat at that floor; wsd (warmup-stable-decay) holds lr until the
    last decay_steps steps of the run, which decay linearly to the floor; constant holds lr."""
    decay_steps: int | None = None
    """Steps of the decay, the first at lr and the last at lr * min_lr_ratio (at least 2).
    cosine, linear: the decay starts after the warmup, and null means up to the run's last
    step (train.max_steps - warmup_steps steps), so raising train.max_steps on resume reshapes
    the decay, past steps included; set it for a run that may be extended, whose later steps
    then stay at the floor. wsd: the last this many steps of the run; required. constant: must
    be null."""
    min_lr_ratio: float = 0.1
    """The decay ends at lr * min_lr_ratio (not used by schedule=constant)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this; null turns clipping off."""

    def validate(self, path: str) -> None:
        _positive(self, path, "lr", "eps")
        _non_negative(self, path, "weight_decay", "warmup_steps")
        schedules = typing.get_args(typing.get_type_hints(OptimConfig)["schedule"])
        if self.schedule not in schedules:
            raise ConfigError(
                f"{path}.schedule={self.schedule!r} must be one of "
                f"{', '.join(repr(s) for s in schedules)}"
            )
        if self.decay_steps is not None and self.decay_steps < 2:
            raise ConfigError(
                f"{path}.decay_steps={self.decay_steps} must be at least 2 (the decay's first "
                f"step runs at lr, its last at lr * min_lr_ratio), or null"
            )
        if self.schedule == "wsd" and self.decay_steps is None:
            raise ConfigError(
                f"{path}.schedule=wsd needs {path}.decay_steps, the length of the final decay "
                f"(at least 2 steps, ending on the run's last step)"
            )
        if self.schedule == "constant" and self.decay_steps is not None:
            raise ConfigError(
                f"{path}.decay_steps={self.decay_steps} has no effect with "
                f"{path}.schedule=constant; set it to null or pick a decaying schedule"
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"{path}.betas={self.betas} must be two numbers in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{path}.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(
                f"{path}.grad_clip={self.grad_clip} must be positive, or null for no clipping"
            )


@dataclass(kw_only=True)
class RoutingCheckConfig:
    """When to warn that the balancing loss hides an uneven load (RUN_DIR/expert_load.jsonl)."""

    max_rank_imbalance: float | None = 1.3
    """Copies processed by a layer's busiest expert-parallel rank over the mean per rank, over
    a step's global batch, above which that rank holds the step up; null turns the check off.
    With parallel.ep=1 there is one rank and the check never fires."""
    balanced_lb_loss: float = 1.1
    """A layer's load-balancing loss (unweighted, mean over micro-batches; 1.0 when even) at
    or below which the loss counts its routing as balanced."""
    logged_steps: int = 5
    """Logged steps (every train.log_interval) in a row that a layer must look balanced to
    the loss while its rank imbalance exceeds max_rank_imbalance before the console warns,
    once per layer, and the metrics rows count the layer in hidden_imbalance_layers."""

    def validate(self, path: str) -> None:
        if self.max_rank_imbalance is not None and not self.max_rank_imbalance > 1:
            raise ConfigError(
                f"{path}.max_rank_imbalance={self.max_rank_imbalance} must be above 1 (the "
                f"busiest rank over the mean is never below 1), or null to turn the check off"
            )
        if not self.balanced_lb_loss >= 1:
            raise ConfigError(
                f"{path}.balanced_lb_loss={self.balanced_lb_loss} must be at least 1 (the "
                f"load-balancing loss of an even routing)"
            )
        _positive(self, path, "logged_steps")


@dataclass(kw_only=True)
class TrainConfig:
    max_steps: int = 200
    """Optimizer steps to run."""
    seed: int = 0
    """Seeds initialisation, data order and random routing."""
    run_dir: str = "runs/default"
    """Where metrics.jsonl and the resolved config go; a taken one gets a numbered suffix."""
    log_interval: int = 1
    """Log metrics every this many steps."""
    peak_flops: float | None = None
    """Peak matmul FLOP/s for MFU; null measures it at start-up (or looks up a known GPU)."""
    progress: bool = True
    """Print progress on stderr: a line redrawn after every step on a terminal, elsewhere one
    line every log_interval steps (the start banner, run facts and the summary print either
    way)."""
    compile: bool = False
    """Fuse the elementwise parts of the model (RMSNorm, SwiGLU activations, the norm and
    rotation of queries and keys) with torch.compile, at the first step (needs a C++
    compiler on a CPU, Triton on a GPU). Faster per step on every model measured, but its
    compilation at the start (seconds with a warm cache, more cold) outweighs that on small,
    short runs, so it is off here and on in configs/medium.yaml (see the README)."""
    max_skipped_steps: int = 5
    """A step whose loss or gradient norm is not finite is skipped (no update); after this
    many such steps in a row the run stops, its last good checkpoint intact. 0 stops at the
    first one."""
    tensorboard: bool = False
    """Also write every metrics row as TensorBoard scalars to RUN_DIR/tensorboard (rank 0;
    needs the extra moestack-train[tensorboard])."""
    wandb_project: str | None = None
    """Also log every metrics row to this Weights & Biases project, in a run named after the
    run directory that a resume continues; null turns it off (needs the extra
    moestack-train[wandb]; WANDB_MODE=offline keeps the run in RUN_DIR/wandb for `wandb sync`)."""
    routing_check: RoutingCheckConfig = field(default_factory=RoutingCheckConfig)
    """The balance-versus-load check on the logged steps' routing."""

    def validate(self, path: str) -> None:
        _positive(self, path, "max_steps", "log_interval")
        _non_negative(self, path, "max_skipped_steps")
        self.routing_check.validate(f"{path}.routing_check")
        if self.seed < 0:
            raise ConfigError(f"{path}.seed={self.seed} must be >= 0")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ConfigError(f"{path}.peak_flops={self.peak_flops} must be positive or null")


@dataclass(kw_only=True)
class ParallelConfig:
    ep: int = 1
    """Expert-parallel ranks; divides the data-parallel size and model.moe.num_experts."""
    pp: int = 1
    """Pipeline stages."""
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule."""
    virtual_stages: int = 1
    """Pipeline stages per pp rank; more than 1 only with pp_schedule=interleaved_1f1b."""
    dispatcher: Literal["auto", "local", "all_to_all", "rowwise", "deepep"] = "auto"
    """Token dispatch backend between expert-parallel ranks: auto (local with ep = 1,
    all_to_all with ep > 1), or one by name; with ep = 1 every one is local."""
    rowwise_transport: Literal["all_to_all", "symmetric_memory", "nvshmem"] = "all_to_all"
    """How dispatcher=rowwise moves its fixed-size blocks: all_to_all (an even all-to-all over
    the process group, any backend), symmetric_memory (written straight into peers' buffers;
    every rank of an EP group on one node: torch symmetric memory on GPUs, not yet run on one,
    and shared memory on CPUs) or nvshmem (the same exchange on NVSHMEM's symmetric heap, GPUs
    only, peers on other nodes reached by put; needs moestack-dispatch[nvshmem]; not yet run on
    a GPU)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over each gradient-reduction group."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute in backward."""
    timeout_s: float = 600.0
    """Seconds a collective waits for the other ranks (NCCL and gloo) before the run stops
    with an error that a rank was lost; a rank that dies outright is noticed sooner."""

    def validate(self, path: str) -> None:
        _positive(self, path, "ep", "pp", "virtual_stages", "timeout_s")


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
    expert_gemm: Literal["torch", "triton", "auto", "mxfp8"] = "torch"
    """How the routed experts' grouped GEMMs (gate_up and down; forward, input and weight
    gradients) run. torch, triton, auto: moe-kernels' grouped_mm in compute_dtype with torch's
    kernel (everywhere), its Triton kernels (for GPUs; on a CPU only under the Triton
    interpreter, TRITON_INTERPRET=1, a slow test vehicle) or, on a GPU, whichever of the two
    was measured faster per shape (torch on a CPU). mxfp8: moe-kernels' mxfp8_grouped_mm, the
    MX training recipe: each GEMM quantizes its bf16 operands along its reduction dimension
    (blocks of 32, e4m3 values, power-of-two scales); torchao's kernels on SM100 GPUs (the
    moestack-kernels[mxfp8] extra), elsewhere an exact emulation (the same numbers, slower than
    bf16). Only the expert GEMMs: attention, router, shared experts, dense feed-forwards and
    the head stay in compute_dtype. mxfp8 needs compute_dtype=bfloat16."""

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
    """Evaluate every this many steps, and after the last step; 0 turns evaluation off."""
    batches: int = 1
    """Global batches (data.global_batch_size sequences each) per evaluation: the same ones,
    in the same order, every time."""

    def validate(self, path: str) -> None:
        _non_negative(self, path, "interval")
        _positive(self, path, "batches")
        if self.interval and not self.paths:
            raise ConfigError(
                f"{path}.interval={self.interval} needs {path}.paths (held-out data, e.g. a "
                f"directory written by moe-train prepare-data); or set {path}.interval=0"
            )


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The network."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data and batch sizes."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Number formats."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""

    def validate(self) -> None:
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate(section.name)
        if self.data.document_masking and self.parallel.pp > 1:
            raise ConfigError(
                f"data.document_masking=true does not work with parallel.pp={self.parallel.pp} "
                "yet; set parallel.pp=1 or data.document_masking=false"
            )
        optim, max_steps = self.optim, self.train.max_steps
        wsd_steps = optim.warmup_steps + (optim.decay_steps or 0)
        if optim.schedule == "wsd" and wsd_steps > max_steps:
            raise ConfigError(
                f"optim.warmup_steps={optim.warmup_steps} + optim.decay_steps="
                f"{optim.decay_steps} must be at most train.max_steps={max_steps} with "
                f"optim.schedule=wsd (its decay is the run's last decay_steps steps, after warmup)"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(obj: Any, path: str, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(f"{path}.{name}={getattr(obj, name)} must be positive")


def _non_negative(obj: Any, path: str, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ConfigError(f"{path}.{name}={getattr(obj, name)} must be >= 0")


# ---- building a Config from plain data -------------------------------------------------------


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` to type `tp` or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if isinstance(tp, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is list:
        (item_type,) = typing.get_args(tp)
        if isinstance(value, str | int | float) and item_type is str:
            value = [value]
        if dataclasses.is_dataclass(item_type) and isinstance(value, list | tuple):
            return [_build(item_type, v, f"{key}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, list | tuple):
            return [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}={value!r} must be {_type_name(tp)}")


REPLACED_KEYS = {
    "model.moe.grouped_mm_backend": "precision.expert_gemm (torch, triton or auto)",
    "precision.mxfp8": "precision.expert_gemm=mxfp8",
}
"""Keys of earlier versions, and what replaced them."""


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            if full in REPLACED_KEYS:
                raise ConfigError(f"config key {full} was replaced by {REPLACED_KEYS[full]}")
            raise ConfigError(_unknown_key_message(full, str(key), names, path))
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, full)
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def _unknown_key_message(full: str, key: str, names: list[str], path: str) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    prefix = f"{path}." if path else ""
    if close:
        return f"unknown config key {full}; did you mean {prefix}{close[0]}?"
    return f"unknown config key {full}; valid keys here: {', '.join(prefix + n for n in names)}"


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from nested plain data (as read from YAML)."""
    config = _build(Config, data, "")
    config.validate()
    return config


def saved_config_from_dict(data: dict[str, Any]) -> Config:
    """A Config from one saved by any version (a checkpoint's trainer state): the keys of
    `REPLACED_KEYS` become the key that replaced them."""
    data = copy.deepcopy(data)
    moe = data.get("model", {}).get("moe", {})
    precision = data.setdefault("precision", {})
    backend = moe.pop("grouped_mm_backend", None)
    if precision.pop("mxfp8", False):
        precision["expert_gemm"] = "mxfp8"
    elif backend is not None:
        precision.setdefault("expert_gemm", backend)
    return config_from_dict(data)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ['--optim.lr=3e-4', '--model.moe.top_k', '2'] into a nested dict."""
    nested: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"override {arg!r} must look like --section.key=value")
        if "=" in arg:
            dotted, raw = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            dotted, raw = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value; write {arg}=VALUE")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        keys = dotted.split(".")
        if any(not k for k in keys):
            raise ConfigError(f"override {arg!r} has an empty key")
        node = nested
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {arg!r} conflicts with another override of {k}")
        node[keys[-1]] = value
        i += 1
    return nested


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or start from defaults when `path` is None), apply overrides."""
    data: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {path} is not valid YAML{where}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    data = _merge(data, parse_overrides(overrides or []))
    return config_from_dict(data)


def dump_config(config: Config, path: Path) -> None:
    """Write the resolved config as YAML that `load_config` reads back to the same Config."""
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
