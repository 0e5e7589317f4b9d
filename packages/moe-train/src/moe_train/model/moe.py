"""The mixture-of-experts feed-forward block: router, SwiGLU experts, dispatch and combine.

Shape suffixes: B batch, S sequence, D model width, T tokens (B x S), K top-k, E experts,
F token copies (T x K), P rows of the experts' input, H expert hidden width, O 2 x H,
G expert groups, X experts per group, C groups chosen per token.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_dispatch import (
    CapacityScope,
    Dispatcher,
    DispatchHandle,
    make_dispatcher,
    position_in_expert,
)
from moe_kernels import fp8_rowwise_grouped_mm, grouped_mm, mxfp8_grouped_mm
from moe_parallel import mark_expert_parameter
from moe_plan.config import MoEConfig
from moe_train.model.exchange_worker import ExchangeWorker
from moe_train.model.fused import swiglu
from moe_train.model.moe_overlap import (
    OVERLAP_CHUNKS,
    RoutedTotals,
    chunks_of,
    overlapped_experts,
)
from moe_train.model.ranges import traced
from moe_train.model.recompute import recording_side_effects
from moe_train.model.routing_stats import RoutingStats
from moe_train.model.sequence_part import WHOLE_SEQUENCES, SequencePart

ExpertGemm = Literal["torch", "triton", "auto", "mxfp8", "fp8_rowwise"]
"""How the experts' grouped GEMMs run: a `moe_kernels.grouped_mm` backend in the compute
dtype (torch, triton, auto), `moe_kernels.mxfp8_grouped_mm` (mxfp8) or
`moe_kernels.fp8_rowwise_grouped_mm` (fp8_rowwise). The trainer's precision.expert_gemm=auto
is resolved to one of these per device first (`resolve_expert_gemm`)."""


def local_dispatcher(moe: MoEConfig) -> Dispatcher:
    """A dispatcher within the process (no expert parallelism), with the config's capacity."""
    return make_dispatcher(
        "local",
        num_experts=moe.num_experts,
        capacity_factor=moe.capacity_factor,
        group_alignment=moe.group_alignment,
        dispatch_dtype=moe.dispatch_dtype,
    )


