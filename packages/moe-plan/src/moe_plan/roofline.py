"""Step time of a layout from a roofline of its compute and its links.

Compute is each kind of matrix product at its precision's peak times the share its shape
reaches, attention at its own share, and the memory-bound kernels' bytes at the memory
bandwidth, on the busiest pipeline rank (the one holding the head); the expert-parallel
exchanges sit on the critical path (each MoE layer waits for its tokens) but for the share a
sync-free dispatcher hides behind compute; context parallelism's key/value all-gathers and
the reduce-scatters of their gradients sit on each attention layer's path (CONTEXT_OVERLAP);
gradient reductions overlap the backward and only what outlasts it shows; the distributed
optimizer's all-gather follows the step; a pipeline adds its bubble; Muon adds its
Newton-Schulz iterations. Bytes that cross nodes go at the network's rate, counted in the
layout's rank order (`traffic.across_nodes`).

Two floors keep a small model's figure from running to millions of tokens per second: the
blocks' compute takes no less than their operators take to be issued one by one (eager
PyTorch launches each operator from the host), and each collective call costs a fixed
start-up time on top of its bytes (the latency term of the usual latency-bandwidth model).
Both are negligible for models of the size this planner is for.

The constants below were set against published operating points of other systems (see
docs/planner.md, Calibration, and tests/moe_plan/test_plan_calibration.py): one set for all,
each with the reason for its value.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_plan.config import Config
from moe_plan.config.accounting import count_params, flops_per_token
from moe_plan.config.layout_shape import LayoutShape, layout_shape
from moe_plan.hardware import Device
from moe_plan.mirrored import NS_STEPS
from moe_plan.traffic import Traffic, across_nodes

MATMUL_EFFICIENCY = 0.75
"""Fraction of the datasheet peak that a large bf16 matrix product reaches (cuBLAS and
CUTLASS reach 75-80% on long contractions): the ceiling of which each product's shape gets
its share (CONTRACTION_HALF). A planning constant, not a measurement of this trainer."""

CONTRACTION_HALF = 384
"""Contraction length at which a tiled matrix product reaches half its ceiling: each output
tile pays a fixed cost (loading its first operand tiles, the epilogue that writes it) that a
contraction of length k spreads over k / tile-depth steps, so the share reached is
k / (k + CONTRACTION_HALF): three 128-deep tile steps of overhead. A 4096-wide layer loses
9%, a 768-wide expert's down projection a third: small per-expert GEMMs reach a lower
fraction of the peak than large dense ones. Each product's three matmuls (forward, input
gradient, weight gradient) contract over different lengths: the weight gradient over the
rows of its micro-batch, which for one expert are the micro-batch's tokens x top_k x ep /
num_experts."""

FP8_EFFICIENCY = 0.7
"""Share of the FP8 peak an FP8 product reaches, relative to the share the same product
reaches of the bf16 peak: scaled GEMMs apply their scales in the epilogue (MX block scales
in the main loop), and the grouped FP8 kernels are younger than the bf16 ones; at the sizes
of MoE experts they run 1.3-1.5x as fast as bf16, not the 2x of the datasheets. 0.7 gives
1.4x. The quantization itself is a memory-bound pass (MEMORY_BOUND_PASSES)."""

ATTENTION_EFFICIENCY = 0.4
"""Fraction of the bf16 peak that fused causal attention (flash attention, forward and
backward) reaches on the FLOPs counted for it (the causal half): the backward's five
products with recomputed scores, the softmax between them and the masked tiles along the
diagonal keep it well under the matmul ceiling (published flash-attention kernels: 50-75%
forward, 35-50% backward). Attention runs in bf16 whatever the linears' precision."""

MEMORY_BOUND_PASSES = {"dense": 40, "routed": 24, "quantize": 3, "logits": 8}
"""The bytes the memory-bound kernels move per token, forward and backward, in passes of
2-byte elements: "dense" over the d_model-wide tensors of each block (two norms, two
residual adds, rotary embedding and QK-norm on queries and keys, layout copies around
attention: about 20 reads and writes forward, as many backward with the saved inputs read
again); "routed" over each routed copy's d_model + expert-width elements (the permute's
gather and the unpermute's scatter, the SwiGLU activation over twice the width, the
combine's weighting, their gradients, the saved copies read back); "quantize" over those of
each operand a product quantizes to FP8, what is left when the quantization is fused into
the kernel that produces the operand (the second orientation the weight gradient needs, the
scales); "logits" over the vocabulary-wide FP32 logits (counted in 2-byte passes: written by
the head, read by the loss, their gradient written and read back). These make a model with
narrow experts and many routed copies per FLOP slower than its FLOPs say."""

