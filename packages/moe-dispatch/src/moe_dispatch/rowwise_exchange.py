"""The four exchanges of the rowwise dispatcher, with autograd: the dispatch, the combine and
their gradients, each one ``exchange_blocks`` of ``[L, capacity, D]`` blocks.

Over a transport whose writes are the transfer (symmetric memory), only the slots that hold a
routed copy are written: the dispatch sends, ahead of its rows, which slots of each block
hold a copy (``[L, capacity]`` bytes), and every later exchange of that dispatch writes only
those slots and reads the rest as zero. Over the padded all_to_all every slot moves, unused
ones as zero rows. Either way nothing is read on the host, and ``Traffic`` counts what left
for the other ranks.

Shape suffixes: T tokens, K top-k, D row width, E experts, L local experts, C capacity,
P group ranks, S slots (``E * C``, a source's slots over all experts), B slots of one block
(``L * C``), F copies (``T * K``), G rows of one expert's group (``rows_per_expert``),
R rows of the expert input (``L * G``),
N rows gathered from (the tokens or copies, and one zero row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from moe_dispatch.row_wire import Fp8Rows
from moe_dispatch.traffic import Traffic
from moe_kernels import store_rows

if TYPE_CHECKING:
    from moe_dispatch.rowwise import RowTransport

__all__ = ["CombineRows", "DispatchRows", "SlotPlan"]


@dataclass
class ReceivedSlots:
    """What the owner of the experts learns in a dispatch over a rows-only transport: which
    slots of its experts each source filled."""

    used_PLC: Tensor | None = None
    """[ep, L, C] bool: source p filled slot c of local expert l."""
    from_peers: Tensor | None = None
    """0-d int64: the slots of `used_PLC` that other ranks filled (rows an owner's exchange
    sends back to them)."""


@dataclass(frozen=True)
class SlotPlan:
    """Where every copy goes, for one dispatch (all on the device but the sizes)."""

    slot_of_copy_F: Tensor
    """[T * K] int64: the copy's slot among this source's ``E * capacity`` (0 if dropped)."""
    kept_F: Tensor
    """[T * K] bool."""
    copy_of_slot_S: Tensor
    """[E * capacity] int64: the copy in each slot, ``T * K`` for an unused slot."""
    num_local: int
    capacity: int
    rows_per_expert: int
    """Rows of each local expert's group in the expert input: ``ep * capacity``, aligned."""
    transport: RowTransport
    traffic: Traffic
    rank: int
    """This rank's place in the group."""
    ep: int
    """Ranks of the group."""
    received: ReceivedSlots = field(default_factory=ReceivedSlots)
    wire: Fp8Rows | None = None
    """How the forward dispatch's token rows travel (None: in their own dtype)."""

    @property
    def block_rows(self) -> int:
        """Slots one source sends one destination rank: ``L * capacity``."""
        return self.num_local * self.capacity

    @property
    def rows_only(self) -> bool:
        """Whether unused slots stay unwritten (the transport's writes are the transfer)."""
        return self.transport.writes_rows

    @cached_property
    def used_PB(self) -> Tensor:
        """[ep, L * capacity] bool: the slots of this source's block for each rank that hold
        a kept copy (made once per dispatch, read by its four exchanges)."""
        return (self.copy_of_slot_S < self.kept_F.shape[0]).view(self.ep, self.block_rows)

    @cached_property
    def to_peers(self) -> Tensor:
        """0-d int64: the slots of `used_PB` in other ranks' blocks (rows a source's exchange
        sends them), counted once per dispatch on the device."""
        return _outside_own_block(self.used_PB, self.rank)


def _outside_own_block(used_PB: Tensor, rank: int) -> Tensor:
    """0-d int64: the used slots of every block but block ``rank``."""
    used_P = used_PB.sum(dim=1)
    return used_P.sum() - used_P[rank]


def _row_store_backend(dest: Tensor) -> str:
    """The kernel that writes only used rows: Triton on GPUs, where the saving is real."""
    return "triton" if dest.device.type == "cuda" else "torch"


def _count(plan: SlotPlan, used_to_peers: Tensor | None, rows: Tensor, dispatch: bool) -> None:
    """Count the bytes of an exchange of ``rows``' width and dtype that leave for the other
    ranks: ``used_to_peers`` rows where only used slots move (a count on the device), every
    slot otherwise."""
    row_bytes = rows.shape[1] * rows.element_size()
    if plan.rows_only:
        assert used_to_peers is not None
        plan.traffic.count(used_to_peers * row_bytes, dispatch=dispatch)
    else:
        plan.traffic.count((plan.ep - 1) * plan.block_rows * row_bytes, dispatch=dispatch)


