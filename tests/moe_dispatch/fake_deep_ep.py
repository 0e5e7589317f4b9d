"""A CPU stand-in for the part of DeepEP (``deep_ep``) that ``moe_dispatch.deepep`` calls.

Install it as ``sys.modules["deep_ep"]`` in a process of a gloo group. It follows DeepEP V2's
``ElasticBuffer`` as read in DeepEP's source at commit
dd758caf451848bd150e1046af3d0a73e5fff38d (``deep_ep/buffers/elastic.py``,
``csrc/elastic/buffer.hpp``, ``deep_ep/include/deep_ep/impls/dispatch_copy_epilogue.cuh`` and
``combine_reduce_epilogue.cuh``), in the non-expanded layout, built on ``all_to_all_single``:

- ``dispatch(x, topk_idx=, topk_weights=, num_experts=)`` returns ``(recv_x, recv_topk_idx,
  recv_topk_weights, handle, event)``. A token goes once to each rank holding one of its
  experts, with its whole top-k row; ``recv_topk_idx`` holds local expert ids and -1 for
  experts elsewhere; ``recv_topk_weights`` are not masked (None without ``topk_weights``).
  With ``handle=`` (cached) the same routing moves new rows.
- ``combine(x, handle, topk_weights=)`` returns ``(combined_x, combined_topk_weights, event)``:
  each token's rows summed over the ranks it went to, unweighted, accumulated in fp32 and
  rounded to bf16; ``combined_topk_weights[t, k]`` comes from the rank of expert
  ``topk_idx[t, k]`` (0 where it is -1).
- DeepEP's checks: ``x`` bf16, 2-D, contiguous, rows a multiple of 16 bytes; ``topk_idx`` of
  ``topk_idx_t`` (int64), ``topk_weights`` float32, both contiguous and [T, K]; at most
  ``num_max_tokens_per_rank`` tokens; K <= 32; distinct experts per token (a device trap in
  DeepEP, a RuntimeError here); a cached dispatch matches its handle's settings, and needs
  ``num_sms`` or ``num_experts`` (with neither, DeepEP estimates its SM count from
  ``num_experts=None`` and fails with a TypeError; so does the fake).

Differences, on purpose: the buffer-size check compares the MoE settings the buffer was built
for (tokens, hidden, top-k) instead of bytes; every dispatch and combine also checks that all
ranks pass the same ``num_max_tokens_per_rank``, ``num_experts``, width and top-k (DeepEP
needs this but cannot check it); rows arrive by source rank, then token (DeepEP's order with
``deterministic=True``; without it the order within a source varies). Not modelled (they
raise NotImplementedError): FP8 input, the expanded layout, ``do_cpu_sync=False`` without a
handle, ``bias``, ``cumulative_local_expert_recv_stats``, ``num_bytes`` / ``num_cpu_bytes``,
hybrid (multi-node) mode; streams and events do nothing on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["EPHandle", "ElasticBuffer", "EventOverlap", "built_buffers", "topk_idx_t"]

topk_idx_t = torch.int64
"""DeepEP's top-k index dtype (``EP_NUM_TOPK_IDX_BITS`` defaults to 64)."""

MAX_TOP_K = 32
ROW_BYTES_MULTIPLE = 16
THEORETICAL_NUM_SMS = 4
"""The fake's answer where DeepEP estimates an SM count (DeepEP: even, at least 4)."""

built_buffers: list[ElasticBuffer] = []
"""Every ElasticBuffer this process built, in order (for tests of buffer reuse)."""


def _require(condition: bool, message: str) -> None:
    """DeepEP's host assertions (EP_HOST_ASSERT) raise; so does the fake."""
    if not condition:
        raise RuntimeError(f"fake deep_ep: {message}")


def _require_int(value: Any, what: str) -> None:
    """Where DeepEP does arithmetic on an argument, None fails with a TypeError."""
    if not isinstance(value, int):
        raise TypeError(f"fake deep_ep: {what} must be an int, got {value!r}")


def _check_torch_deterministic() -> None:
    """DeepEP refuses deterministic algorithms together with filling uninitialised memory."""
    _require(
        not (
            torch.are_deterministic_algorithms_enabled()
            and torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
        ),
        "torch deterministic algorithms with fill_uninitialized_memory are not supported",
    )


