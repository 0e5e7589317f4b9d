"""The optimizer's and the training loop's config: optim.*, train.* and train.routing_check.*."""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field
from typing import Literal

from moe_plan.config.checks import _non_negative, _positive
from moe_plan.errors import ConfigError


@dataclass(kw_only=True)
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW on every parameter. muon: Muon (momentum orthogonalised by a Newton-Schulz
    iteration, scaled to AdamW's update size) on the hidden matrices (attention projections,
    dense and shared-expert FFN matrices, each routed expert's matrices on their own), AdamW
    on the embedding, output head, norms and router. With parallel.distributed_optimizer
    each Muon matrix is owned whole by one rank of its reduction group (balanced by size)."""
    lr: float = 1e-3
    """Peak learning rate: AdamW's, or with name=muon Muon's (its updates are scaled to the
    size of AdamW's, so the same value fits both; see adamw_lr_ratio)."""
    adamw_lr_ratio: float = 1.0
    """With name=muon: the learning rate of the AdamW-updated parameters, as a multiple of
    the scheduled lr (the schedule applies to both)."""
    muon_momentum: float = 0.95
    """With name=muon: Muon's (Nesterov) momentum coefficient."""
    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """With name=muon: the dtype of the five Newton-Schulz iterations (momentum and weights
    stay FP32)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms or biases)."""
    warmup_steps: int = 10
    """Steps of linear warmup up to lr: step N <= warmup_steps runs at lr * N / warmup_steps."""
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
        _positive(self, path, "lr", "eps", "adamw_lr_ratio")
        _non_negative(self, path, "weight_decay", "warmup_steps")
        for key in ("name", "schedule", "muon_ns_dtype"):
            _one_of(self, path, key)
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"{path}.muon_momentum={self.muon_momentum} must be in [0, 1)")
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


@functools.cache
def _optim_hints() -> dict[str, object]:
    """OptimConfig's field types, resolved once (resolving them is slow, and the planner
    validates thousands of configs)."""
    return typing.get_type_hints(OptimConfig)


def _one_of(config: OptimConfig, path: str, key: str) -> None:
    """Refuse a value of a Literal-typed field outside its choices."""
    choices = typing.get_args(_optim_hints()[key])
    value = getattr(config, key)
    if value not in choices:
        raise ConfigError(
            f"{path}.{key}={value!r} must be one of {', '.join(repr(c) for c in choices)}"
        )


@dataclass(kw_only=True)
class RoutingCheckConfig:
    """When to warn that the balancing loss hides an uneven load, and that a layer's routing
    has collapsed onto one expert (RUN_DIR/expert_load.jsonl)."""

    max_rank_imbalance: float | None = 1.3
    """Copies processed by a layer's busiest expert-parallel rank over the mean per rank, over
    a step's global batch, above which that rank holds the step up; null turns the check off.
    With parallel.ep=1 there is one rank and the check never fires."""
    balanced_lb_loss: float = 1.1
    """A layer's load-balancing loss (unweighted, mean over micro-batches; 1.0 when even) at
    or below which the loss counts its routing as balanced."""
    max_expert_share: float | None = 0.9
    """Share of a step's tokens (over its global batch) that a layer's busiest expert
    receives, above which the layer counts as collapsed onto it: its load max/mean over the
    largest possible, num_experts / top_k (a token's top_k experts are distinct, so 1.0 means
    every token). null turns the check off; a layer whose even share, top_k / num_experts,
    is already at or above it is never flagged."""
    logged_steps: int = 5
    """Logged steps (every train.log_interval) in a row that a layer must look balanced to
    the loss while its rank imbalance exceeds max_rank_imbalance, or have its busiest expert
    above max_expert_share, before the console warns, once per layer and check, and the
    metrics rows count the layer in hidden_imbalance_layers or collapsed_layers."""

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
        share = self.max_expert_share
        if share is not None and not 0 < share < 1:
            raise ConfigError(
                f"{path}.max_expert_share={share} must be above 0 and below 1 (the share of a "
                f"step's tokens at the busiest expert is 1.0 at most), or null to turn the "
                f"collapse check off"
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
    """Log metrics at every step that is a multiple of this, and at the last step (step N is
    the state after N optimizer steps)."""
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
    short runs, so it is off here and on in configs/medium.yaml (see docs/training.md)."""
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
    profile: list[int] = field(default_factory=list)
    """Steps to trace with the torch profiler (step N is the N-th optimizer step): each rank
    writes RUN_DIR/profile/step_NNNNNNNN_rank_R.json, a Chrome trace with named ranges around
    each MoE layer's routing, dispatch, experts, shared experts and combine (NVTX ranges too
    on GPUs); see docs/speed.md for how to read one. Empty: nothing is traced."""

    def validate(self, path: str) -> None:
        _positive(self, path, "max_steps", "log_interval")
        bad = [s for s in self.profile if not isinstance(s, int) or not 1 <= s <= self.max_steps]
        if bad:
            raise ConfigError(
                f"{path}.profile={self.profile}: steps to trace must be whole numbers from 1 to "
                f"{path}.max_steps={self.max_steps}; {bad[0]!r} is not"
            )
        _non_negative(self, path, "max_skipped_steps")
        self.routing_check.validate(f"{path}.routing_check")
        if self.seed < 0:
            raise ConfigError(f"{path}.seed={self.seed} must be >= 0")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ConfigError(f"{path}.peak_flops={self.peak_flops} must be positive or null")
