"""DedupAllToAllDispatcher: uneven all_to_all_single that sends a token at most once to each
rank, however many of its experts that rank holds.

Legend: T tokens, K top-k, D width, H expert output width, E experts, L local experts, P
group ranks, S rows this rank sends (one per token and destination rank), R rows it
receives, C the copies those rows expand to.

Dispatch: a source sends each token once to every rank that holds one of its kept copies,
and with the row that rank's share of its routing: per copy, the local expert (-1 for a copy
elsewhere) and the routing weight (0 there). The destination expands each row into one copy
per chosen local expert, grouped by expert. Combine: the destination sums each row's copies
with their weights and sends one row back; the source adds its token's rows. So a token
crosses to another rank at most once each way, where the per-copy all_to_all sends it once
per copy there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moe_dispatch.all_to_all import check_expert_parallel_args
from moe_dispatch.capacity import capacity_per_expert, check_capacity_factor, keep_within_capacity
from moe_dispatch.protocol import DispatchHandle, check_expert_output, check_routing, state_of
from moe_dispatch.transport_a2a import exchange_rows
from moe_kernels import Permutation, permute, unpermute

__all__ = ["ROUTE_ID_DTYPE", "DedupAllToAllDispatcher"]

ROUTE_ID_DTYPE = torch.int32
"""Dtype of the local expert ids each sent row carries (K per row)."""


@dataclass(frozen=True)
class _DedupState:
    token_of_row_S: Tensor
    """[S] int64: the token each sent row holds (rows ordered by destination, then token)."""
    recv_permutation: Permutation
    """Destination side: received rows' copies into local-expert groups (others dropped)."""
    recv_weight_RK: Tensor
    """Routing weight of each received row's copies (0 where the copy is elsewhere)."""
    send_splits: list[int]
    recv_splits: list[int]
    expert_rows: int
    """Rows of the expert input: the local experts' groups, alignment padding included."""
    num_tokens: int


