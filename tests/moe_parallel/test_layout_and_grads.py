"""Layout groups, gradient reduction over the right replicas, and global clipping (gloo)."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.ranks import run_distributed
from moe_parallel import (
    GradientReducer,
    LayoutError,
    clip_grad_norm,
    join_layout,
    mark_expert_parameter,
    single_process_layout,
)
from world_layout import Sizes, world_layout


@pytest.mark.parametrize(
    ("world_size", "pp", "dp", "ep", "cp"),
    [(4, 3, 1, 1, 1), (4, 1, 4, 3, 1), (4, 2, 2, 4, 1), (4, 1, 4, 1, 3), (4, 1, 4, 1, 0)],
)
def test_sizes_that_are_not_a_layout_are_refused(world_size, pp, dp, ep, cp):
    with pytest.raises(LayoutError, match="are not a layout: pp x dp must be the world size"):
        join_layout(Sizes(world_size, pp, dp, ep, cp))


def test_one_process_joins_only_a_layout_of_one_rank():
    assert join_layout(Sizes(1, 1, 1, 1)) == single_process_layout()
    with pytest.raises(LayoutError, match="a layout of 2 ranks needs a process group"):
        join_layout(Sizes(2, 1, 2, 2))


class _Toy(nn.Module):
    """A dense weight and a two-expert weight (the rank's shard when ep > 1)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(rank)
        self.dense = nn.Parameter(torch.randn(3, 5, generator=generator))
        self.experts = mark_expert_parameter(
            nn.Parameter(torch.randn(2, 5, 4, generator=generator))
        )

    def forward(self, x):
        return (x @ self.dense.t()).sum() + torch.einsum("tk,ekn->", x, self.experts)


def _layout_and_reduction(rank: int, world_size: int) -> dict:
    layout = world_layout(pp=1, ep=2)
    groups = {
        name: dist.get_process_group_ranks(getattr(layout, f"{name}_group"))
        for name in ("dp", "ep", "edp", "pp")
    }
    model = _Toy(rank)
    reducer = GradientReducer(model, layout.dp_group, layout.edp_group, bucket_bytes=64)
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(100 + rank))
    # Two micro-batches, reductions armed for the last one (the overlapped path).
    model(x).backward()
    reducer.arm()
    (2 * model(x)).backward()
    reducer.finish()
    local = {
        "dense": 3 * x.sum(0).expand(3, 5),
        "experts": 3 * x.sum(0)[None, :, None].expand(2, 5, 4),
    }
    norm = clip_grad_norm(model, max_norm=1e-3, layout=layout)
    return {
        "groups": groups,
        "ranks": (layout.dp_rank, layout.ep_rank, layout.edp_rank),
        "local": {k: v.clone() for k, v in local.items()},
        "norm": float(norm),
        "dense_grad": model.dense.grad.clone(),
        "expert_grad": model.experts.grad.clone(),
    }


def test_groups_reduction_and_clipping_at_world_four():
    results = run_distributed(_layout_and_reduction, world_size=4)
    assert results[0]["groups"] == {"dp": [0, 1, 2, 3], "ep": [0, 1], "edp": [0, 2], "pp": [0]}
    assert results[3]["groups"] == {"dp": [0, 1, 2, 3], "ep": [2, 3], "edp": [1, 3], "pp": [3]}
    assert [r["ranks"] for r in results] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]

    dense_sum = sum(r["local"]["dense"] for r in results)
    expert_sum = {e: sum(results[r]["local"]["experts"] for r in (e, e + 2)) for e in (0, 1)}
    # The global gradient: the dense sum once, each expert shard's sum once.
    expected_norm = math.sqrt(
        float(dense_sum.pow(2).sum()) + sum(float(g.pow(2).sum()) for g in expert_sum.values())
    )
    scale = 1e-3 / (expected_norm + 1e-6)
    for rank, result in enumerate(results):
        assert result["norm"] == pytest.approx(expected_norm, rel=1e-6)
        torch.testing.assert_close(result["dense_grad"], dense_sum * scale)
        torch.testing.assert_close(result["expert_grad"], expert_sum[rank % 2] * scale)
