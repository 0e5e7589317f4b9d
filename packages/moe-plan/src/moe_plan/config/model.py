"""The network's config: model.* and its mixture-of-experts blocks, model.moe.*."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from moe_plan.config.checks import _non_negative, _positive
from moe_plan.errors import ConfigError

LoadBalanceScope = Literal["micro_batch", "sequence", "global_batch"]
"""What the load-balancing loss's expert frequencies are counted over (`MoEConfig.lb_scope`)."""


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
    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(w . x), w a learned vector of
    each MoE layer and x the block's normalised input (as Qwen2-MoE gates its shared expert);
    needs shared_experts."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """Scoring function over the router logits."""
    normalize_topk: bool = True
    """Rescale the chosen experts' scores to sum to one."""
    lb_loss_weight: float = 0.01
    """Weight of the load-balancing auxiliary loss (0 turns it off)."""
    lb_scope: LoadBalanceScope = "micro_batch"
    """Where the load-balancing loss E * sum_e f_e * P_e measures balance. micro_batch:
    routed fractions f and mean probabilities P of each micro-batch. sequence: of each
    sequence, averaged over sequences (DeepSeek-V3's sequence-wise loss). global_batch: f
    over the previous step's whole global batch (every micro-batch and rank; even before the
    first step), P of each micro-batch, so the loss is the same in every layout and
    micro-batch size (Qwen's global-batch balancing; see docs/routing.md)."""
    z_loss_weight: float = 0.001
    """Weight of the router z-loss on the logits (0 turns it off)."""
    bias_update_rate: float = 0.0
    """Step of the auxiliary-loss-free balancing bias per optimizer step (0 turns it off)."""
    capacity_factor: float | None = None
    """Cap on token copies per expert as a multiple of the even share; None means dropless."""
    random_routing: bool = False
    """Route each token to top_k experts drawn uniformly at random (for system benchmarks)."""
    n_group: int = 1
    """Groups the experts are split into, in order (experts [g * E / n_group, (g + 1) * E /
    n_group) form group g); with topk_group < n_group each token uses experts of at most
    topk_group groups (node-limited routing, as DeepSeek-V3 and GLM-4.5 route)."""
    topk_group: int = 1
    """Groups each token may use: the groups with the highest sums of their two best selection
    scores (scores plus the balancing bias); top_k experts are then chosen inside them."""
    routed_scaling_factor: float = 1.0
    """Factor on the routed experts' combine weights (after normalize_topk), as DeepSeek-V3
    and GLM-4.5 scale them."""
    group_alignment: int = 32
    """Pad each expert's group of rows with zero rows to a multiple of this, so grouped GEMM
    shapes repeat and libraries reuse their compiled kernels; 1 turns padding off."""
    dispatch_dtype: Literal["compute", "fp8"] = "compute"
    """How the token rows reach their experts. compute: in the compute dtype. fp8: rounded to
    e4m3 with one power-of-two scale per row (the rowwise FP8 rule of
    precision.expert_gemm=fp8_rowwise), and sent between expert-parallel ranks as those bytes
    plus 4 per row, about half of bf16's; the experts receive the rounded rows, in every
    layout alike (without expert parallelism the rows are rounded the same way). The combine
    and every gradient stay in the compute dtype; the rounding's gradient is taken as the
    identity. Carried by parallel.dispatcher all_to_all, all_to_all_dedup and rowwise, not
    deepep."""

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
        self._validate_groups(path)
        if self.shared_expert_gate and not self.shared_experts:
            raise ConfigError(
                f"{path}.shared_expert_gate=true gates the shared experts; set "
                f"{path}.shared_experts to at least 1 or the gate to false"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(
                f"{path}.capacity_factor={self.capacity_factor} must be positive, "
                f"or null for dropless routing"
            )

    def _validate_groups(self, path: str) -> None:
        """n_group, topk_group and routed_scaling_factor."""
        _positive(self, path, "n_group", "routed_scaling_factor")
        if self.num_experts % self.n_group:
            raise ConfigError(
                f"{path}.n_group={self.n_group} must divide {path}.num_experts={self.num_experts}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(
                f"{path}.topk_group={self.topk_group} must be between 1 and "
                f"{path}.n_group={self.n_group}"
            )
        if self.topk_group == self.n_group:
            return  # every group is used: no group limit
        per_group = self.num_experts // self.n_group
        if per_group < 2:
            raise ConfigError(
                f"{path}.n_group={self.n_group} leaves {per_group} expert per group; groups are "
                f"ranked by their two best scores, so each needs at least 2 experts"
            )
        if self.topk_group * per_group < self.top_k:
            raise ConfigError(
                f"{path}.topk_group={self.topk_group} groups of {per_group} experts hold fewer than "
                f"{path}.top_k={self.top_k} experts"
            )


@dataclass(kw_only=True)
class RopeScalingConfig:
    """How the rotary frequencies are rescaled for a context longer than the one the model
    was first trained on (as Hugging Face configs' `rope_parameters` say it)."""

    type: Literal["none", "yarn"] = "none"
    """none: plain RoPE at model.rope_theta. yarn: YaRN (the scheme of Qwen3 and OLMo):
    the low frequencies are divided by `factor`, the high ones kept, a linear ramp between
    them, and queries and keys scaled by `attention_factor`."""
    factor: float = 1.0
    """yarn: how many times longer the new context is than original_max_position_embeddings."""
    original_max_position_embeddings: int | None = None
    """yarn: the context length the model was first trained at."""
    beta_fast: float = 32.0
    """yarn: frequencies turning more than this many times over the original context are
    kept as they are."""
    beta_slow: float = 1.0
    """yarn: frequencies turning fewer than this many times over the original context are
    divided by `factor` in full."""
    attention_factor: float | None = None
    """yarn: the scale of cos and sin (so of queries and keys); null: 0.1 * ln(factor) + 1."""

    def validate(self, path: str) -> None:
        if self.type == "none":
            changed = [
                f.name
                for f in fields(self)
                if f.name != "type"
                and getattr(self, f.name) != getattr(RopeScalingConfig(), f.name)
            ]
            if changed:
                raise ConfigError(
                    f"{path}.{changed[0]}={getattr(self, changed[0])!r} has no effect with "
                    f"{path}.type=none; set {path}.type=yarn or remove it"
                )
            return
        if self.factor < 1:
            raise ConfigError(f"{path}.factor={self.factor} must be at least 1")
        if self.original_max_position_embeddings is None:
            raise ConfigError(
                f"{path}.type=yarn needs {path}.original_max_position_embeddings, the context "
                f"length the model was first trained at"
            )
        _positive(self, path, "original_max_position_embeddings", "beta_slow")
        if self.beta_fast <= self.beta_slow:
            raise ConfigError(
                f"{path}.beta_fast={self.beta_fast} must be greater than "
                f"{path}.beta_slow={self.beta_slow}"
            )
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ConfigError(
                f"{path}.attention_factor={self.attention_factor} must be positive, or null "
                f"for 0.1 * ln(factor) + 1"
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
    qk_norm: bool | Literal["projection"] = False
    """RMS-normalise queries and keys before RoPE. true: each head's channels, with one
    weight of head size shared by all heads (Qwen3, GLM-4.5). projection: the whole query
    projection and the whole key projection, all heads together, with a weight per channel
    (OLMoE). false: no QK-norm."""
    qkv_bias: bool = False
    """Add a learned bias to the query, key and value projections (as Qwen2 does); the output
    projection has none."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """Rescaled rotary frequencies for a longer context (see `RopeScalingConfig`)."""
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
    norm_placement: Literal["input", "output"] = "input"
    """Where each block's two RMSNorms act. input: on the input of attention and of the
    feed-forward, x + attn(norm(x)) (pre-norm, as Llama, Qwen3 and OLMoE). output: on their
    output, x + norm(attn(x)) (as OLMo-2 and FlexOlmo place them). The final norm is the same
    in both."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """The mixture-of-experts feed-forward blocks."""
    mtp_depth: int = 0
    """Multi-token-prediction modules (DeepSeek-V3's MTP): module k combines the hidden state
    before it with the embedding of the token k ahead and predicts the token k + 1 ahead
    through one more block (dense feed-forward) and the shared output head; 0 turns them off.
    Training only: generation and Hugging Face exports leave them out."""
    mtp_loss_weight: float = 0.3
    """Weight of the MTP loss (the mean of the modules' cross-entropies) in the objective."""

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
        _non_negative(self, path, "mtp_depth", "mtp_loss_weight")
        self.rope_scaling.validate(f"{path}.rope_scaling")
        self.moe.validate(f"{path}.moe")