def _exchange(
    plan: SlotPlan,
    rows: Tensor,
    write_block: Callable[[int, Tensor], None],
    read: Callable[[Tensor], Tensor],
) -> Tensor:
    """One exchange of ``[L, C, D]`` blocks of ``rows``' width, dtype and device."""
    return plan.transport.exchange_blocks(
        (plan.num_local, plan.capacity, rows.shape[1]), rows.dtype, rows.device, write_block, read
    )


def _send_used_slots(plan: SlotPlan, device: torch.device) -> None:
    """Tell each owner which slots of its experts this source fills ([L, C] bytes a block)."""
    used_PB = plan.used_PB

    def write_block(peer: int, dest_LC: Tensor) -> None:
        dest_LC.view(-1).copy_(used_PB[peer])

    used_PLC = plan.transport.exchange_blocks(
        (plan.num_local, plan.capacity), torch.uint8, device, write_block, lambda r: r.bool()
    )
    plan.received.used_PLC = used_PLC
    plan.received.from_peers = _outside_own_block(used_PLC.view(plan.ep, -1), plan.rank)
    plan.traffic.count((plan.ep - 1) * plan.block_rows, dispatch=True)


def _gather_into_blocks(
    plan: SlotPlan, rows_of_slot_S: Tensor, source_ND: Tensor
) -> Callable[[int, Tensor], None]:
    """``write_block`` that gathers ``source_ND[rows_of_slot_S]`` for block p into dest (only
    the used slots over a rows-only transport)."""
    block_rows = plan.block_rows
    used_PB = plan.used_PB

    def write_block(peer: int, dest_LCD: Tensor) -> None:
        index_B = rows_of_slot_S[peer * block_rows : (peer + 1) * block_rows]
        dest_BD = dest_LCD.view(block_rows, -1)
        if plan.rows_only:
            store_rows(dest_BD, source_ND, index_B, used_PB[peer], _row_store_backend(dest_BD))
        else:
            torch.index_select(source_ND, 0, index_B, out=dest_BD)

    return write_block


def _expert_groups_into_blocks(
    plan: SlotPlan, expert_rows_RD: Tensor
) -> Callable[[int, Tensor], None]:
    """``write_block`` that copies each local expert's region for source p into dest (only the
    slots source p filled, over a rows-only transport)."""
    num_local, capacity, rows_per_expert = plan.num_local, plan.capacity, plan.rows_per_expert
    groups_LGD = expert_rows_RD.view(num_local, rows_per_expert, -1)
    device = expert_rows_RD.device
    group_start_L1 = torch.arange(num_local, device=device).unsqueeze(1) * rows_per_expert
    region_LC = group_start_L1 + torch.arange(capacity, device=device)

    def write_block(source: int, dest_LCD: Tensor) -> None:
        if not plan.rows_only:
            dest_LCD.copy_(groups_LGD[:, source * capacity : (source + 1) * capacity])
            return
        assert plan.received.used_PLC is not None, "the dispatch learns the used slots first"
        dest_BD = dest_LCD.view(plan.block_rows, -1)
        index_B = (region_LC + source * capacity).view(-1)
        used_B = plan.received.used_PLC[source].view(-1)
        store_rows(dest_BD, expert_rows_RD, index_B, used_B, _row_store_backend(dest_BD))

    return write_block


def _read_expert_groups(plan: SlotPlan) -> Callable[[Tensor], Tensor]:
    """``read`` that lays received ``[source, L, C, D]`` out as ``[L * rows_per_expert, D]``:
    expert-major, slot ``source * C + position``; unused slots and alignment rows exactly
    zero (a select over a rows-only transport: what stale slots hold, even NaN, stays out)."""

    def read(recv_PLCD: Tensor) -> Tensor:
        ep, num_local, capacity, dim = recv_PLCD.shape
        groups_LGD = recv_PLCD.new_empty(num_local, plan.rows_per_expert, dim)
        groups_LGD[:, ep * capacity :].zero_()
        regions_LPCD = groups_LGD[:, : ep * capacity].view(num_local, ep, capacity, dim)
        if plan.rows_only:  # one pass: the select writes straight into the groups
            assert plan.received.used_PLC is not None
            used_LPC1 = plan.received.used_PLC.transpose(0, 1).unsqueeze(-1)
            zero = recv_PLCD.new_zeros(())
            torch.where(used_LPC1, recv_PLCD.transpose(0, 1), zero, out=regions_LPCD)
        else:
            regions_LPCD.copy_(recv_PLCD.transpose(0, 1))
        return groups_LGD.view(-1, dim)

    return read


