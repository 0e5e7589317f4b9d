"""Step time of a layout from a roofline of its compute and its links.

Compute runs at a fixed fraction of the device's matmul peak; the expert-parallel exchanges
sit on the critical path (each MoE layer waits for its tokens); gradient reductions overlap
the backward and only what outlasts it shows; the distributed optimizer's all-gather follows
the step; a pipeline adds its bubble; Muon adds its Newton-Schulz iterations.

Two floors keep a small model's figure from running to millions of tokens per second: the
blocks' compute takes no less than their operators take to be issued one by one (eager
PyTorch launches each operator from the host), and each collective call costs a fixed
start-up time on top of its bytes (the latency term of the usual latency-bandwidth model).
Both are negligible for models of the size this planner is for.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_parallel.muon import NS_STEPS
from moe_train.config import Config
from moe_train.model.accounting import count_params, flops_per_token
from moe_train.plan.hardware import Device
from moe_train.plan.traffic import Traffic

MATMUL_EFFICIENCY = 0.6
"""Fraction of the datasheet peak that the matrix products reach: a planning constant, not a
measurement of this trainer."""

OPERATOR_FLOOR_S = 5e-6
"""Least time one operator of the forward or backward occupies the device: its dispatch by the
framework and its kernel launch, which bound a step of small kernels whatever their FLOPs. A
planning constant at the low end of eager PyTorch's per-operator cost."""

OPERATORS_PER_BLOCK = {"none": 270, "selective": 390, "full": 390}
"""Operators one transformer block runs in the forward and backward of one micro-batch, by
recompute mode (recompute reruns the forward's operators); counted from the model's own
forward and backward in the tests, where they are checked."""

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

    @property
    def total_s(self) -> float:
        return (
            self.compute_s
            + self.exchange_s
            + self.reduction_s
            + self.bubble_s
            + self.pipeline_s
            + self.optimizer_s
        )


def step_time(config: Config, world_size: int, device: Device, traffic: Traffic) -> StepTime:
    """The roofline's step time of one rank (all ranks alike, pipeline stages balanced)."""
    parallel, data, model = config.parallel, config.data, config.model
    dp = world_size // parallel.pp
    tokens_per_rank = data.global_batch_size * data.seq_len / dp / parallel.pp
    flops = flops_per_token(model, data.seq_len) * tokens_per_rank * _recompute_factor(config)
    compute_s = flops / (device.bf16_tflops * 1e12 * MATMUL_EFFICIENCY)
    if expert_gemm_runs_in_fp8(config, device):  # the expert GEMMs at the FP8 rate
        compute_s -= (
            _expert_share(config) * compute_s * (1 - device.bf16_tflops / device.fp8_tflops)
        )
    compute_s = max(compute_s, operator_floor_s(config, dp))
    exchange_s = reduction_s = pipeline_s = 0.0
    for kind, wire in traffic.wire.items():
        seconds = _seconds(device, kind, wire, parallel.ep, dp)
        seconds += traffic.calls.get(kind, 1) * COLLECTIVE_LATENCY_S
        if kind.startswith("ep "):
            exchange_s += seconds
        elif kind == "pipeline":
            pipeline_s += seconds
        elif kind.endswith("all-gather"):
            reduction_s += seconds
        else:
            reduction_s += max(0.0, seconds - BACKWARD_SHARE * compute_s)
    num_micro = data.global_batch_size // data.micro_batch_size // dp
    bubble = 0.0
    if parallel.pp > 1:
        chunks = parallel.virtual_stages if parallel.pp_schedule == "interleaved_1f1b" else 1
        bubble = (parallel.pp - 1) / (chunks * num_micro)
    busy = compute_s + exchange_s
    optimizer_s = newton_schulz_flops(config, dp) / parallel.pp / (device.bf16_tflops * 1e12)
    if config.optim.muon_ns_dtype == "float32":
        optimizer_s *= FP32_SLOWDOWN
    optimizer_s /= MATMUL_EFFICIENCY
    return StepTime(compute_s, exchange_s, reduction_s, bubble * busy, pipeline_s, optimizer_s)


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


def operator_floor_s(config: Config, dp: int) -> float:
    """Least compute time of one rank's step: its blocks' operators, issued one at a time for
    each of its micro-batches."""
    parallel, data = config.parallel, config.data
    num_micro = data.global_batch_size // data.micro_batch_size // dp
    blocks = config.model.n_layers / parallel.pp
    return num_micro * blocks * OPERATORS_PER_BLOCK[parallel.recompute] * OPERATOR_FLOOR_S


def _recompute_factor(config: Config) -> float:
    """Compute relative to no recompute: full reruns the forward (a third of the step)."""
    mode = config.parallel.recompute
    return 4 / 3 if mode == "full" else 1.0 + (0.02 if mode == "selective" else 0.0)


def expert_gemm_runs_in_fp8(config: Config, device: Device) -> bool:
    """Whether the config's expert GEMMs run at `device`'s FP8 rate: mxfp8 where MXFP8 is
    native, fp8_rowwise where FP8 is, and auto (bf16 compute) where either is."""
    gemm, precision = config.precision.expert_gemm, config.precision
    if device.fp8_tflops <= 0:
        return False
    if gemm == "auto":
        return precision.compute_dtype == "bfloat16"
    return gemm == "fp8_rowwise" or (gemm == "mxfp8" and device.mxfp8)


def _expert_share(config: Config) -> float:
    """Share of the active matmul parameters in the routed experts."""
    model, moe = config.model, config.model.moe
    moe_layers = model.n_layers - model.dense_layers
    expert = moe_layers * moe.top_k * 3 * model.d_model * moe.expert_hidden
    return expert / count_params(model).active


def across_nodes(kind: str, wire: float, ep: int, dp: int, per_node: int) -> float:
    """The bytes of `wire` that a rank sends over the network rather than NVLink. An EP group
    is ep consecutive ranks: its peers off the rank's node take (ep - G) / (ep - 1) of the
    exchange. A dp group is dp consecutive ranks and an expert-dp group spans the same block
    (stride ep): a ring over several nodes is counted as crossing (its slowest hop sets its
    pace). Pipeline peers are dp ranks apart."""
    group = kind.split(" ")[0]
    if group == "ep":
        return 0.0 if ep <= per_node else wire * (ep - per_node) / (ep - 1)
    span = dp + 1 if group == "pipeline" else dp
    return 0.0 if span <= per_node else wire


def _seconds(device: Device, kind: str, wire: float, ep: int, dp: int) -> float:
    """Time to send `wire` bytes of a collective kind: the NVLink and network parts at once."""
    network = across_nodes(kind, wire, ep, dp, device.gpus_per_node)
    return max(
        (wire - network) / (device.intra_node_gbps * 1e9),
        network / (device.inter_node_gbps * 1e9),
    )


def tokens_per_second_per_device(config: Config, world_size: int, time: StepTime) -> float:
    return config.data.global_batch_size * config.data.seq_len / time.total_s / world_size


def mfu(config: Config, tokens_per_s_per_device: float, device: Device) -> float:
    """Model FLOPs utilisation against the device's bf16 peak."""
    flops = flops_per_token(config.model, config.data.seq_len)
    return flops * tokens_per_s_per_device / (device.bf16_tflops * 1e12)