def _not_modelled(what: str) -> NotImplementedError:
    return NotImplementedError(f"fake deep_ep: {what} is not modelled")


class EventOverlap:
    """DeepEP's event wrapper; on the CPU every operation has finished when it returns."""

    def __init__(self, event: Any = None, extra_tensors: tuple[Tensor, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Nothing to wait for."""


@dataclass(frozen=True)
class _Route:
    """Where this rank's tokens went (the fake's stand-in for DeepEP's buffer slots)."""

    send_token_S: Tensor
    """[S] int64: the token of each sent row, by destination rank, then token."""
    send_rank_S: Tensor
    """[S] int64: the destination rank of each sent row."""
    send_splits: list[int]
    """Rows sent to each rank."""
    recv_splits: list[int]
    """Rows received from each rank."""
    dest_rank_TK: Tensor
    """[T, K] int64: the rank of expert topk_idx[t, k], -1 where it is -1."""


class EPHandle:
    """DeepEP's dispatch handle: the same constructor and attributes, plus the fake's route."""

    def __init__(
        self,
        do_expand: bool,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        topk_idx: Tensor,
        num_recv_tokens: int,
        num_expanded_tokens: int,
        num_recv_tokens_per_expert_list: list,
        psum_num_recv_tokens_per_scaleup_rank: Tensor,
        psum_num_recv_tokens_per_expert: Tensor,
        num_unaligned_recv_tokens_per_expert: Tensor,
        recv_src_metadata: Tensor,
        dst_buffer_slot_idx: Tensor,
        token_metadata_at_forward: Tensor | None,
        channel_linked_list: Tensor | None,
    ) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.fake_route: _Route | None = None
        """The fake's record of where the rows went (set by the fake's dispatch)."""


def _exchange(rows: Tensor, recv_splits: list[int], send_splits: list[int], group) -> Tensor:
    """``send_splits[p]`` consecutive rows to rank p; ``recv_splits[p]`` rows from rank p."""
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


def _value_or(value: Any, default: Any) -> Any:
    return default if value is None else value


class ElasticBuffer:
    """DeepEP V2's communication buffer, for one node (no scale-out) on gloo."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ) -> None:
        if num_bytes is not None or num_cpu_bytes:
            raise _not_modelled("sizing the buffer in bytes (num_bytes, num_cpu_bytes)")
        if use_fp8_dispatch:
            raise _not_modelled("FP8 dispatch")
        _require(
            num_max_tokens_per_rank > 0 and hidden > 0,
            f"the buffer needs num_max_tokens_per_rank > 0 and hidden > 0, got "
            f"{num_max_tokens_per_rank} and {hidden}",
        )
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.deterministic = deterministic
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        """Fake only: the widest bf16 rows the buffer holds."""
        self.num_topk = num_topk if num_topk > 0 else MAX_TOP_K
        """Fake only: the largest top-k the buffer holds (DeepEP assumes 32 when given 0)."""
        built_buffers.append(self)

    # Checks -----------------------------------------------------------------------------

    def _check_rows(self, x: Tensor, caller: str) -> None:
        _require(x.dim() == 2, f"{caller}: x must be 2-D, got shape {tuple(x.shape)}")
        _require(x.dtype == torch.bfloat16, f"{caller}: x must be bfloat16, got {x.dtype}")
        _require(x.is_contiguous(), f"{caller}: x must be contiguous")
        _require(
            x.shape[1] * x.element_size() % ROW_BYTES_MULTIPLE == 0,
            f"{caller}: rows of {x.shape[1]} x {x.element_size()} bytes are not a multiple of "
            f"{ROW_BYTES_MULTIPLE} bytes",
        )

    def _check_fits(self, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> None:
        _require(
            num_max_tokens_per_rank <= self.num_max_tokens_per_rank
            and hidden <= self.hidden
            and num_topk <= self.num_topk,
            f"buffer too small: built for (tokens {self.num_max_tokens_per_rank}, hidden "
            f"{self.hidden}, top-k {self.num_topk}), asked for ({num_max_tokens_per_rank}, "
            f"{hidden}, {num_topk})",
        )

    def _check_same_on_every_rank(self, caller: str, **settings: int) -> None:
        mine = torch.tensor(list(settings.values()), dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.num_ranks)]
        dist.all_gather(everyone, mine, group=self.group)
        if any(not torch.equal(theirs, mine) for theirs in everyone):
            per_rank = {name: [int(t[i]) for t in everyone] for i, name in enumerate(settings)}
            raise RuntimeError(f"fake deep_ep: {caller} settings differ between ranks: {per_rank}")

    @staticmethod
    def _check_topk(
        topk_idx: Tensor, topk_weights: Tensor | None, num_tokens: int, num_experts: int
    ) -> None:
        _require(
            topk_idx.dim() == 2 and topk_idx.shape[0] == num_tokens,
            f"topk_idx must be [{num_tokens}, K], got {tuple(topk_idx.shape)}",
        )
        _require(
            topk_idx.dtype == topk_idx_t, f"topk_idx must be {topk_idx_t}, got {topk_idx.dtype}"
        )
        _require(topk_idx.is_contiguous(), "topk_idx must be contiguous")
        _require(topk_idx.shape[1] <= MAX_TOP_K, f"top-k {topk_idx.shape[1]} exceeds {MAX_TOP_K}")
        _require(
            bool(((topk_idx >= -1) & (topk_idx < num_experts)).all()),
            f"topk_idx must hold experts in [0, {num_experts}) or -1",
        )
        sorted_TK = topk_idx.sort(dim=1).values
        repeated = (sorted_TK[:, 1:] == sorted_TK[:, :-1]) & (sorted_TK[:, 1:] >= 0)
        _require(
            not bool(repeated.any()),
            "a token selects the same expert twice (DeepEP traps on the device)",
        )
        if topk_weights is not None:
            _require(
                topk_weights.shape == topk_idx.shape,
                f"topk_weights must be {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}",
            )
            _require(
                topk_weights.dtype == torch.float32,
                f"topk_weights must be float32, got {topk_weights.dtype}",
            )
            _require(topk_weights.is_contiguous(), "topk_weights must be contiguous")

    # Dispatch and combine ---------------------------------------------------------------

    def _route(self, topk_idx: Tensor, num_experts: int) -> _Route:
        experts_per_rank = num_experts // self.num_ranks
        dest_rank_TK = torch.where(topk_idx >= 0, topk_idx // experts_per_rank, -1)
        ranks_R11 = torch.arange(self.num_ranks).view(-1, 1, 1)
        goes_to_RT = (dest_rank_TK.unsqueeze(0) == ranks_R11).any(dim=2)
        send_rank_S, send_token_S = goes_to_RT.nonzero(as_tuple=True)  # by rank, then token
        send_counts = goes_to_RT.sum(dim=1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        return _Route(
            send_token_S, send_rank_S, send_counts.tolist(), recv_counts.tolist(), dest_rank_TK
        )

    def _new_handle(
        self,
        route: _Route,
        topk_idx: Tensor,
        recv_local_idx_RK: Tensor,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
    ) -> EPHandle:
        num_tokens, num_topk = topk_idx.shape
        num_local_experts = num_experts // self.num_ranks
        counts = [int((recv_local_idx_RK == e).sum()) for e in range(num_local_experts)]
        aligned = [-(-count // expert_alignment) * expert_alignment for count in counts]
        # Source token "global" ids and master top-k lanes, as DeepEP's recv_src_metadata.
        master_k_S = (route.dest_rank_TK[route.send_token_S] == route.send_rank_S[:, None]).int()
        source_S2 = torch.stack(
            [
                self.rank_idx * num_max_tokens_per_rank + route.send_token_S,
                self.rank_idx * num_topk + master_k_S.argmax(dim=1),
            ],
            dim=1,
        )
        recv_source_R2 = _exchange(source_S2, route.recv_splits, route.send_splits, self.group)
        recv_src_metadata = torch.full((recv_source_R2.shape[0], num_topk + 2), -1)
        recv_src_metadata[:, :2] = recv_source_R2
        # Each copy's position among the tokens sent to its rank (DeepEP: its buffer slot).
        first_row_R = torch.tensor([0, *route.send_splits[:-1]]).cumsum(0)
        position_S = torch.arange(route.send_token_S.shape[0]) - first_row_R[route.send_rank_S]
        position_RT = torch.full((self.num_ranks, num_tokens), -1, dtype=torch.int64)
        position_RT[route.send_rank_S, route.send_token_S] = position_S
        tokens_T1 = torch.arange(num_tokens).unsqueeze(1)
        slot_TK = position_RT[route.dest_rank_TK.clamp(min=0), tokens_T1]
        slot_TK = torch.where(route.dest_rank_TK >= 0, slot_TK, -1)
        handle = EPHandle(
            do_expand=False,
            num_experts=num_experts,
            expert_alignment=expert_alignment,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_sms=num_sms,
            topk_idx=topk_idx,
            num_recv_tokens=sum(route.recv_splits),
            num_expanded_tokens=sum(aligned),
            num_recv_tokens_per_expert_list=aligned,
            psum_num_recv_tokens_per_scaleup_rank=torch.tensor(route.recv_splits).cumsum(0).int(),
            psum_num_recv_tokens_per_expert=torch.tensor(aligned, dtype=torch.int64)
            .cumsum(0)
            .int(),
            num_unaligned_recv_tokens_per_expert=torch.tensor(counts, dtype=torch.int32),
            recv_src_metadata=recv_src_metadata.int(),
            dst_buffer_slot_idx=slot_TK.int(),
            token_metadata_at_forward=None,
            channel_linked_list=None,
        )
        handle.fake_route = route
        return handle

    def dispatch(
        self,
        x: Tensor | tuple[Tensor, Tensor],
        topk_idx: Tensor | None = None,
        topk_weights: Tensor | None = None,
        cumulative_local_expert_recv_stats: Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Any = None,
        previous_event_before_epilogue: Any = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None, EPHandle, EventOverlap]:
        """Send each token to every rank that holds one of its experts (see module doc)."""
        _check_torch_deterministic()
        if num_sms == 0:
            # DeepEP estimates the SM count from num_experts before it looks at the handle.
            _require_int(num_experts, "num_experts (num_sms=0 estimates SMs from it)")
            num_sms = THEORETICAL_NUM_SMS
        if isinstance(x, tuple):
            raise _not_modelled("FP8 dispatch (x as a (data, scales) tuple)")
        if do_expand or do_zero_padding or use_tma_aligned_col_major_sf:
            raise _not_modelled("the expanded layout")
        if cumulative_local_expert_recv_stats is not None:
            raise _not_modelled("cumulative_local_expert_recv_stats")
        cached = handle is not None
        if handle is not None:
            _require(topk_idx is None, "a cached dispatch takes topk_idx from its handle")
            _require(not do_cpu_sync, "Cannot do CPU sync with cached handle")
            _require(
                handle.fake_route is not None, "the handle does not come from the fake's dispatch"
            )
            topk_idx = handle.topk_idx
            num_experts = _value_or(num_experts, handle.num_experts)
            expert_alignment = _value_or(expert_alignment, handle.expert_alignment)
            num_max_tokens_per_rank = _value_or(
                num_max_tokens_per_rank, handle.num_max_tokens_per_rank
            )
            _require(
                (num_experts, expert_alignment, num_max_tokens_per_rank)
                == (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank),
                "a cached dispatch must keep its handle's settings",
            )
        else:
            _require(topk_idx is not None, "dispatch needs topk_idx (or a cached handle)")
            _require(num_experts is not None, "dispatch needs num_experts (or a cached handle)")
            if do_cpu_sync is not None and not do_cpu_sync:
                raise _not_modelled("do_cpu_sync=False (worst-case sized outputs)")
        assert topk_idx is not None and num_experts is not None
        num_max_tokens_per_rank = _value_or(num_max_tokens_per_rank, self.num_max_tokens_per_rank)
        expert_alignment = _value_or(expert_alignment, 1)

        self._check_rows(x, "dispatch")
        num_tokens, hidden = x.shape
        _require(
            num_tokens <= num_max_tokens_per_rank,
            f"{num_tokens} tokens exceed num_max_tokens_per_rank={num_max_tokens_per_rank}",
        )
        _require(
            num_experts % self.num_ranks == 0,
            f"num_experts={num_experts} is not a multiple of {self.num_ranks} ranks",
        )
        self._check_topk(topk_idx, topk_weights, num_tokens, num_experts)
        num_topk = topk_idx.shape[1]
        self._check_fits(num_max_tokens_per_rank, hidden, num_topk)
        self._check_same_on_every_rank(
            "dispatch",
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_experts=num_experts,
            hidden=hidden,
            num_topk=num_topk,
            cached=int(cached),
        )

        route = handle.fake_route if handle is not None else self._route(topk_idx, num_experts)
        assert route is not None

        def send(rows_TX: Tensor) -> Tensor:
            return _exchange(
                rows_TX[route.send_token_S], route.recv_splits, route.send_splits, self.group
            )

        recv_x = send(x)
        experts_per_rank = num_experts // self.num_ranks
        first_expert = self.rank_idx * experts_per_rank
        recv_topk_idx = send(topk_idx)
        on_this_rank = (recv_topk_idx >= first_expert) & (
            recv_topk_idx < first_expert + experts_per_rank
        )
        recv_topk_idx = torch.where(on_this_rank, recv_topk_idx - first_expert, -1)
        recv_topk_weights = None if topk_weights is None else send(topk_weights)

        if handle is None:
            handle_topk_idx = topk_idx.clone() if do_handle_copy else topk_idx
            handle = self._new_handle(
                route,
                handle_topk_idx,
                recv_topk_idx,
                num_experts,
                expert_alignment,
                num_max_tokens_per_rank,
                num_sms,
            )
        return recv_x, recv_topk_idx, recv_topk_weights, handle, EventOverlap()

    def combine(
        self,
        x: Tensor,
        handle: EPHandle,
        topk_weights: Tensor | None = None,
        bias: Tensor | tuple[Tensor, Tensor] | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Any = None,
        previous_event_before_epilogue: Any = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Tensor, Tensor | None, EventOverlap]:
        """Sum each token's rows over the ranks it went to, back on its own rank."""
        _check_torch_deterministic()
        if bias is not None:
            raise _not_modelled("bias")
        _require(
            isinstance(handle, EPHandle) and handle.fake_route is not None,
            "combine needs the handle of the fake's dispatch",
        )
        _require(not handle.do_expand, "the expanded layout is not modelled")
        route = handle.fake_route
        assert route is not None
        self._check_rows(x, "combine")
        num_recv_tokens, hidden = x.shape
        _require(
            num_recv_tokens == handle.num_recv_tokens,
            f"combine: x has {num_recv_tokens} rows, the dispatch delivered "
            f"{handle.num_recv_tokens}",
        )
        num_tokens, num_topk = handle.topk_idx.shape
        if topk_weights is not None:
            _require(
                topk_weights.shape == (num_recv_tokens, num_topk),
                f"combine: topk_weights must be [{num_recv_tokens}, {num_topk}], got "
                f"{tuple(topk_weights.shape)}",
            )
            _require(topk_weights.dtype == torch.float32, "combine: topk_weights must be float32")
            _require(topk_weights.is_contiguous(), "combine: topk_weights must be contiguous")
        self._check_fits(handle.num_max_tokens_per_rank, hidden, num_topk)
        self._check_same_on_every_rank(
            "combine",
            num_max_tokens_per_rank=handle.num_max_tokens_per_rank,
            num_experts=handle.num_experts,
            hidden=hidden,
            num_topk=num_topk,
        )

        def send_back(rows_RX: Tensor) -> Tensor:
            return _exchange(rows_RX, route.send_splits, route.recv_splits, self.group)

        back_SH = send_back(x)
        combined_TH = torch.zeros(num_tokens, hidden, dtype=torch.float32)
        combined_TH.index_add_(0, route.send_token_S, back_SH.float())
        combined_topk_weights = None
        if topk_weights is not None:
            back_SK = send_back(topk_weights)
            owner_SK = route.dest_rank_TK[route.send_token_S] == route.send_rank_S[:, None]
            rows, ks = owner_SK.nonzero(as_tuple=True)
            combined_topk_weights = torch.zeros(num_tokens, num_topk, dtype=torch.float32)
            combined_topk_weights[route.send_token_S[rows], ks] = back_SK[rows, ks]
        return combined_TH.to(torch.bfloat16), combined_topk_weights, EventOverlap()
