"""Parameter and FLOP counts of a model config, for MFU and planning. Torch-free: arithmetic
on the config alone, which the trainer (`moe_train.model` re-exports it) and the planner read."""

from dataclasses import dataclass

from moe_plan.config.model import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int
    """Every parameter, all experts included."""
    active: int
    """Matmul parameters one token touches (top_k routed experts; no embedding, no norms)."""
    embedding: int
    """Input embedding rows (a lookup, no matmul)."""
    mtp: int = 0
    """Parameters of the multi-token-prediction modules (not in `total`: training only,
    left out of exports)."""
    mtp_active: int = 0
    """Matmul parameters the MTP modules apply to one token in training (their projections
    and blocks, and the shared head once per module); not in `active`."""


def count_params(config: ModelConfig) -> ParamCounts:
    """Total and per-token active parameter counts of `config`."""
    d, moe = config.d_model, config.moe
    kv_dim = config.n_kv_heads * (d // config.n_heads)
    attention = d * (d + 2 * kv_dim) + d * d
    biases = d + 2 * kv_dim if config.qkv_bias else 0
    norms = 2 * d + qk_norm_params(config) + biases
    expert = 3 * d * moe.expert_hidden
    router = d * moe.num_experts
    shared = moe.shared_experts * expert + (d if moe.shared_expert_gate else 0)
    dense_ffn = 3 * d * config.dense_hidden
    moe_layers = config.n_layers - config.dense_layers

    embedding = config.vocab_size * d
    head = 0 if config.tie_embeddings else config.vocab_size * d
    matmuls = config.n_layers * attention + config.dense_layers * dense_ffn
    all_norms = config.n_layers * norms + d
    routed_total = moe_layers * (router + shared + moe.num_experts * expert)
    total = embedding + head + matmuls + all_norms + routed_total
    active_head = config.vocab_size * d
    active = active_head + matmuls + moe_layers * (router + shared + moe.top_k * expert)
    # Each MTP module: a projection of 2d to d, a dense-feed-forward block, three norms.
    mtp_matmuls = 2 * d * d + attention + dense_ffn
    return ParamCounts(
        total=total,
        active=active,
        embedding=embedding,
        mtp=config.mtp_depth * (mtp_matmuls + norms + 3 * d),
        mtp_active=config.mtp_depth * (mtp_matmuls + active_head),
    )


def qk_norm_params(config: ModelConfig) -> int:
    """The QK-norm weights of one attention layer (per head: two of head size; over the
    projections: one per query and key channel)."""
    if not config.qk_norm:
        return 0
    head_dim = config.d_model // config.n_heads
    if config.qk_norm == "projection":
        return config.d_model + config.n_kv_heads * head_dim
    return 2 * head_dim


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active matmul parameters plus causal attention scores,
    the multi-token-prediction modules' included (each sees a position or more fewer than
    the main model: counted as if it saw them all)."""
    counts = count_params(config)
    # QK^T and AV: 2 matmuls x 2 FLOPs x d_model x (seq_len / 2 keys on average, causal),
    # times 3 for forward plus backward.
    blocks = config.n_layers + config.mtp_depth
    attention = 3 * 2 * 2 * config.d_model * (seq_len / 2) * blocks
    return 6 * (counts.active + counts.mtp_active) + attention
