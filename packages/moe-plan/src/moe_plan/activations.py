"""Bytes a rank holds for backward after the forward of one micro-batch, by recompute mode.

Each term is a tensor the model's forward keeps for its backward (read off the model code and
checked against torch's saved-tensor hooks in the tests). Legend: T tokens of the micro-batch
on this rank (under context parallelism its 2 x C positions of each sequence, S / cp), D model width, Q query width (D), K key/value width, F expert width, E experts,
L local experts, k top-k, R rows the local experts compute (T * k copies, received from the
expert-parallel group, plus alignment padding), c compute bytes, w parameter bytes.

FP8 saves nothing here: moe-kernels' rowwise FP8 and emulated MXFP8 expert GEMMs and torchao's
Float8Linear (precision.linear) keep their bf16 inputs for backward and quantize transient
copies in each product (forward, input and weight gradient), so an FP8 layout holds what its
bf16 twin holds (`test_fp8_keeps_what_bf16_keeps_for_backward`). On SM100 GPUs MXFP8 experts
run torchao's kernels through moe-kernels' glue, which keeps the same: the input, the weights
and the group ends, rebuilding torchao's column-major and padded copies in backward
(`test_mxfp8_on_torchao_kernels_keeps_what_bf16_keeps`). Transformer
Engine, which the published FP8 runs use, keeps FP8 copies of its inputs instead; this trainer
does not.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from moe_plan.config import Config, ModelConfig
from moe_plan.mirrored import capacity_per_expert

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
INDEX_BYTES = 8  # int64 token and slot indices
FP32 = 4
FP8_SCALE_BYTES = 4
"""The fp32 scale each FP8-dispatched token row carries (model.moe.dispatch_dtype=fp8; the
layout of `moe_dispatch.row_wire.Fp8Rows`, which this torch-free package cannot import)."""


def fp8_dispatch_row_bytes(config: Config) -> int:
    """Bytes of one token row as FP8 dispatch sends it: d_model e4m3 values and its scale."""
    return config.model.d_model + FP8_SCALE_BYTES


HOST_GRAPH_BYTES_PER_BLOCK = 32 * 2**10
"""Host memory of one block's autograd graph and recompute records, seen by a host-memory
measurement on the CPU (about this much per block whatever the sizes); on a GPU it is not
device memory, so the predictions leave it out."""


@dataclass(frozen=True)
class Widths:
    """The sizes the terms use, from a config."""

    d: int
    kv: int
    heads: int
    head_dim: int
    f: int
    e: int
    local: int
    k: int
    c: int
    w: int
    seq_len: int
    """Positions of each sequence on this rank (S / cp)."""
    cp: int
    """Ranks each sequence is split over; attention holds the keys and values of all S."""
    qk_norm: bool
    casts: bool
    """Whether the forward keeps compute-dtype copies of the weights (FP32 parameters with
    bf16 compute), as autocast and the experts' casts do."""

    @classmethod
    def of(cls, config: Config) -> Widths:
        model, moe = config.model, config.model.moe
        head_dim = model.d_model // model.n_heads
        c = DTYPE_BYTES[config.precision.compute_dtype]
        w = DTYPE_BYTES[config.precision.param_dtype]
        return cls(
            d=model.d_model,
            kv=model.n_kv_heads * head_dim,
            heads=model.n_heads,
            head_dim=head_dim,
            f=moe.expert_hidden,
            e=moe.num_experts,
            local=moe.num_experts // config.parallel.ep,
            k=moe.top_k,
            c=c,
            w=w,
            seq_len=config.data.seq_len // config.parallel.cp,
            cp=config.parallel.cp,
            qk_norm=bool(model.qk_norm),
            casts=c != w,
        )


def capacity(config: Config, tokens: int) -> int | None:
    """Copies one source may send each expert for `tokens` tokens (None: dropless), by the
    dispatchers' own rule."""
    moe = config.model.moe
    return capacity_per_expert(moe.capacity_factor, tokens, moe.top_k, moe.num_experts)


def routed_rows(config: Config, tokens: int) -> float:
    """Rows the local experts of one MoE layer compute for `tokens` tokens per rank: the
    copies a balanced router sends them, plus room for each expert's group to be padded to
    `group_alignment` rows (sized for the worst case, so that no sizes wait on the device);
    with rowwise dispatch, its static buffers."""
    moe, ep = config.model.moe, config.parallel.ep
    local = moe.num_experts // ep
    per_expert = capacity(config, tokens)
    if config.parallel.dispatcher == "rowwise" and per_expert is not None:
        return local * _aligned(ep * per_expert, moe.group_alignment)
    return tokens * moe.top_k + local * (moe.group_alignment - 1)