def _rows_to_send(on_peer_PTK: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """(peer, token) of the rows to send, destination-major then token order, without a
    host sync (``num_rows``, the count of (peer, token) pairs with a copy, is known)."""
    num_tokens = on_peer_PTK.shape[1]
    send_F = on_peer_PTK.any(2).reshape(-1)
    order = torch.argsort(send_F.logical_not().to(torch.uint8), stable=True)[:num_rows]
    return order // max(num_tokens, 1), order % max(num_tokens, 1)


class DedupAllToAllDispatcher:
    """Experts split over an EP group like ``AllToAllDispatcher`` (group rank r holds experts
    ``[r * E / ep, (r + 1) * E / ep)``), but a token travels once per destination rank.

    Its rows carry K local expert ids (int32) and K routing weights besides the token, so it
    pays where tokens choose several experts on one rank (node-limited routing with groups on
    ranks or nodes); one host sync per layer (split sizes), like all_to_all. Capacity (when
    ``capacity_factor`` is set) drops exactly the copies ``AllToAllDispatcher`` drops; a token
    goes to a rank if any of its kept copies lies there.
    """

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup,
        capacity_factor: float | None = None,
        group_alignment: int = 1,
    ) -> None:
        ep = check_expert_parallel_args(
            "DedupAllToAllDispatcher", num_experts, group, group_alignment
        )
        check_capacity_factor("DedupAllToAllDispatcher", capacity_factor)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.group = group
        self.ep = ep
        self.first_local_expert = dist.get_rank(group) * self.num_local_experts
        self.capacity_factor = capacity_factor
        self.group_alignment = group_alignment

    def capacity(self, num_tokens: int, top_k: int) -> int | None:
        """Copies one source rank may send each expert; None if dropless."""
        return capacity_per_expert(self.capacity_factor, num_tokens, top_k, self.num_experts)

    def _exchange_counts(self, kept_E: Tensor, rows_P: Tensor) -> tuple[list[int], list[int]]:
        """Per peer: [L] kept copies and 1 row count, sent and received; on the host."""
        ep, num_local = self.ep, self.num_local_experts
        send_counts = torch.cat([kept_E.view(ep, num_local), rows_P.view(ep, 1)], 1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        # The one host sync: split sizes and the expert groups' sizes.
        return send_counts.flatten().tolist(), recv_counts.flatten().tolist()

    def dispatch(
        self,
        x_TD: Tensor,
        topk_idx_TK: Tensor,
        topk_weight_TK: Tensor,
        copies_per_expert: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        """Send each token once to each rank holding a kept copy; rows grouped by local
        expert on arrival (one row per copy)."""
        num_tokens, _ = check_routing("DedupAllToAllDispatcher", topk_idx_TK, topk_weight_TK)
        ep, num_local, device = self.ep, self.num_local_experts, x_TD.device
        expert_TK = topk_idx_TK.to(torch.int64)
        keep_TK, kept_E = keep_within_capacity(
            expert_TK, self.num_experts, self.capacity_factor, copies_per_expert
        )
        if keep_TK is None:
            keep_TK = torch.ones_like(expert_TK, dtype=torch.bool)
        if kept_E is None:
            kept_E = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
            kept_E.scatter_add_(0, expert_TK.reshape(-1), keep_TK.reshape(-1).to(torch.int64))
        peers_P11 = torch.arange(ep, device=device).view(ep, 1, 1)
        on_peer_PTK = ((expert_TK // num_local).unsqueeze(0) == peers_P11) & keep_TK
        sent, received = self._exchange_counts(kept_E, on_peer_PTK.any(2).sum(1))
        width = num_local + 1
        send_splits, recv_splits = sent[num_local::width], received[num_local::width]
        peer_S, token_S = _rows_to_send(on_peer_PTK, sum(send_splits))

        mine_SK = on_peer_PTK[peer_S, token_S]
        local_SK = torch.where(mine_SK, expert_TK[token_S] - (peer_S * num_local).unsqueeze(1), -1)
        weight_SK = torch.where(mine_SK, topk_weight_TK[token_S], 0)
        recv_x_RD = exchange_rows(x_TD[token_S], recv_splits, send_splits, self.group)
        recv_weight_RK = exchange_rows(weight_SK, recv_splits, send_splits, self.group)
        recv_local_RK = exchange_rows(
            local_SK.to(ROUTE_ID_DTYPE), recv_splits, send_splits, self.group
        ).to(torch.int64)

        recv_counts_PL = torch.tensor(received, dtype=torch.int64).view(ep, width)[:, :num_local]
        copies_L = recv_counts_PL.sum(0)
        align = self.group_alignment
        expert_rows = int(((copies_L + align - 1) // align * align).sum())
        expert_input_CD, recv_permutation = permute(
            recv_x_RD,
            recv_local_RK.clamp(min=0),
            num_local,
            recv_local_RK >= 0,
            align,
            tokens_per_expert_E=copies_L.to(device),
        )
        num_copies = topk_idx_TK.numel()
        handle = DispatchHandle(
            state=_DedupState(
                token_of_row_S=token_S,
                recv_permutation=recv_permutation,
                recv_weight_RK=recv_weight_RK,
                send_splits=send_splits,
                recv_splits=recv_splits,
                expert_rows=expert_rows,
                num_tokens=num_tokens,
            ),
            dropped_copies=num_copies - kept_E.sum(),
            num_copies=num_copies,
            kept_per_expert=kept_E,
            group_ends=recv_permutation.offsets,
        )
        # The copies of other ranks' experts sat after the groups: not handed to the experts.
        return expert_input_CD[:expert_rows], recv_permutation.rows_per_expert, handle

    def combine(self, expert_output: Tensor, handle: DispatchHandle) -> Tensor:
        """Sum each received row's copies with their weights, return one row per token and
        rank, add them per token: [T, H]."""
        state = state_of(handle, _DedupState, "DedupAllToAllDispatcher")
        check_expert_output("DedupAllToAllDispatcher", expert_output, state.expert_rows)
        # Zero rows stand in for the copies that were not this rank's (never read).
        num_rows = state.recv_permutation.source_token.shape[0]
        padded_CH = F.pad(expert_output, (0, 0, 0, num_rows - state.expert_rows))
        y_recv_RH = unpermute(padded_CH, state.recv_permutation, state.recv_weight_RK)
        y_sent_SH = exchange_rows(y_recv_RH, state.send_splits, state.recv_splits, self.group)
        y_TH = y_sent_SH.new_zeros(state.num_tokens, y_sent_SH.shape[1])
        return y_TH.index_add(0, state.token_of_row_S, y_sent_SH)
