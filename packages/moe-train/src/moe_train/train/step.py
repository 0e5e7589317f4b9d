"""One rank's share of a training step: model, optimizer, gradient path, and the step itself.

`StepRunner` builds what a rank holds for the layout (its part of the model and its plain or
sharded optimizer, from `rank_build.py`) and runs a step: forward and backward of the rank's
micro-batches (gradient accumulation, or the pipeline schedule), gradient reduction, global
clipping and the update. The training loop (`trainer.py`) adds data, checkpoints and metrics;
benchmarks drive the same steps.

Shape suffixes: L MoE layers, E experts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from moe_data import trained_targets
from moe_dispatch import TakenTraffic
from moe_parallel import TrainingOptimizer
from moe_plan.config import Config
from moe_train.model import Transformer
from moe_train.model.exchange_worker import ExchangeWorker
from moe_train.model.routing_stats import RoutingStats
from moe_train.parallelize import (
    ContextShard,
    LayerDispatchers,
    apply_exchange_overlap,
    context_shard,
    layer_dispatchers,
)
from moe_train.train.micro_batches import MicroBatches, model_inputs
from moe_train.train.pipeline import PipelineRunner
from moe_train.train.rank_build import (
    DTYPES,
    apply_training_choices,
    build_rank_model,
    build_rank_optimizer,
    stage_plan,
)
from moe_train.train.routing import StepRouting, max_over_mean
from moe_train.train.runtime import Runtime


@dataclass(frozen=True)
class StepStats:
    """A step's losses and routing figures, over every rank and micro-batch."""

    lm_loss: float
    lb_loss: float
    """Unweighted load-balancing loss, mean over micro-batches and MoE layers."""
    z_loss: float
    """Unweighted router z-loss, mean over micro-batches and MoE layers."""
    load_max_over_mean: float
    """Largest over MoE layers of (copies of the busiest expert / mean copies per expert)."""
    dropped_fraction: float
    """Token copies dropped by the capacity limit over copies routed, all layers."""
    expert_copies_LE: torch.Tensor | None = None
    """Copies routed to each expert of each MoE layer over the step (float64, on the
    device), or None without MoE layers; the balancing bias update's input."""
    routing: StepRouting | None = None
    """Per-layer routing counts and balancing scores over the global batch (on the host),
    or None without MoE layers."""
    trained_tokens: int | None = None
    """Target tokens the loss is computed over, the whole global batch (every target
    without data.label_mask; the marked ones with it)."""
    mtp_loss: float | None = None
    """Multi-token-prediction loss (unweighted, mean over micro-batches and MTP modules), or
    None without them (model.mtp_depth: 0)."""
    dispatch_bytes: int | None = None
    """Bytes this rank's forward dispatches sent the other ranks of its expert-parallel group
    (all its MoE layers and micro-batches); None where a dispatcher does not count them."""
    exchange_bytes: int | None = None
    """Bytes all this rank's expert-parallel exchanges sent the other ranks (dispatch and
    combine, forward and backward); None where a dispatcher does not count them."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.lm_loss)


def accumulate_gradients(
    model: Transformer,
    micro_batches: MicroBatches,
    reducer: TrainingOptimizer,
    autocast: Callable[[], contextlib.AbstractContextManager],
    num_micro: int,
    loss_normalizer: torch.Tensor | None = None,
    context: ContextShard | None = None,
) -> torch.Tensor:
    """Forward and backward of each micro-batch; the sum of their LM losses. With their
    documents, attention stays inside each document. With `loss_normalizer`, the
    micro-batches carry a label mask (`moe_data.labels`) and each one's loss is its sum
    over trained targets divided by the normalizer (which context parallelism needs too, the
    rank holding part of each micro-batch's targets). Under context parallelism (`context`,
    the model's shard) each micro-batch gives the model this rank's positions."""
    lm_loss_sum = torch.zeros((), device=micro_batches.tokens.device, dtype=torch.float64)
    for index, (micro, documents) in enumerate(micro_batches):
        if index == len(micro_batches) - 1:
            reducer.arm()  # gradient reductions overlap this last backward
        inputs, targets = model_inputs(micro, loss_normalizer is not None, context)
        with autocast():
            loss = model(
                inputs, targets_BS=targets, documents=documents, loss_normalizer=loss_normalizer
            )
        # Every micro-batch of the step weighs 1/num_micro, on whichever rank it is; the MoE
        # auxiliary losses ride along (see Transformer.set_aux_loss_scale).
        (loss / num_micro).backward()
        lm_loss_sum += loss.detach().double()
    return lm_loss_sum


def take_traffic(model: Transformer) -> TakenTraffic | None:
    """The bytes this rank's MoE layers sent other ranks since the last take, summed over the
    layers (`moe_dispatch.Traffic`), or None where a layer's dispatcher does not count them.
    Reads nothing on the host."""
    total = TakenTraffic((0, 0), None)
    for layer in model.moe_layers().values():
        if layer.dispatcher.traffic is None:
            return None
        total = total.plus(layer.dispatcher.traffic.take())
    return total


def _read_with_traffic(
    model: Transformer, totals: torch.Tensor
) -> tuple[torch.Tensor, dict[str, int | None]]:
    """`totals` on the host, and this rank's traffic since the last take (`take_traffic`) as
    StepStats' `dispatch_bytes` and `exchange_bytes`, read in the same transfer."""
    taken = take_traffic(model)
    if taken is None:
        return totals.cpu(), {"dispatch_bytes": None, "exchange_bytes": None}
    if taken.device_2 is None:
        host, sent_2 = totals.cpu(), taken.host_2
    else:
        both = torch.cat([totals, taken.device_2.to(totals.device, totals.dtype)]).cpu()
        host = both[:-2]
        sent_2 = [h + int(d) for h, d in zip(taken.host_2, both[-2:].tolist(), strict=True)]
    return host, {"dispatch_bytes": int(sent_2[0]), "exchange_bytes": int(sent_2[1])}


def reduce_step_stats(
    model: Transformer, lm_loss_sum: torch.Tensor, num_micro: int, runtime: Runtime
) -> StepStats:
    """Sum losses and routing statistics over all ranks (one all-reduce, one host read),
    with this rank's expert-parallel traffic (read in the same transfer).

    Every rank contributes a row for every MoE layer of the whole model (zeros for layers it
    does not hold), so ranks on different pipeline stages reduce tensors of the same shape.
    This sum over the whole world (every data, expert and pipeline rank) is the one place
    the step's routing counts are reduced: the balancing bias and the global_batch scope's
    routed fractions (`update_balancing_biases`) both read its totals.
    """
    model_config = model.config
    num_experts = model_config.moe.num_experts
    rows = torch.zeros(
        model_config.n_layers,
        RoutingStats.packed_width(num_experts),
        dtype=torch.float64,
        device=lm_loss_sum.device,
    )
    for index, layer in model.moe_layers().items():
        rows[index] = layer.take_stats().pack()
    losses = torch.stack([lm_loss_sum.double(), model.take_mtp_loss().to(lm_loss_sum.device)])
    totals = runtime.sum_over_world(torch.cat([losses, rows.flatten()]))
    first_moe = model_config.dense_layers
    copies_LE = RoutingStats.unpack(totals[2:].view_as(rows)[first_moe:], num_experts)
    host, traffic = _read_with_traffic(model, totals)
    lm_loss = host[0].item() / num_micro
    mtp_loss = host[1].item() / num_micro if model_config.mtp_depth else None
    summed = RoutingStats.unpack(host[2:].view_as(rows)[first_moe:], num_experts)
    num_moe_layers = len(summed.routed_copies)
    if not num_moe_layers:
        return StepStats(lm_loss, 0.0, 0.0, 1.0, 0.0, mtp_loss=mtp_loss, **traffic)
    dropped, routed = summed.dropped_copies.sum().item(), summed.routed_copies.sum().item()
    routing = StepRouting(
        layers=tuple(range(first_moe, model_config.n_layers)),
        load_LE=summed.copies_per_expert.round().long(),
        kept_LE=summed.kept_per_expert.round().long(),
        lb_loss_L=summed.lb_loss_sum / num_micro,
        ep=runtime.layout.ep,
        lb_scope=model_config.moe.lb_scope,
    )
    return StepStats(
        lm_loss=lm_loss,
        lb_loss=summed.lb_loss_sum.sum().item() / (num_micro * num_moe_layers),
        z_loss=summed.z_loss_sum.sum().item() / (num_micro * num_moe_layers),
        load_max_over_mean=max_over_mean(routing.load_LE).max().item(),
        dropped_fraction=dropped / routed if routed else 0.0,
        expert_copies_LE=copies_LE.copies_per_expert,
        routing=routing,
        mtp_loss=mtp_loss,
        **traffic,
    )


def update_balancing_biases(model: Transformer, copies_LE: torch.Tensor | None) -> None:
    """Step each MoE router's balancing bias from its layer's copies per expert over the
    step's global batch, and (lb_scope: global_batch) the routed fractions of its loss."""
    if copies_LE is None:
        return
    for index, layer in model.moe_layers().items():
        copies_E = copies_LE[index - model.config.dense_layers]
        layer.router.update_bias(copies_E)
        layer.router.set_routed_fraction(copies_E)


@dataclass(frozen=True)
class StepResult:
    """What one training step did."""

    stats: StepStats
    grad_norm: float
    """Global gradient norm before clipping."""
    applied: bool
    """False when the step was skipped: the loss or gradient norm was not finite, so the
    weights, optimizer moments and balancing biases were left as they were."""


class StepRunner:
    """The model and optimizer of this rank, and the optimizer step over them.

    Built on every rank at the same point (the optimizer and pipeline stages are collective),
    after `start_runtime` checked the layout (pipeline settings included) on every rank.
    """

    def __init__(
        self,
        config: Config,
        runtime: Runtime,
        eos_id: int | None = None,
        *,
        dispatchers: LayerDispatchers | None = None,
    ) -> None:
        """`eos_id`: the data's end-of-document id, which data.document_masking needs.
        `dispatchers`: the MoE layers' (default: `layer_dispatchers` for the layout)."""
        layout, device = runtime.layout, runtime.device
        data = config.data
        self.config, self.runtime = config, runtime
        self.compute_dtype = DTYPES[config.precision.compute_dtype]
        self.param_dtype = DTYPES[config.precision.param_dtype]
        self.num_micro = runtime.shape.micro_batches
        """Micro-batches of a step, over all dp ranks."""
        self.my_micro = runtime.shape.micro_batches_per_rank
        self.first_micro = layout.batch_rank * self.my_micro
        plan = stage_plan(config, layout)
        self.context = context_shard(layout)
        """This rank's part of each sequence (None without context parallelism)."""
        dispatchers = dispatchers or layer_dispatchers(config, layout.ep_group, device)
        self.dispatch = dispatchers.choice
        """The dispatcher and transport the MoE layers run, and why (banner and manifest)."""
        self.model = build_rank_model(
            config,
            dispatchers,
            plan,
            device,
            self.context,
        )
        self.exchange_worker = self._overlap_exchanges(device)
        """The thread of the MoE layers' token exchanges with parallel.ep_overlap (or None)."""
        self.kernels = apply_training_choices(self.model, config, device)
        """The kernels the expert GEMMs and linears run, and why (banner and manifest)."""
        self.model.set_aux_loss_scale(1.0 / self.num_micro)
        self.optimizer = build_rank_optimizer(self.model, config, layout, self.param_dtype)
        self.pipeline = (
            PipelineRunner(
                self.model,
                plan,
                config,
                layout,
                device,
                self.param_dtype,
                self.autocast,
                self.my_micro,
                self.num_micro,
            )
            if plan
            else None
        )
        grad_clip = config.optim.grad_clip
        self.grad_clip = grad_clip if grad_clip is not None else float("inf")
        self.document_eos_id: int | None = None
        """The id documents end at when attention stays inside them (data.document_masking)."""
        data.validate_end_of_document(eos_id)
        if data.document_masking:
            self.document_eos_id = eos_id

    def _overlap_exchanges(self, device: torch.device) -> ExchangeWorker | None:
        """With parallel.ep_overlap at ep > 1: the thread the MoE layers' exchanges run on
        beside the experts, applied to the model (and said in `dispatch`)."""
        if not (self.config.parallel.ep_overlap and self.runtime.layout.ep > 1):
            return None
        worker = ExchangeWorker(device)
        apply_exchange_overlap(self.model, worker)
        self.dispatch = replace(self.dispatch, overlap=True)
        return worker

    def autocast(self) -> contextlib.AbstractContextManager:
        """The compute-dtype context of forward passes."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.runtime.device.type, dtype=self.compute_dtype)

    @property
    def my_rows(self) -> tuple[int, int]:
        """The rows (start, stop) of a step's global batch that this rank trains on."""
        mbs = self.config.data.micro_batch_size
        return self.first_micro * mbs, (self.first_micro + self.my_micro) * mbs

    def my_micro_batches(self, batch: torch.Tensor) -> MicroBatches:
        """This rank's micro-batches of a step's global batch (on the host), on its device."""
        start, stop = self.my_rows
        return self.as_micro_batches(batch[start:stop])

    def as_micro_batches(self, rows: torch.Tensor) -> MicroBatches:
        """This rank's rows of a global batch ([my_rows' length, seq+1], on the host) as its
        micro-batches on its device, with their documents under data.document_masking."""
        data = self.config.data
        shape = (self.my_micro, data.micro_batch_size, data.seq_len + 1)
        return MicroBatches.of(rows, shape, self.runtime.device, self.document_eos_id)

    def forward_backward(
        self, micro_batches: MicroBatches, loss_normalizer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Gradients of this rank's micro-batches; the sum of their LM losses it computed
        (`loss_normalizer`: see `accumulate_gradients`)."""
        if self.pipeline is not None:
            return self.pipeline.forward_backward(micro_batches, loss_normalizer)
        return accumulate_gradients(
            self.model,
            micro_batches,
            self.optimizer,
            self.autocast,
            self.num_micro,
            loss_normalizer,
            self.context,
        )

    def trained_tokens(self, micro_batches: MicroBatches) -> torch.Tensor:
        """The step's trained target tokens over the whole global batch, from the label mask
        of this rank's `micro_batches` (an int64 tensor on every rank)."""
        count = trained_targets(micro_batches.tokens).reshape(1)
        # One all-reduce of one number: each rank reads only its own rows. The pp ranks of a
        # data-parallel rank and its cp ranks read the same rows, so the world's sum counts
        # them pp x cp times.
        layout = self.runtime.layout
        return self.runtime.sum_over_world(count)[0] // (layout.pp * layout.cp)

    def loss_normalizer(self, trained_tokens: torch.Tensor) -> torch.Tensor:
        """Each micro-batch's share of the step's trained tokens: with its loss the sum over
        its trained targets divided by this, the mean of the micro-batch losses (what the
        step reports and backward weighs) is the mean over the global batch's tokens."""
        return trained_tokens.clamp_min(1).float() / self.num_micro

    def reduce_and_clip(self) -> float:
        """Finish the gradient reduction and clip globally; returns the norm before clipping."""
        self.optimizer.finish()
        return float(self.optimizer.clip_grad_norm_(self.grad_clip))

    def step_stats(self, lm_loss_sum: torch.Tensor) -> StepStats:
        """The step's losses and routing figures over all ranks."""
        return reduce_step_stats(self.model, lm_loss_sum, self.num_micro, self.runtime)

    def apply(self, lr: float, stats: StepStats) -> None:
        """The update: the optimizer step and the balancing biases."""
        self.optimizer.step(lr)
        update_balancing_biases(self.model, stats.expert_copies_LE)

    def train_step(self, batch: torch.Tensor, lr: float) -> StepResult:
        """One step on a global batch (this rank trains on its `my_rows`)."""
        return self.train_on(self.my_micro_batches(batch), lr)

    def train_on(self, micro_batches: MicroBatches, lr: float) -> StepResult:
        """One step, this rank training on `micro_batches` (its share of the global batch).
        A step whose global loss or gradient norm is not finite is skipped: nothing is updated (every rank sees the same global figures, so every rank decides
        the same)."""
        data = self.config.data
        take_traffic(self.model)  # what evaluation sent is not the step's
        if data.label_mask:
            trained = self.trained_tokens(micro_batches)
            lm_loss_sum = self.forward_backward(micro_batches, self.loss_normalizer(trained))
            trained_tokens = int(trained)
        else:
            trained_tokens = data.global_batch_size * data.seq_len
            normalizer = None
            if self.runtime.layout.cp > 1:  # each rank holds part of each micro-batch
                normalizer = self.loss_normalizer(
                    torch.tensor(trained_tokens, device=self.runtime.device)
                )
            lm_loss_sum = self.forward_backward(micro_batches, normalizer)
        grad_norm = self.reduce_and_clip()
        stats = replace(self.step_stats(lm_loss_sum), trained_tokens=trained_tokens)
        applied = stats.finite and math.isfinite(grad_norm)
        if applied:
            self.apply(lr, stats)
        self.optimizer.zero_grad()
        return StepResult(stats, grad_norm, applied)