MEMORY_EFFICIENCY = 0.6
"""Fraction of the datasheet memory bandwidth that the elementwise, gather and scatter
kernels reach (long streaming kernels reach 80-90%; the permutes' indexed accesses and the
many short kernels of a block much less)."""

SYNC_FREE_DISPATCHERS = ("rowwise", "deepep")
"""Dispatchers whose exchange the device can run beside compute: they keep the routing on
the device, so the host queues the next kernels without waiting. all_to_all needs each
layer's split sizes on the host first: its exchange stays on the critical path."""

EXCHANGE_OVERLAP = 0.75
"""Share of a sync-free dispatcher's expert-parallel exchange hidden behind compute (one
micro-batch's dispatch and combine beside another's matrix products, as the reference system
and Megatron's overlapped schedule do): most of it, but not the first and last exchanges of
a step, the layers whose exchange outlasts their compute, and the time the copy kernels take
from the products whose SMs they share."""

OPERATOR_FLOOR_S = 5e-6
"""Least time one operator of the forward or backward occupies the device: its dispatch by the
framework and its kernel launch, which bound a step of small kernels whatever their FLOPs. A
planning constant at the low end of eager PyTorch's per-operator cost."""

OPERATORS_PER_BLOCK = {"none": 270, "selective": 390, "full": 390}
"""Operators one transformer block runs in the forward and backward of one micro-batch, by
recompute mode (recompute reruns the forward's operators); counted from the model's own
forward and backward in the tests, where they are checked."""

CONTEXT_OVERLAP = 0.0
"""Share of context parallelism's K/V collectives hidden behind compute: none. Each layer's
all-gather stands between its key/value projection and its attention, and the reduce-scatter
of their gradients between attention's backward and the projection's; the trainer issues
both as blocking calls inside autograd and runs one micro-batch's layer at a time, so no
compute waits beside them (an overlapped ring, which this trainer does not run, would hide
most of them)."""

COLLECTIVE_LATENCY_S = 20e-6
"""Start-up time of one process-group call, whatever its size: a planning constant of the
order that collective libraries report for small messages within a node."""

BACKWARD_SHARE = 2 / 3
"""Share of a step's compute in the backward (two of the three matmuls per weight)."""

FP32_SLOWDOWN = 8.0
"""How many times longer an FP32 matrix product takes than a bf16 one (no tensor cores for
FP32 unless TF32 is on): a planning constant, for optim.muon_ns_dtype=float32."""


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    exchange_s: float
    """Expert-parallel dispatch and combine, not overlapped."""
    reduction_s: float
    """Gradient reductions and parameter gathers that do not overlap the backward."""
    bubble_s: float
    pipeline_s: float
    optimizer_s: float = 0.0
    """Muon's Newton-Schulz iterations (zero for AdamW, whose step the roofline leaves out)."""
    context_s: float = 0.0
    """Context parallelism's K/V all-gathers and gradient reduce-scatters, not overlapped."""

    @property
    def total_s(self) -> float:
        return (
            self.compute_s
            + self.exchange_s
            + self.reduction_s
            + self.bubble_s
            + self.pipeline_s
            + self.optimizer_s
            + self.context_s
        )