def _read_copies(plan: SlotPlan) -> Callable[[Tensor], Tensor]:
    """``read`` that takes each kept copy's slot from received ``[E * C, D]`` (0 if dropped:
    a select, not a multiply, so whatever sits in unused slots, even NaN, stays out)."""

    def read(recv_PLCD: Tensor) -> Tensor:
        slots_SD = recv_PLCD.view(-1, recv_PLCD.shape[-1])
        rows_FD = slots_SD.index_select(0, plan.slot_of_copy_F)
        return torch.where(plan.kept_F.unsqueeze(1), rows_FD, 0)

    return read


def _with_zero_row(rows_ND: Tensor) -> Tensor:
    """``rows_ND`` and one zero row after them (what unused slots gather)."""
    return torch.cat([rows_ND, rows_ND.new_zeros(1, rows_ND.shape[1])])


def _source_writes(plan: SlotPlan, rows: Tensor, dispatch: bool) -> None:
    """Count an exchange in which this rank writes its copies' slots."""
    _count(plan, plan.to_peers if plan.rows_only else None, rows, dispatch)


def _owner_writes(plan: SlotPlan, rows: Tensor) -> None:
    """Count an exchange in which this rank writes the slots its experts received."""
    _count(plan, plan.received.from_peers, rows, False)


class DispatchRows(torch.autograd.Function):
    """x [T, D] -> expert input [L * rows_per_expert, D]; backward sends the slots' gradients
    back and sums each token's kept copies."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, plan: SlotPlan, top_k: int) -> Tensor:  # type: ignore[override]
        ctx.plan, ctx.top_k = plan, top_k
        if plan.rows_only:
            _send_used_slots(plan, x_TD.device)
        num_tokens = x_TD.shape[0]
        copies = plan.copy_of_slot_S
        token_of_slot_S = torch.where(copies < num_tokens * top_k, copies // top_k, num_tokens)
        rows_TW = x_TD if plan.wire is None else plan.wire.encode(x_TD)
        _source_writes(plan, rows_TW, dispatch=True)
        expert_input = _exchange(
            plan,
            rows_TW,
            _gather_into_blocks(plan, token_of_slot_S, _with_zero_row(rows_TW)),
            _read_expert_groups(plan),
        )
        return expert_input if plan.wire is None else plan.wire.decode(expert_input, x_TD.dtype)

    @staticmethod
    def backward(ctx, grad_expert_input_RD: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        plan, top_k = ctx.plan, ctx.top_k
        grad_rows_RD = grad_expert_input_RD.contiguous()
        _owner_writes(plan, grad_rows_RD)
        grad_copies_FD = _exchange(
            plan,
            grad_rows_RD,
            _expert_groups_into_blocks(plan, grad_rows_RD),
            _read_copies(plan),
        )
        return grad_copies_FD.view(-1, top_k, grad_rows_RD.shape[1]).sum(1), None, None


class CombineRows(torch.autograd.Function):
    """Expert output [L * rows_per_expert, D] -> each copy's row at its source [T * K, D]
    (zero if dropped); backward gathers the copies' gradients into their slots."""

    @staticmethod
    def forward(ctx, expert_output_RD: Tensor, plan: SlotPlan) -> Tensor:  # type: ignore[override]
        ctx.plan = plan
        rows_RD = expert_output_RD.contiguous()
        _owner_writes(plan, rows_RD)
        return _exchange(
            plan, rows_RD, _expert_groups_into_blocks(plan, rows_RD), _read_copies(plan)
        )

    @staticmethod
    def backward(ctx, grad_copies_FD: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        plan = ctx.plan
        _source_writes(plan, grad_copies_FD, dispatch=False)
        return _exchange(
            plan,
            grad_copies_FD,
            _gather_into_blocks(plan, plan.copy_of_slot_S, _with_zero_row(grad_copies_FD)),
            _read_expert_groups(plan),
        ), None
