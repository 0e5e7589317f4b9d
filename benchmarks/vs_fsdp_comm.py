"""What a training step moves through torch.distributed, and the most heap memory it holds.

Every collective of this torch reaches the operator dispatcher as an op: the functions of
`torch.distributed` and the methods of `ProcessGroup` as `c10d.*` ops (`c10d.allreduce_`,
`c10d._allgather_base_`, `c10d.alltoall_base_`, ...), functional collectives (which DTensor
uses, for example for the gradient norm of FSDP2's sharded gradients) as `_c10d_functional.*`
ops. `CollectiveCounter` is a dispatch mode that sees each of those calls on the rank that
makes it, with its tensors and process group, so it counts bytes from the tensors actually
handed over, not from a model of them. DTensor first runs its own dispatch, so the
collectives it issues come back to the mode as plain ops and are counted once.

Per call and rank:
- payload: the bytes of the input the rank hands over (all-gather: its shard; reduce-scatter:
  the full input; all-reduce and broadcast: the tensor; all-to-all: the whole send buffer, its
  own block included), the measure of `moe_plan`'s traffic prediction;
- wire: the bytes that leave the rank over its links: the blocks of an all-to-all meant for
  other ranks (exact, uneven splits included), and for the others what the ring algorithms
  send: an all-gather (g - 1) shards, a reduce-scatter (g - 1) / g of its input, an
  all-reduce 2 (g - 1) / g of its tensor (g: the group's size).

`PeakHeap` reads glibc's in-use heap bytes (where CPU tensors live) after every op: the most
seen, above a baseline, is the peak memory of what ran under it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from moe_train.train.host_memory import allocated_host_bytes

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "other")
"""Collective kinds, in table order; "other" holds barriers, point-to-point and rooted ops."""

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
"""Operator namespaces of torch.distributed's collectives."""

NOT_COLLECTIVES = frozenset(
    {
        "_c10d_functional::wait_tensor",
        "_c10d_functional::wait_tensors",
        "_c10d_functional::_wrap_tensor_autograd",
        "c10d::check_for_nan",
    }
)
"""Ops of those namespaces that move nothing between ranks."""

RULES: dict[str, tuple[str, str]] = {
    # torch.distributed functions and ProcessGroup methods
    "c10d::_allgather_base_": ("all_gather", "input_tensor"),
    "c10d::allgather_": ("all_gather", "input_tensors"),
    "c10d::allgather_coalesced_": ("all_gather", "input_list"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "c10d::reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "c10d::allreduce_": ("all_reduce", "tensors"),
    "c10d::allreduce_coalesced_": ("all_reduce", "tensors"),
    "c10d::alltoall_base_": ("all_to_all", "input"),
    "c10d::alltoall_": ("all_to_all", "input_tensors"),
    "c10d::broadcast_": ("broadcast", "tensors"),
    # functional collectives (DTensor, compiled code)
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "input"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "input"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "_c10d_functional_autograd::all_gather_into_tensor": ("all_gather", "input"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "_c10d_functional_autograd::reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_c10d_functional::all_reduce": ("all_reduce", "input"),
    "_c10d_functional::all_reduce_": ("all_reduce", "input"),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "inputs"),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "inputs"),
    "_c10d_functional::all_to_all_single": ("all_to_all", "input"),
    "_c10d_functional_autograd::all_to_all_single": ("all_to_all", "input"),
    "_c10d_functional::broadcast": ("broadcast", "input"),
    "_c10d_functional::broadcast_": ("broadcast", "input"),
}
"""Kind and input argument of each collective op, by schema name. Any other op of
`NAMESPACES` (barrier, send, recv, gather, scatter, reduce, ...) is "other", its payload all
its tensors and its wire bytes the same."""


def _nbytes(value: Any) -> int:
    """Bytes of every tensor in `value` (a tensor or nested lists of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


class _Call:
    """One collective call's arguments, by the names its schema gives them."""

    def __init__(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        self.values = dict(kwargs)
        for argument, value in zip(func._schema.arguments, args, strict=False):
            self.values[argument.name] = value

    def group(self) -> tuple[int, int]:
        """(size, this rank's index) of the call's process group."""
        if "process_group" in self.values:
            group = dist.ProcessGroup.unbox(self.values["process_group"])
        else:
            group = _resolve_process_group(self.values["group_name"])
        return group.size(), group.rank()


def _wire_bytes(kind: str, payload: int, call: _Call) -> float:
    """Bytes this rank sends over its links for `call` (see the module docstring)."""
    if kind not in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        return float(payload)
    size, rank = call.group()
    if kind == "all_gather":
        return float(payload * (size - 1))
    if kind == "reduce_scatter":
        return payload * (size - 1) / size
    if kind == "all_reduce":
        return 2 * payload * (size - 1) / size
    splits = list(call.values.get("input_split_sizes") or [])
    send = call.values.get("input")
    if not splits or not isinstance(send, torch.Tensor):
        return payload * (size - 1) / size  # even blocks
    row_bytes = payload // send.shape[0] if send.shape[0] else 0
    return float(payload - splits[rank] * row_bytes)


@dataclass
class CollectiveTotals:
    """Calls, payload and wire bytes per collective kind (see the module docstring)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payload: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wire: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Calls per op schema name, to see which entry points a design used."""

    def add(self, kind: str, op: str, payload: int, wire: float) -> None:
        self.calls[kind] += 1
        self.payload[kind] += payload
        self.wire[kind] += wire
        self.ops[op] += 1

    def as_dict(self) -> dict[str, dict]:
        """Plain dicts, every kind present (zeros included)."""
        return {
            "calls": {k: self.calls.get(k, 0) for k in KINDS},
            "payload": {k: self.payload.get(k, 0) for k in KINDS},
            "wire": {k: self.wire.get(k, 0.0) for k in KINDS},
            "ops": dict(self.ops),
        }


def _has_dtensor(types: tuple) -> bool:
    return any(issubclass(t, DTensor) for t in types)


class CollectiveCounter(TorchDispatchMode):
    """Counts every collective this rank calls while the mode is active, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.totals = CollectiveTotals()

    def __torch_dispatch__(
        self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if _has_dtensor(types):
            # DTensor dispatches itself first; the collectives it issues come back here.
            return NotImplemented
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) and func.namespace in NAMESPACES:
            name = func._schema.name
            if name not in NOT_COLLECTIVES:
                call = _Call(func, args, kwargs)
                kind, argument = RULES.get(name, ("other", ""))
                payload = _nbytes(call.values[argument] if argument else args)
                self.totals.add(kind, name, payload, _wire_bytes(kind, payload, call))
        return func(*args, **kwargs)


class PeakHeap(TorchDispatchMode):
    """The most heap bytes in use after any op run under the mode."""

    def __init__(self) -> None:
        super().__init__()
        reading = allocated_host_bytes()
        if reading is None:
            raise RuntimeError("PeakHeap needs glibc's mallinfo2 (Linux)")
        self.peak = reading

    def __torch_dispatch__(
        self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if _has_dtensor(types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, allocated_host_bytes())
        return out