def step_time(
    config: Config,
    world_size: int,
    device: Device,
    traffic: Traffic,
    per_token: tuple[float, float] | None = None,
) -> StepTime:
    """The roofline's step time of the busiest rank (data-parallel ranks alike; of the
    pipeline ranks, the last, which holds the head). `dp` counts the context-parallel ranks
    too: a rank computes global batch x S / dp tokens a step, in micro-batches of S / cp
    positions per sequence. `per_token`: `compute_seconds(config, device)`, when the caller
    has it."""
    parallel = config.parallel
    shape = layout_shape(config, world_size)
    compute_s = compute_time(config, world_size, device, per_token)
    exchange_s = reduction_s = pipeline_s = context_s = 0.0
    for kind, wire in traffic.wire.items():
        seconds = _seconds(config, world_size, device, kind, wire)
        seconds += traffic.calls.get(kind, 1) * COLLECTIVE_LATENCY_S
        if kind.startswith("ep "):
            exchange_s += seconds
        elif kind.startswith("cp "):
            context_s += (1 - CONTEXT_OVERLAP) * seconds
        elif kind == "pipeline":
            pipeline_s += seconds
        elif kind.endswith("all-gather"):
            reduction_s += seconds
        else:
            reduction_s += max(0.0, seconds - BACKWARD_SHARE * compute_s)
    bubble = bubble_share(config, shape)
    if parallel.dispatcher in SYNC_FREE_DISPATCHERS:
        exchange_s -= min(EXCHANGE_OVERLAP * exchange_s, compute_s)
    busy = compute_s + exchange_s + context_s
    optimizer_s = newton_schulz_flops(config, shape.dp) / parallel.pp / (device.bf16_tflops * 1e12)
    if config.optim.muon_ns_dtype == "float32":
        optimizer_s *= FP32_SLOWDOWN
    optimizer_s /= MATMUL_EFFICIENCY
    return StepTime(
        compute_s, exchange_s, reduction_s, bubble * busy, pipeline_s, optimizer_s, context_s
    )


def compute_time(
    config: Config,
    world_size: int,
    device: Device,
    per_token: tuple[float, float] | None = None,
) -> float:
    """`StepTime.compute_s`: the busiest rank's compute of a step, recompute included, and
    no less than its operators take to be issued. `per_token`: `compute_seconds(config,
    device)`, when the caller has it."""
    data, shape = config.data, layout_shape(config, world_size)
    tokens_per_rank = data.global_batch_size * data.seq_len / shape.dp
    per_token_s = busiest_rank_seconds(config, device, per_token)
    return max(
        per_token_s * tokens_per_rank * _recompute_factor(config), operator_floor_s(config, shape)
    )


def bubble_share(config: Config, shape: LayoutShape) -> float:
    """The pipeline bubble as a share of the busy time of a step (`StepTime.bubble_s` is
    this share of compute, exchange and context time): (pp - 1) / (chunks x micro-batches)."""
    parallel = config.parallel
    if parallel.pp == 1:
        return 0.0
    chunks = parallel.virtual_stages if parallel.pp_schedule == "interleaved_1f1b" else 1
    return (parallel.pp - 1) / (chunks * shape.micro_batches_per_rank)


def least_step_time(config: Config, world_size: int, compute_s: float) -> float:
    """A time the layout's step takes at least (`StepTime.total_s` >= it, in floating point
    too): its compute `compute_s` (`compute_time`) and the bubble over that compute; every
    other part of the step is zero or more, and adding it cannot round the sum below this."""
    bubble = bubble_share(config, layout_shape(config, world_size))
    return compute_s + bubble * compute_s


def compute_inputs(config: Config) -> tuple:
    """What `compute_seconds` reads of the sections a layout sets (with the model section and
    the device, all it reads): a cache key among the layouts of one config and device. Keep
    it in step with `compute_seconds` and the functions it calls."""
    data, parallel, precision = config.data, config.parallel, config.precision
    return (
        data.micro_batch_size,
        data.seq_len,
        parallel.cp,
        parallel.ep,
        precision.expert_gemm,
        precision.compute_dtype,
        precision.linear,
    )


