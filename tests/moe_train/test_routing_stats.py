"""Routing statistics travel between ranks packed in one row per layer; unpacking gives
back every field."""

import pytest
import torch

from moe_train.model import RoutingStats


def _stats(seed: int, num_experts: int) -> RoutingStats:
    generator = torch.Generator().manual_seed(seed)
    copies = torch.randint(0, 1000, (num_experts,), generator=generator)
    scalars = torch.rand(4, generator=generator, dtype=torch.float64)
    return RoutingStats(copies, copies // 2, *scalars)


def test_unpacking_stacked_rows_gives_each_field_per_row():
    num_experts = 6
    stats = [_stats(seed, num_experts) for seed in range(3)]
    rows_NW = torch.stack([s.pack() for s in stats])
    assert rows_NW.shape == (3, RoutingStats.packed_width(num_experts))
    unpacked = RoutingStats.unpack(rows_NW, num_experts)
    for field in RoutingStats.__dataclass_fields__:
        want = torch.stack([getattr(s, field).double() for s in stats])
        torch.testing.assert_close(getattr(unpacked, field), want, rtol=0, atol=0, msg=field)


def test_unpacking_rows_of_another_width_is_refused():
    with pytest.raises(ValueError, match="of 4 experts have 12 columns, got 13"):
        RoutingStats.unpack(torch.zeros(2, 13, dtype=torch.float64), 4)
