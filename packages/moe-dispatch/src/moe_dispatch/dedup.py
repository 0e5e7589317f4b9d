"""DedupAllToAllDispatcher: uneven all_to_all_single that sends a token at most once to each
rank, however many of its experts that rank holds.

Legend: T tokens, K top-k, D width, H expert output width, E experts, L local experts, P
group ranks, F the T * K copies, S rows this rank sends (one per token and destination rank),
R rows it receives, C the copies those rows expand to.

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

from moe_dispatch.all_to_all import ExpertsOverGroup
from moe_dispatch.protocol import DispatchHandle, Routing, check_expert_output, state_of
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


@dataclass(frozen=True)
class _Destinations:
    """Each token's destination ranks as sorted (peer, token) pairs: O(T * K) memory."""

    pair_F: Tensor
    """[T * K] int64, ascending: ``peer * T + token`` per kept copy, ``P * T`` per dropped one."""
    first_F: Tensor
    """[T * K] bool: where each (peer, token) pair first stands (never at a dropped copy)."""
    rows_P: Tensor
    """[P] int64: rows this rank sends each group rank (its tokens with a kept copy there)."""
    num_tokens: int


def _destinations(peer_TK: Tensor, keep_TK: Tensor, ep: int) -> _Destinations:
    """The (peer, token) pairs of the kept copies, sorted, each marked where it first stands;
    no host sync."""
    num_tokens = peer_TK.shape[0]
    token_T1 = torch.arange(num_tokens, device=peer_TK.device).unsqueeze(1)
    dropped = ep * num_tokens  # sorts after every pair
    pair_TK = torch.where(keep_TK, peer_TK * num_tokens + token_T1, dropped)
    pair_F = pair_TK.flatten().sort(stable=True).values  # stable sorts integers by radix on CPU
    first_F = torch.ones_like(pair_F, dtype=torch.bool)
    first_F[1:] = pair_F[1:] != pair_F[:-1]
    first_F &= pair_F != dropped
    # Entry P of the count gathers the dropped copies, none of them first.
    rows_P = torch.zeros(ep + 1, dtype=torch.int64, device=peer_TK.device)
    rows_P.scatter_add_(0, pair_F // max(num_tokens, 1), first_F.to(torch.int64))
    return _Destinations(pair_F, first_F, rows_P[:ep], num_tokens)


def _rows_to_send(destinations: _Destinations, num_rows: int) -> tuple[Tensor, Tensor]:
    """(peer, token) of the rows to send, destination-major then token order, without a
    host sync (``num_rows``, the count of pairs, is known)."""
    first_F, pair_F = destinations.first_F, destinations.pair_F
    # Each pair's row is the count of pairs before it; other entries land past the end.
    row_F = torch.where(first_F, first_F.cumsum(0) - 1, num_rows)
    pair_S = pair_F.new_empty(num_rows + 1).scatter_(0, row_F, pair_F)[:num_rows]
    num_tokens = max(destinations.num_tokens, 1)
    return pair_S // num_tokens, pair_S % num_tokens


def _row_routing(
    expert_TK: Tensor,
    keep_TK: Tensor,
    topk_weight_TK: Tensor,
    peer_S: Tensor,
    token_S: Tensor,
    num_local: int,
) -> tuple[Tensor, Tensor]:
    """Each row's share of its token's routing, [S, K] each: per copy, the local expert on the
    row's peer (``ROUTE_ID_DTYPE``; -1 for a copy elsewhere or dropped) and the routing
    weight (0 there)."""
    local_SK = expert_TK.to(ROUTE_ID_DTYPE)[token_S]
    local_SK -= (peer_S * num_local).unsqueeze(1)
    other_SK = (local_SK < 0) | (local_SK >= num_local) | ~keep_TK[token_S]
    return local_SK.masked_fill_(other_SK, -1), topk_weight_TK[token_S].masked_fill_(other_SK, 0)


class DedupAllToAllDispatcher(ExpertsOverGroup):
    """Experts split over an EP group like ``AllToAllDispatcher`` (group rank r holds experts
    ``[r * E / ep, (r + 1) * E / ep)``), but a token travels once per destination rank.

    Its rows carry K local expert ids (int32) and K routing weights besides the token, so it
    pays where tokens choose several experts on one rank (node-limited routing with groups on
    ranks or nodes); one host sync per layer (split sizes), like all_to_all. Capacity (when
    ``capacity_factor`` is set) drops exactly the copies ``AllToAllDispatcher`` drops; a token
    goes to a rank if any of its kept copies lies there.
    """

    backend = "DedupAllToAllDispatcher"

    def _kept_copies(self, expert_TK: Tensor, routing: Routing) -> tuple[Tensor, Tensor]:
        """[T, K] keep mask (capacity drops; all True when dropless), [E] kept copies."""
        keep_TK, kept_E = routing.keep(self.num_experts, self.capacity_factor)
        if keep_TK is None:
            keep_TK = torch.ones_like(expert_TK, dtype=torch.bool)
        if kept_E is None:
            kept_E = torch.zeros(self.num_experts, dtype=torch.int64, device=expert_TK.device)
            kept_E.scatter_add_(0, expert_TK.reshape(-1), keep_TK.reshape(-1).to(torch.int64))
        return keep_TK, kept_E

    def _exchange_counts(
        self, kept_E: Tensor, rows_P: Tensor
    ) -> tuple[list[int], list[int], Tensor]:
        """Exchange per peer [L] kept copies and 1 row count; returns on the host the rows sent
        and received per peer, and the [L] copies received per local expert."""
        ep, num_local = self.ep, self.num_local_experts
        send_counts = torch.cat([kept_E.view(ep, num_local), rows_P.view(ep, 1)], 1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        self._count_header(send_counts)
        # The one host sync: split sizes and the expert groups' sizes.
        sent, received = send_counts.flatten().tolist(), recv_counts.flatten().tolist()
        width = num_local + 1
        recv_counts_PL = torch.tensor(received, dtype=torch.int64).view(ep, width)[:, :num_local]
        return sent[num_local::width], received[num_local::width], recv_counts_PL.sum(0)

    def _send_rows(
        self, rows_SD: Tensor, local_SK: Tensor, weight_SK: Tensor, splits: tuple[list[int], ...]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Send the rows with their routing; returns what arrived: [R, D] tokens, [R, K] local
        experts (int64), [R, K] weights. ``splits``: rows sent, then received, per peer."""
        send_splits, recv_splits = splits
        exchanged = [
            exchange_rows(
                rows, recv_splits, send_splits, self.group, self.traffic, dispatch=True, wire=wire
            )
            for rows, wire in ((rows_SD, self.wire), (weight_SK, None), (local_SK, None))
        ]
        recv_x_RD, recv_weight_RK, recv_local_RK = exchanged
        return recv_x_RD, recv_local_RK.to(torch.int64), recv_weight_RK

    def _group_by_expert(
        self, recv_x_RD: Tensor, recv_local_RK: Tensor, copies_L: Tensor
    ) -> tuple[Tensor, Permutation, int]:
        """Expand the received rows into one row per local copy, grouped by local expert (the
        other ranks' copies after the groups); returns them, the permutation, and the rows of
        the groups (alignment padding included)."""
        align = self.group_alignment
        expert_rows = int(((copies_L + align - 1) // align * align).sum())
        expert_input_CD, recv_permutation = permute(
            recv_x_RD,
            recv_local_RK.clamp(min=0),
            self.num_local_experts,
            recv_local_RK >= 0,
            align,
            tokens_per_expert_E=copies_L.to(recv_x_RD.device),
        )
        return expert_input_CD, recv_permutation, expert_rows

    def _dispatch(self, x_TD: Tensor, routing: Routing) -> tuple[Tensor, Tensor, DispatchHandle]:
        """Send each token once to each rank holding a kept copy; rows grouped by local
        expert on arrival (one row per copy)."""
        expert_TK = routing.topk_idx_TK.to(torch.int64)
        keep_TK, kept_E = self._kept_copies(expert_TK, routing)
        destinations = _destinations(expert_TK // self.num_local_experts, keep_TK, self.ep)
        send_splits, recv_splits, copies_L = self._exchange_counts(kept_E, destinations.rows_P)
        peer_S, token_S = _rows_to_send(destinations, sum(send_splits))
        local_SK, weight_SK = _row_routing(
            expert_TK, keep_TK, routing.topk_weight_TK, peer_S, token_S, self.num_local_experts
        )
        recv_x_RD, recv_local_RK, recv_weight_RK = self._send_rows(
            x_TD[token_S], local_SK, weight_SK, (send_splits, recv_splits)
        )
        expert_input_CD, recv_permutation, expert_rows = self._group_by_expert(
            recv_x_RD, recv_local_RK, copies_L
        )
        state = _DedupState(
            token_of_row_S=token_S,
            recv_permutation=recv_permutation,
            recv_weight_RK=recv_weight_RK,
            send_splits=send_splits,
            recv_splits=recv_splits,
            expert_rows=expert_rows,
            num_tokens=routing.num_tokens,
        )
        handle = DispatchHandle.from_kept(
            state, kept_E, routing.num_copies, recv_permutation.offsets
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
        y_sent_SH = exchange_rows(
            y_recv_RH, state.send_splits, state.recv_splits, self.group, self.traffic
        )
        y_TH = y_sent_SH.new_zeros(state.num_tokens, y_sent_SH.shape[1])
        return y_TH.index_add(0, state.token_of_row_S, y_sent_SH)