def _aligned(rows: int, alignment: int) -> int:
    return -(-rows // alignment) * alignment


def attention_block_bytes(x: Widths, tokens: int, batch: int) -> float:
    """Attention with its pre-norm, no recompute."""
    t = tokens
    norm = t * x.d * x.w + t * FP32  # input of the RMSNorm and its reciprocal RMS
    qkv = t * x.d * x.c + t * (x.d + 2 * x.kv) * x.c  # projection input, its output
    rotated = t * (x.d + x.kv) * x.c  # queries and keys after RoPE
    scores = batch * x.heads * x.seq_len * FP32  # attention's log-sum-exp
    qk_norm = t * (x.heads + x.kv // x.head_dim) * FP32 if x.qk_norm else 0  # per-head RMS
    out = t * x.d * x.c  # attention output (the output projection's input)
    # RoPE tables cast to the compute dtype, for queries and keys (FP32 ones are views).
    rope = 0 if x.c == FP32 else 4 * x.seq_len * x.head_dim // 2 * x.c
    weights = (x.d * (x.d + 2 * x.kv) + x.d * x.d) * x.c if x.casts else 0
    if x.cp > 1:
        # Attention keeps the rotated queries and the gathered keys and values: the
        # projection's output only where QK-norm keeps it.
        rotated = t * x.d * x.c + gathered_kv_bytes(x, batch)
        if not x.qk_norm:
            qkv -= t * (x.d + 2 * x.kv) * x.c
    return norm + qkv + rotated + scores + qk_norm + out + rope + weights


def gathered_kv_bytes(x: Widths, batch: int) -> float:
    """Context parallelism: the keys and values of the whole sequences that attention keeps
    for its backward, with their own heads (not repeated under grouped-query attention)."""
    return 2 * batch * x.seq_len * x.cp * x.kv * x.c


def moe_block_bytes(config: Config, x: Widths, tokens: int) -> float:
    """Routed experts with their pre-norm, no recompute."""
    t, r = tokens, routed_rows(config, tokens)
    norm = t * x.d * x.w + t * FP32
    router = (
        t * x.d * FP32  # the router's FP32 input
        + 2 * t * x.e * FP32  # logits and probabilities
        + t * x.k * (INDEX_BYTES + FP32)  # chosen experts and their weights
        + 2 * t * FP32  # log-sum-exp (z-loss) and the top-k normaliser
        + x.e * FP32
        + (t * FP32 if config.model.moe.router == "sigmoid" else 0)
        + (x.d * x.e * FP32 if x.w < FP32 else 0)  # the FP32 copy of a low-precision weight
    )
    dispatch = t * x.k * INDEX_BYTES + r * INDEX_BYTES + t * x.k * x.c  # order, slots, weights
    if config.model.moe.capacity_factor is not None and config.parallel.dispatcher != "rowwise":
        dispatch += t * x.k  # which copies were kept (bool)
    experts = (
        r * x.d * x.c  # expert input
        + r * 2 * x.f * x.c  # gate and up projections
        + 2 * r * x.f * x.c  # silu(gate) and the activation (the down projection's input)
        + r * x.d * x.c  # expert output, kept by the weighted combine
        + x.local * 4  # int32 group ends
    )
    weights = x.local * 3 * x.d * x.f * x.c if x.casts else 0
    shared = _swiglu_bytes(x, t, config.model.moe.shared_experts * x.f)
    if shared and x.c == FP32:
        shared -= t * x.d * x.c  # its input is the router's (FP32) input
    return norm + router + dispatch + experts + weights + shared


def dense_block_bytes(model: ModelConfig, x: Widths, tokens: int) -> float:
    """A dense SwiGLU feed-forward with its pre-norm, no recompute."""
    return tokens * x.d * x.w + tokens * FP32 + _swiglu_bytes(x, tokens, model.dense_hidden)


def _swiglu_bytes(x: Widths, tokens: int, hidden: int) -> float:
    if hidden == 0:
        return 0
    kept = tokens * x.d * x.c + tokens * 2 * hidden * x.c + 2 * tokens * hidden * x.c
    weights = 3 * x.d * hidden * x.c if x.casts else 0
    return kept + weights


def held_inputs(config: Config, model: tuple) -> tuple:
    """What `held_per_micro_batch` reads of `config` (a cache key, with its arguments), given
    `model`, a key of the model section (its `model_key`, or a number for it): the model
    whole, and of the sections a layout sets, the fields read here (keep it in step with the
    functions below)."""
    data, parallel, precision = config.data, config.parallel, config.precision
    return (
        model,
        data.seq_len,
        data.micro_batch_size,
        parallel.ep,
        parallel.cp,
        parallel.pp > 1,
        parallel.recompute,
        parallel.dispatcher,
        precision.compute_dtype,
        precision.param_dtype,
    )


def held_per_micro_batch(config: Config, layers: Sequence[int], first: bool, last: bool) -> float:
    """Bytes held for backward after the forward of one micro-batch of the pipeline stage(s)
    that hold `layers` (the final norm, head and MTP modules on the `last` one);
    It reads `layers` only
    through whether each, in order, is dense, so `moe_plan.memory` keeps the answers by
    that (`rank_shape`) and `held_inputs`."""
    x = Widths.of(config)
    model = config.model
    batch = config.data.micro_batch_size
    t = batch * x.seq_len
    # Blocks of one kind hold the same bytes: each is computed once, then summed per layer,
    # in layer order (the same additions as one sum over the layers).
    if not layers or min(layers) >= model.dense_layers or max(layers) < model.dense_layers:
        dense = bool(layers) and layers[0] < model.dense_layers
        total = sum(itertools.repeat(_block_bytes(config, x, t, batch, dense), len(layers)))
    else:
        kinds = {dense: _block_bytes(config, x, t, batch, dense) for dense in (False, True)}
        total = sum(kinds[layer < model.dense_layers] for layer in layers)
    if x.cp > 1 and x.c == FP32 and layers:
        total += x.seq_len * x.head_dim * FP32  # this rank's rows of the cos and sin tables
    if config.parallel.pp > 1 and not last:
        total += t * x.d * x.w  # the stage's output, kept until its gradient arrives
        if model.mtp_depth:
            total += t * x.d * x.w  # and the token embeddings the MTP modules read
    if last:
        total += t * x.d * x.w + t * FP32 + loss_bytes(config)  # the final norm, the loss
        # Every MTP module runs on every position held (the last k of a sequence with their
        # targets ignored), so that context-parallel chunks stay equal.
        total += model.mtp_depth * mtp_module_bytes(config, x, batch, x.seq_len)
        if model.mtp_depth and x.cp > 1 and x.c == FP32:
            total += x.seq_len * x.head_dim * FP32  # the MTP modules' rows of the tables
    return total


def mtp_module_bytes(config: Config, x: Widths, batch: int, positions: int) -> float:
    """What one multi-token-prediction module holds for `batch` rows of `positions`: the
    embeddings it reads (those k positions further along, a tensor of their own), its
    projection's input (two normed halves), its three norms' statistics, its (dense) block
    (attention's per-row statistics counted at the full sequence length), its final norm's
    input and its fused loss."""
    t = batch * positions
    return (
        3 * t * x.d * x.w
        + 3 * t * FP32
        + _block_bytes(config, x, t, batch, dense=True)
        + t * x.d * x.w
        + loss_bytes(config, t)
    )


def _block_bytes(config: Config, x: Widths, tokens: int, batch: int, dense: bool) -> float:
    """What one block (dense feed-forward or MoE) holds for `tokens` tokens in `batch` rows
    under the recompute mode."""
    mode, t = config.parallel.recompute, tokens
    block_input = t * x.d * x.w
    total = 0.0
    if mode != "none" and x.casts:
        # Autocast keeps its cast of each weight it casts until the forward ends (the
        # saved tensors of no recompute are the same copies).
        total += _autocast_weight_bytes(config, x, dense)
    if mode == "full":
        return total + block_input
    if mode == "selective":
        return total + block_input + _selective_block_bytes(config, x, t, dense)
    total += attention_block_bytes(x, t, batch)
    if dense:
        return total + dense_block_bytes(config.model, x, t)
    return total + moe_block_bytes(config, x, t)


def loss_bytes(config: Config, tokens: int | None = None) -> float:
    """What the fused head and loss hold after the forward of `tokens` positions (default:
    a micro-batch): the gradients it computes there, of the head's input and (FP32) of its
    weight, and autocast's copy of the weight."""
    x = Widths.of(config)
    t = config.data.micro_batch_size * x.seq_len if tokens is None else tokens
    vocab = config.model.vocab_size
    return t * x.d * x.c + vocab * x.d * FP32 + (vocab * x.d * x.c if x.casts else 0)


def _autocast_weight_bytes(config: Config, x: Widths, dense: bool) -> float:
    """Compute-dtype copies of one block's weights that autocast makes (the routed experts
    cast their own, per use, and the router computes in FP32)."""
    model = config.model
    attention = x.d * (x.d + 2 * x.kv) + x.d * x.d
    if dense:
        return (attention + 3 * x.d * model.dense_hidden) * x.c
    return (attention + 3 * x.d * model.moe.shared_experts * x.f) * x.c


def _selective_block_bytes(config: Config, x: Widths, tokens: int, dense: bool) -> float:
    """Selective recompute keeps the outputs of the matrix products only."""
    t = tokens
    attention = t * (x.d + 2 * x.kv) * x.c + t * x.d * x.c
    if dense:
        hidden = config.model.dense_hidden
        return attention + t * 2 * hidden * x.c + t * x.d * x.c
    r = routed_rows(config, t)
    router = t * x.e * FP32
    experts = r * 2 * x.f * x.c + r * x.d * x.c
    shared_hidden = config.model.moe.shared_experts * x.f
    shared = t * 2 * shared_hidden * x.c + t * x.d * x.c if shared_hidden else 0
    return attention + router + experts + shared