def compute_dtype_of(x: Tensor) -> torch.dtype:
    """The dtype matmuls should run in: autocast's when it is on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class SwiGLU(nn.Module):
    """Dense SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)
        self.activation: Callable[[Tensor], Tensor] = swiglu
        """silu(gate) * up (a compiled one after `apply_compile`)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.activation(self.gate_up(x)))


@dataclass(frozen=True)
class RouterOutput:
    topk_idx_TK: Tensor
    """Chosen experts per token, int64."""
    topk_weight_TK: Tensor
    """Combine weight of each chosen expert, fp32, differentiable."""
    copies_per_expert: Tensor
    """[E] int64 count of token copies routed to each expert (before any capacity drop):
    counted once here, and handed to the dispatcher."""
    lb_loss: Tensor
    """Load-balancing loss E * sum_e f_e * P_e over the scope `lb_scope` says (unweighted,
    fp32 scalar)."""
    z_loss: Tensor
    """Router z-loss mean(logsumexp(logits)^2) (unweighted, fp32 scalar)."""


def limit_to_groups(selection_TE: Tensor, n_group: int, topk_group: int) -> Tensor:
    """`selection_TE` with the experts outside each token's `topk_group` best groups set to
    -inf: the experts split in order into `n_group` groups, ranked by the sum of their two
    best selection scores."""
    tokens, experts = selection_TE.shape
    grouped_TGX = selection_TE.view(tokens, n_group, experts // n_group)
    group_score_TG = grouped_TGX.topk(2, dim=-1).values.sum(dim=-1)
    chosen_TC = group_score_TG.topk(topk_group, dim=-1).indices
    kept_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, chosen_TC, True)
    return grouped_TGX.masked_fill(~kept_TG[:, :, None], float("-inf")).view(tokens, experts)


class Router(nn.Module):
    """Scores experts per token in fp32 and picks the top k.

    A per-expert bias (auxiliary-loss-free balancing) shifts which experts are selected but
    never the combine weights; `update_bias` moves it against the observed load.
    """

    def __init__(self, d_model: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(d_model, config.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        self.sequence: SequencePart = WHOLE_SEQUENCES
        """The part of each sequence the tokens are: the balancing losses are over the tokens
        of the whole sequences, and with the sequences in parts each part's `lb_loss` and
        `z_loss` are its share of them (they sum to the whole)."""
        if config.lb_scope == "global_batch":
            self.register_buffer(
                "lb_routed_fraction", torch.full((config.num_experts,), 1 / config.num_experts)
            )
            """[E] fraction of the previous step's token copies routed to each expert, over
            its whole global batch (`set_routed_fraction`); even before the first step."""

    def forward(self, x_TD: Tensor, num_sequences: int = 1) -> RouterOutput:
        """Routing of tokens `x_TD`, the rows of `num_sequences` sequences of equal length in
        order (the sequence-wise balancing loss needs them)."""
        config = self.config
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
        if config.router == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
            probs_TE = scores_TE
        else:
            scores_TE = logits_TE.sigmoid()
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)

        if config.random_routing:
            noise_TE = torch.rand(scores_TE.shape, device=scores_TE.device)
            topk_idx_TK = noise_TE.topk(config.top_k, dim=-1).indices
        else:
            selection_TE = scores_TE.detach() + self.expert_bias
            if config.topk_group < config.n_group:
                selection_TE = limit_to_groups(selection_TE, config.n_group, config.topk_group)
            topk_idx_TK = selection_TE.topk(config.top_k, dim=-1).indices
        topk_weight_TK = scores_TE.gather(1, topk_idx_TK)
        if config.normalize_topk:
            topk_weight_TK = topk_weight_TK / topk_weight_TK.sum(dim=-1, keepdim=True)
        if config.routed_scaling_factor != 1.0:
            topk_weight_TK = topk_weight_TK * config.routed_scaling_factor

        expert_of_copy_F = topk_idx_TK.flatten()
        copies_per_expert = torch.zeros(
            config.num_experts, device=x_TD.device, dtype=torch.int64
        ).scatter_add_(0, expert_of_copy_F, torch.ones_like(expert_of_copy_F))
        lb_loss = self.lb_loss(topk_idx_TK, copies_per_expert, probs_TE, num_sequences)
        z_loss = torch.logsumexp(logits_TE, dim=-1).square().mean() / self.sequence.parts
        return RouterOutput(topk_idx_TK, topk_weight_TK, copies_per_expert, lb_loss, z_loss)

    def lb_loss(
        self, topk_idx_TK: Tensor, copies_per_expert: Tensor, probs_TE: Tensor, num_sequences: int
    ) -> Tensor:
        """E * sum_e f_e * P_e over the tokens `model.moe.lb_scope` says (see `MoEConfig`):
        f the fraction of token copies routed to expert e, P its mean probability. With the
        sequences in equal parts (`sequence`), f counts the tokens of every part, and this
        part's P is its share of the mean (the parts' losses sum to it)."""
        config = self.config
        num_experts, parts = config.num_experts, self.sequence.parts
        if config.lb_scope == "global_batch":
            return num_experts * (self.lb_routed_fraction * probs_TE.mean(dim=0) / parts).sum()
        if config.lb_scope == "sequence":
            expert_of_copy_NC = topk_idx_TK.reshape(num_sequences, -1)
            copies_NE = torch.zeros(
                num_sequences, num_experts, device=probs_TE.device, dtype=probs_TE.dtype
            ).scatter_add_(
                1, expert_of_copy_NC, torch.ones_like(expert_of_copy_NC, dtype=probs_TE.dtype)
            )
            copies_NE = self.sequence.sum(copies_NE)
            routed_fraction_NE = copies_NE / (expert_of_copy_NC.shape[1] * parts)
            mean_probs_NE = probs_TE.view(num_sequences, -1, num_experts).mean(dim=1) / parts
            return num_experts * (routed_fraction_NE * mean_probs_NE).sum(dim=1).mean()
        counted_copies = self.sequence.sum(copies_per_expert)
        routed_fraction_E = counted_copies / (probs_TE.shape[0] * parts * config.top_k)
        return num_experts * (routed_fraction_E * probs_TE.mean(dim=0) / parts).sum()

    @torch.no_grad()
    def set_routed_fraction(self, copies_per_expert: Tensor) -> None:
        """With `lb_scope: global_batch`, the routed fractions the balancing loss uses from
        now on: those of `copies_per_expert` (a step's copies over its whole global batch)."""
        total = copies_per_expert.sum()
        if self.config.lb_scope == "global_batch" and total > 0:
            self.lb_routed_fraction.copy_(copies_per_expert.double() / total)

    @torch.no_grad()
    def update_bias(self, copies_per_expert: Tensor) -> None:
        """Raise the bias of under-loaded experts and lower it for over-loaded ones."""
        if self.config.bias_update_rate > 0:
            load = copies_per_expert.float()
            self.expert_bias += self.config.bias_update_rate * torch.sign(load.mean() - load)


class Experts(nn.Module):
    """SwiGLU experts with weights stacked on a leading expert dimension (grouped GEMMs).

    Both grouped GEMMs (gate_up and down) run as `gemm` says (see `ExpertGemm`; set it on a
    built model with `apply_expert_gemm`). With mxfp8, forward, input and weight gradients
    each quantize their operands to MXFP8 from the compute-dtype weights (torchao's kernels on
    SM100, an exact emulation elsewhere); with fp8_rowwise to e4m3 with rowwise scales
    (`torch._scaled_grouped_mm` on SM90, an exact emulation elsewhere).
    """

    def __init__(self, num_experts: int, d_model: int, hidden: int, first_expert: int = 0) -> None:
        super().__init__()
        self.first_expert = first_expert
        """Global index of local expert 0 (experts may be split over ranks)."""
        self.gemm: ExpertGemm = "torch"
        """How the grouped GEMMs run (see `ExpertGemm`)."""
        self.activation: Callable[[Tensor], Tensor] = swiglu
        """silu(gate) * up (a compiled one after `apply_compile`)."""
        # Stored [E, in, out], the layout grouped_mm multiplies by directly: no transposed
        # views, so weight gradients arrive contiguous and accumulate without a strided copy.
        self.w_gate_up_EDO = mark_expert_parameter(
            nn.Parameter(torch.empty(num_experts, d_model, 2 * hidden))
        )
        self.w_down_EHD = mark_expert_parameter(
            nn.Parameter(torch.empty(num_experts, hidden, d_model))
        )

    @property
    def num_experts(self) -> int:
        """Experts this module holds."""
        return self.w_down_EHD.shape[0]

    def keep_experts(self, first_expert: int, num_experts: int) -> None:
        """Hold only the global experts [first_expert, first_expert + num_experts), a block of
        those held now. On the meta device nothing is allocated (apply before materialising:
        see `moe_train.parallelize.apply_expert_parallel`)."""
        start = first_expert - self.first_expert
        if start < 0 or start + num_experts > self.num_experts:
            raise ValueError(
                f"experts [{first_expert}, {first_expert + num_experts}) are not among the "
                f"[{self.first_expert}, {self.first_expert + self.num_experts}) held"
            )
        for name in ("w_gate_up_EDO", "w_down_EHD"):
            kept = getattr(self, name).detach()[start : start + num_experts].clone()
            setattr(self, name, mark_expert_parameter(nn.Parameter(kept)))
        self.first_expert = first_expert

    def forward(
        self, x_PD: Tensor, tokens_per_expert: Tensor, group_ends: Tensor | None = None
    ) -> Tensor:
        """The experts' outputs for rows grouped by expert (`tokens_per_expert` rows each;
        `group_ends`: their int32 cumulative sums, if the dispatcher built them)."""
        dtype = compute_dtype_of(x_PD)
        offsets = group_ends
        if offsets is None:
            offsets = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)
        # A no-op for bf16 parameters; fp32 ones are cast per forward, as autocast does.
        w_gate_up, w_down = self.w_gate_up_EDO.to(dtype), self.w_down_EHD.to(dtype)
        hidden_PH = self.activation(self._grouped_mm(x_PD.to(dtype), w_gate_up, offsets))
        return self._grouped_mm(hidden_PH, w_down, offsets)

    def _grouped_mm(self, x_TK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
        if self.gemm == "mxfp8":
            return mxfp8_grouped_mm(x_TK, w_EKN, offsets_E)
        if self.gemm == "fp8_rowwise":
            return fp8_rowwise_grouped_mm(x_TK, w_EKN, offsets_E)
        return grouped_mm(x_TK, w_EKN, offsets_E, backend=self.gemm)


class AttachAuxLoss(torch.autograd.Function):
    """Returns `y` unchanged; in backward, also sends gradient `scale` into `aux_loss`.

    The auxiliary losses of every MoE layer then reach their gradients through the ordinary
    backward of the model output, wherever the layer runs (any pipeline stage, inside a
    recomputed block), with no loss term the trainer has to gather from the layers.
    """

    @staticmethod
    def forward(ctx, y: Tensor, aux_loss: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_y.device)
        return grad_y, grad_aux, None


class MoEFeedForward(nn.Module):
    """Routed experts (plus optional shared experts, optionally gated) replacing the dense
    feed-forward.

    The weighted auxiliary losses (`moe.lb_loss_weight * lb + moe.z_loss_weight * z`) join
    the backward through `AttachAuxLoss` with gradient `aux_loss_scale`; the latest values are
    left, detached, in `last_lb_loss` and `last_z_loss`. Routing statistics of every training
    forward (not of recomputed ones) are summed into buffers that the trainer reads and
    clears once per optimizer step (`take_stats`).
    """

    def __init__(
        self, d_model: int, config: MoEConfig, dispatcher: Dispatcher | None = None
    ) -> None:
        """`dispatcher`: a local one with the config's capacity by default; another (with
        expert parallelism) keeps only its rank's experts, as `use_dispatcher` does."""
        super().__init__()
        self.config = config
        self.router = Router(d_model, config)
        self.experts = Experts(config.num_experts, d_model, config.expert_hidden)
        self.dispatcher: Dispatcher
        self.use_dispatcher(dispatcher or local_dispatcher(config))
        self.shared = (
            SwiGLU(d_model, config.shared_experts * config.expert_hidden)
            if config.shared_experts
            else None
        )
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if config.shared_expert_gate else None
        """Gates the shared experts' output per token by sigmoid(shared_gate(x)) (or None)."""
        self.aux_loss_scale = 1.0
        """Gradient of the training objective with respect to this layer's weighted aux loss."""
        for name, shape, dtype in (
            ("step_copies_per_expert", (config.num_experts,), torch.int64),
            ("step_kept_per_expert", (config.num_experts,), torch.int64),
            ("step_dropped_copies", (), torch.float64),
            ("step_routed_copies", (), torch.float64),
            ("step_lb_loss", (), torch.float64),
            ("step_z_loss", (), torch.float64),
        ):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype), persistent=False)
        self.last_lb_loss: Tensor | None = None
        self.last_z_loss: Tensor | None = None
        self.exchange_worker: ExchangeWorker | None = None
        """Where the exchanges of two chunks of tokens run while the experts compute the other
        chunk (parallel.ep_overlap, `moe_train.parallelize.apply_exchange_overlap`); None:
        one dispatch, the experts, one combine."""
        self.exchange_chunks = OVERLAP_CHUNKS
        """Chunks of the overlapped layer."""

    def use_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Dispatch with `dispatcher`, holding only its rank's experts (`Experts.keep_experts`)."""
        if dispatcher.num_experts != self.config.num_experts:
            raise ValueError(
                f"the dispatcher routes over {dispatcher.num_experts} experts, the layer has "
                f"{self.config.num_experts}"
            )
        self.dispatcher = dispatcher
        if (dispatcher.first_local_expert, dispatcher.num_local_experts) != (
            self.experts.first_expert,
            self.experts.num_experts,
        ):
            self.experts.keep_experts(dispatcher.first_local_expert, dispatcher.num_local_experts)

    def forward(self, x_BSD: Tensor) -> Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        device = x_TD.device
        with traced("moe.route", device):
            routed = self.router(x_TD, num_sequences=x_BSD.shape[0])
        # Tokens travel in the compute dtype: half the bytes to permute and exchange.
        # The output stays in it, as a dense feed-forward under autocast returns it: the
        # residual add promotes it, so a separate cast pass (and its backward) is saved.
        y_TD, handle = self._routed_experts(x_TD.to(compute_dtype_of(x_TD)), routed, x_BSD.shape[0])
        if self.shared is not None:
            with traced("moe.shared_experts", device):
                shared_TD = self.shared(x_TD)
                if self.shared_gate is not None:
                    shared_TD = torch.sigmoid(self.shared_gate(x_TD)) * shared_TD
            y_TD = y_TD + shared_TD
        aux_loss = (
            self.config.lb_loss_weight * routed.lb_loss + self.config.z_loss_weight * routed.z_loss
        )
        if aux_loss.requires_grad:
            y_TD = AttachAuxLoss.apply(y_TD, aux_loss, self.aux_loss_scale)
        self.last_lb_loss, self.last_z_loss = routed.lb_loss.detach(), routed.z_loss.detach()
        if self.training and recording_side_effects():
            with torch.no_grad():
                self.step_copies_per_expert += routed.copies_per_expert
                self.step_kept_per_expert += handle.kept_per_expert
                self.step_dropped_copies += handle.dropped_copies
                self.step_routed_copies += handle.num_copies
                self.step_lb_loss += routed.lb_loss.detach().double()
                self.step_z_loss += routed.z_loss.detach().double()
        return y_TD.view_as(x_BSD)

    def _routed_experts(
        self, x_TD: Tensor, routed: RouterOutput, batch: int
    ) -> tuple[Tensor, DispatchHandle | RoutedTotals]:
        """The routed experts' output for `x_TD` and the routing statistics: dispatch, experts
        and combine in one call, or overlapped in chunks on `exchange_worker`."""
        device = x_TD.device
        scope = self.capacity_scope(routed.topk_idx_TK, batch)
        if self.exchange_worker is not None:
            chunks, summed = chunks_of(
                self.dispatcher,
                routed.topk_idx_TK,
                routed.topk_weight_TK,
                scope,
                self.config.capacity_factor,
                self.config.num_experts,
                self.exchange_chunks,
            )
            return overlapped_experts(
                self.dispatcher, self.experts, self.exchange_worker, x_TD, chunks, summed
            )
        with traced("moe.dispatch", device):
            expert_input, tokens_per_expert, handle = self.dispatcher.dispatch(
                x_TD, routed.topk_idx_TK, routed.topk_weight_TK, routed.copies_per_expert, scope
            )
        with traced("moe.experts", device):
            expert_output = self.experts(expert_input, tokens_per_expert, handle.group_ends)
        with traced("moe.combine", device):
            return self.dispatcher.combine(expert_output, handle), handle

    @torch.no_grad()
    def capacity_scope(self, topk_idx_TK: Tensor, batch: int) -> CapacityScope | None:
        """With a capacity and the sequences in parts (context parallelism), capacity counted
        over the whole sequences as one process holding them counts it: each copy's place
        among its expert's copies in their token order (one gather of the routing); else
        None (the dispatcher counts this call's copies)."""
        sequence = self.router.sequence
        if self.config.capacity_factor is None or sequence.parts == 1:
            return None
        top_k = topk_idx_TK.shape[1]
        whole_BSK = sequence.whole(topk_idx_TK.view(batch, -1, top_k).long())
        position_F = position_in_expert(whole_BSK.reshape(-1), self.config.num_experts)
        positions_BLK = sequence.held(position_F.view_as(whole_BSK))
        return CapacityScope(
            positions_BLK.reshape(-1, top_k), whole_BSK.shape[0] * whole_BSK.shape[1]
        )

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero balancing bias and routing statistics; even routed fractions (global_batch)."""
        self.router.expert_bias.zero_()
        if self.config.lb_scope == "global_batch":
            self.router.lb_routed_fraction.fill_(1 / self.config.num_experts)
        self.take_stats()

    @torch.no_grad()
    def take_stats(self) -> RoutingStats:
        """The statistics since the last call; clears them."""
        buffers = (
            self.step_copies_per_expert,
            self.step_kept_per_expert,
            self.step_dropped_copies,
            self.step_routed_copies,
            self.step_lb_loss,
            self.step_z_loss,
        )
        stats = RoutingStats(*(b.clone() for b in buffers))
        for b in buffers:
            b.zero_()
        return stats