def newton_schulz_flops(config: Config, dp: int = 1) -> float:
    """FLOPs of one Muon step's Newton-Schulz iterations on one rank, over the hidden
    matrices of all layers (the routed experts of one expert-parallel rank), zero with
    optim.name=adamw. With the distributed optimizer on `dp` data-parallel ranks a rank
    iterates only the matrices it owns: about 1/dp of the dense ones and 1/(dp / ep) of its
    experts'. Per iteration on an m x n matrix (m <= n): X X^T, its square and the product
    with X, 4 m^2 n + 2 m^3."""
    if config.optim.name != "muon":
        return 0.0
    model, moe = config.model, config.model.moe
    d, kv = model.d_model, model.n_kv_heads * (model.d_model // model.n_heads)
    attention = [(d + 2 * kv, d), (d, d)]
    shapes = [(model.n_layers, *shape) for shape in attention]  # (count, rows, columns)
    moe_layers = model.n_layers - model.dense_layers
    if model.dense_layers:
        dense_ffn = [(2 * model.dense_hidden, d), (d, model.dense_hidden)]
        shapes += [(model.dense_layers, *shape) for shape in dense_ffn]
    shared = moe.shared_experts * moe.expert_hidden
    shapes += [(moe_layers, 2 * shared, d), (moe_layers, d, shared)] if shared else []
    experts = moe_layers * moe.num_experts // config.parallel.ep
    expert_shapes = [(experts, d, 2 * moe.expert_hidden), (experts, moe.expert_hidden, d)]
    dense_share = expert_share = 1.0
    if config.parallel.distributed_optimizer:
        dense_share, expert_share = 1 / dp, config.parallel.ep / dp
    return dense_share * _iteration_flops(shapes) + expert_share * _iteration_flops(expert_shapes)


def _iteration_flops(shapes: list[tuple[int, int, int]]) -> float:
    """Newton-Schulz FLOPs of (count, rows, columns) matrices."""
    flops = 0.0
    for count, rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        flops += count * NS_STEPS * (4 * m * m * n + 2 * m**3)
    return flops


def operator_floor_s(config: Config, shape: LayoutShape) -> float:
    """Least compute time of one rank's step: its blocks' operators, issued one at a time for
    each of its micro-batches."""
    num_micro = shape.micro_batches_per_rank
    blocks = config.model.n_layers / config.parallel.pp
    return num_micro * blocks * OPERATORS_PER_BLOCK[config.parallel.recompute] * OPERATOR_FLOOR_S


def _recompute_factor(config: Config) -> float:
    """Compute relative to no recompute: full reruns the forward (a third of the step)."""
    mode = config.parallel.recompute
    return 4 / 3 if mode == "full" else 1.0 + (0.02 if mode == "selective" else 0.0)


def busiest_rank_seconds(
    config: Config, device: Device, per_token: tuple[float, float] | None = None
) -> float:
    """Compute seconds per token of the busiest pipeline rank, forward and backward without
    recompute: its share of the blocks and, on the last rank, the head and the loss (stages
    hold equal numbers of blocks, so the head's rank is the slowest and sets the pace).
    `per_token`: `compute_seconds(config, device)`, when the caller has it."""
    blocks, head = per_token or compute_seconds(config, device)
    return blocks / config.parallel.pp + head


def compute_seconds(config: Config, device: Device) -> tuple[float, float]:
    """Seconds of compute per token of the whole model's blocks and of its head (with the
    loss), forward and backward without recompute: each kind of matrix product at its
    precision's rate and its shape's share of the ceiling, attention at ATTENTION_EFFICIENCY,
    the memory-bound kernels' bytes at MEMORY_EFFICIENCY of the memory bandwidth."""
    model, moe, data = config.model, config.model.moe, config.data
    d, h, k = model.d_model, moe.expert_hidden, moe.top_k
    bf16, fp8 = device.bf16_tflops * 1e12, device.fp8_tflops * 1e12
    experts_fp8 = expert_gemm_runs_in_fp8(config, device)
    linears_fp8 = linears_run_in_fp8(config, device)
    flops = _flops_by_kind(config)
    # A dense product's weight-gradient contraction: the rank's positions of a micro-batch.
    rows = data.micro_batch_size * data.seq_len / config.parallel.cp
    expert_rows = rows * config.parallel.ep * k / moe.num_experts  # each local expert's rows
    # gate_up (2/3 of the expert FLOPs): contractions d, 2h, rows; down: h, d, rows.
    expert_share = (2 / 3) * _mean_efficiency([d, 2 * h, expert_rows]) + (1 / 3) * _mean_efficiency(
        [h, d, expert_rows]
    )
    dense_share = _mean_efficiency([d, d, rows])
    fp8 *= FP8_EFFICIENCY
    blocks = flops["experts"] / ((fp8 if experts_fp8 else bf16) * expert_share)
    blocks += flops["linears"] / ((fp8 if linears_fp8 else bf16) * dense_share)
    blocks = blocks / MATMUL_EFFICIENCY + flops["attention"] / (bf16 * ATTENTION_EFFICIENCY)
    head = flops["head"] / (bf16 * dense_share * MATMUL_EFFICIENCY)
    if device.memory_tbps > 0:
        bandwidth = device.memory_tbps * 1e12 * MEMORY_EFFICIENCY
        blocks += _memory_bound_bytes(config, experts_fp8, linears_fp8) / bandwidth
        head += 4 * MEMORY_BOUND_PASSES["logits"] * model.vocab_size / bandwidth
    return blocks, head


def _efficiency(contraction: float) -> float:
    """Share of the matmul ceiling a product of this contraction length reaches."""
    return contraction / (contraction + CONTRACTION_HALF)


def _mean_efficiency(contractions: list[float]) -> float:
    """The share of equal-FLOP products (forward, input gradient, weight gradient) together:
    the harmonic mean, since each takes its FLOPs over its own share."""
    return len(contractions) / sum(1 / _efficiency(c) for c in contractions)


def _flops_by_kind(config: Config) -> dict[str, float]:
    """Training FLOPs per token by kind of product: the routed experts', the other linear
    layers' (attention projections, shared experts, dense feed-forwards), the head's and the
    router's (which stay in bf16), and attention's scores and values."""
    model, moe = config.model, config.model.moe
    d = model.d_model
    moe_layers = model.n_layers - model.dense_layers
    counts = count_params(model)
    total = flops_per_token(model, config.data.seq_len)
    matmuls = 6 * (counts.active + counts.mtp_active)
    experts = 6 * moe_layers * moe.top_k * 3 * d * moe.expert_hidden
    head = 6 * model.vocab_size * d * (1 + model.mtp_depth)
    router = 6 * moe_layers * d * moe.num_experts  # bf16, counted with the head's share
    return {
        "experts": experts,
        "linears": matmuls - experts - head - router,
        "head": head + router,
        "attention": total - matmuls,
    }


def _memory_bound_bytes(config: Config, experts_fp8: bool, linears_fp8: bool) -> float:
    """Bytes the memory-bound kernels move per token, forward and backward (see
    MEMORY_BOUND_PASSES)."""
    model, moe = config.model, config.model.moe
    d, routed = model.d_model, moe.top_k * (model.d_model + moe.expert_hidden)
    moe_layers = model.n_layers - model.dense_layers
    passes = MEMORY_BOUND_PASSES
    elements = model.n_layers * passes["dense"] * d + moe_layers * passes["routed"] * routed
    if experts_fp8:
        elements += moe_layers * passes["quantize"] * routed
    if linears_fp8:
        elements += model.n_layers * passes["quantize"] * 2 * d
    return 2 * elements


def expert_gemm_runs_in_fp8(config: Config, device: Device) -> bool:
    """Whether the config's expert GEMMs run at `device`'s FP8 rate: where moe-devices' rule
    runs them on FP8 tensor cores (auto: what it leaves to the device for the compute dtype)."""
    gemm, precision = config.precision.expert_gemm, config.precision
    if device.fp8_tflops <= 0:
        return False
    paths = device.kernel_paths
    if gemm == "auto":
        return paths.runs_in_fp8(paths.auto_expert_gemm(precision.compute_dtype).name)
    return gemm in ("mxfp8", "fp8_rowwise") and paths.runs_in_fp8(gemm)


def linears_run_in_fp8(config: Config, device: Device) -> bool:
    """Whether the other linear layers (precision.linear) run at `device`'s FP8 rate."""
    native = device.kernel_paths.fp8_linear.name == "native"
    return config.precision.linear != "bf16" and device.fp8_tflops > 0 and native


def _seconds(config: Config, world_size: int, device: Device, kind: str, wire: float) -> float:
    """Time to send `wire` bytes of a collective kind: the NVLink and network parts at once."""
    network = across_nodes(config, world_size, kind, wire, device.gpus_per_node)
    return max(
        (wire - network) / (device.intra_node_gbps * 1e9),
        network / (device.inter_node_gbps * 1e9),
    )


def tokens_per_second_per_device(config: Config, world_size: int, time: StepTime) -> float:
    return speed_at(config, world_size, time.total_s)


def speed_at(config: Config, world_size: int, step_s: float) -> float:
    """Tokens/s per device at `step_s` seconds a step (never less at a shorter time)."""
    return config.data.global_batch_size * config.data.seq_len / step_s / world_size


def mfu(config: Config, tokens_per_s_per_device: float, device: Device) -> float:
    """Model FLOPs utilisation against the device's bf16 peak."""
    flops = flops_per_token(config.model, config.data.seq_len)
    return flops * tokens_per_s_per_device / (device.bf16_tflops * 1e12)
