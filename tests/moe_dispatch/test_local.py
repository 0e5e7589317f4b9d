"""LocalDispatcher and make_dispatcher: capacity counting, drops, and a float64 token loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from assertions import assert_close_report
from moe_dispatch import (
    DISPATCHER_NAMES,
    Dispatcher,
    DispatchHandle,
    LocalDispatcher,
    make_dispatcher,
)
from moe_dispatch.local import capacity_keep_mask
from moe_kernels import grouped_mm


def reference_keep(topk_idx: list[list[int]], num_experts: int, capacity: int) -> list[list[bool]]:
    """Walk the copies in token order, then k order; each expert takes the first `capacity`."""
    taken = [0] * num_experts
    keep = []
    for experts_of_token in topk_idx:
        keep_row = []
        for expert in experts_of_token:
            keep_row.append(taken[expert] < capacity)
            taken[expert] += 1
        keep.append(keep_row)
    return keep


def reference_moe(
    x: Tensor, topk_idx: Tensor, weight: Tensor, w_experts: Tensor, keep: list[list[bool]]
) -> Tensor:
    """Float64, one token at a time: y[t] = sum over kept k of weight * (x[t] @ W[expert])."""
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros(w_experts.shape[2], dtype=torch.float64)
        for k in range(topk_idx.shape[1]):
            if keep[t][k]:
                expert = int(topk_idx[t, k])
                total = total + weight[t, k] * (x[t] @ w_experts[expert])
        rows.append(total)
    return torch.stack(rows)


def routing(num_tokens: int, top_k: int, num_experts: int, seed: int, skew: bool) -> Tensor:
    """[T, K] distinct experts; with skew, low-numbered experts are much more popular."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if skew:
        scores = scores - torch.arange(num_experts) * 0.15
    return scores.topk(top_k, dim=1).indices


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "capacity"),
    [(41, 2, 5, 9), (64, 4, 8, 20), (10, 1, 3, 1), (7, 3, 4, 0), (33, 2, 4, 100)],
)
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_capacity_keep_mask_matches_python_count(
    num_tokens: int, top_k: int, num_experts: int, capacity: int, skew: bool
) -> None:
    topk_idx = routing(num_tokens, top_k, num_experts, seed=num_tokens + capacity, skew=skew)
    keep = capacity_keep_mask(topk_idx, num_experts, capacity)
    assert keep.dtype == torch.bool
    assert keep.tolist() == reference_keep(topk_idx.tolist(), num_experts, capacity)


def test_capacity_keep_mask_with_repeated_experts_in_a_token() -> None:
    topk_idx = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    keep = capacity_keep_mask(topk_idx, 2, 2)
    assert keep.tolist() == [[True, True, True], [False, True, False], [False, False, False]]


@pytest.mark.parametrize(
    ("capacity_factor", "num_tokens", "top_k", "num_experts", "expected"),
    [(1.0, 10, 2, 4, 5), (1.25, 7, 2, 3, 6), (0.1, 5, 1, 8, 1), (2.0, 9, 3, 6, 9)],
)
def test_capacity_is_ceil_of_factor_times_even_share(
    capacity_factor: float, num_tokens: int, top_k: int, num_experts: int, expected: int
) -> None:
    assert math.ceil(capacity_factor * num_tokens * top_k / num_experts) == expected
    dispatcher = LocalDispatcher(num_experts, capacity_factor=capacity_factor)
    assert dispatcher.capacity(num_tokens, top_k) == expected
    assert LocalDispatcher(num_experts).capacity(num_tokens, top_k) is None


@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.6], ids=["dropless", "cf1.0", "cf0.6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_expert_combine_matches_token_loop(
    capacity_factor: float | None, dtype: torch.dtype
) -> None:
    num_tokens, top_k, num_experts, dim, hidden = 45, 2, 6, 32, 24
    generator = torch.Generator().manual_seed(10)
    topk_idx = routing(num_tokens, top_k, num_experts, seed=11, skew=True)
    x = torch.randn(num_tokens, dim, generator=generator).to(dtype)
    w_experts = (torch.randn(num_experts, dim, hidden, generator=generator) / dim**0.5).to(dtype)
    weight = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), dim=1)
    grad_out = torch.randn(num_tokens, hidden, generator=generator).to(dtype)

    dispatcher = make_dispatcher("local", num_experts=num_experts, capacity_factor=capacity_factor)
    capacity = dispatcher.capacity(num_tokens, top_k)
    keep = reference_keep(topk_idx.tolist(), num_experts, capacity or num_tokens * top_k)
    expected_dropped = sum(not kept for row in keep for kept in row)
    if capacity_factor == 0.6:
        assert expected_dropped > 0, "the skewed routing should overflow some expert"

    x_ours = x.clone().requires_grad_()
    w_ours = w_experts.clone().requires_grad_()
    weight_ours = weight.clone().requires_grad_()
    expert_input, tokens_per_expert, handle = dispatcher.dispatch(x_ours, topk_idx, weight_ours)
    offsets = torch.cumsum(tokens_per_expert, 0)
    expert_output = grouped_mm(expert_input, w_ours, offsets)
    out = dispatcher.combine(expert_output, handle)
    out.backward(grad_out)

    assert isinstance(handle, DispatchHandle)
    assert handle.num_copies == num_tokens * top_k
    assert handle.dropped_copies.dim() == 0
    assert handle.dropped_copies.dtype == torch.int64
    assert int(handle.dropped_copies) == expected_dropped
    kept_per_expert = [
        sum(
            1 for t in range(num_tokens) for k in range(top_k) if topk_idx[t, k] == e and keep[t][k]
        )
        for e in range(num_experts)
    ]
    assert handle.kept_per_expert.dtype == torch.int64
    assert handle.kept_per_expert.tolist() == kept_per_expert
    assert tokens_per_expert.dtype == torch.int64
    assert tokens_per_expert.shape == (num_experts,)
    assert tokens_per_expert.tolist() == kept_per_expert
    assert expert_input.shape == (num_tokens * top_k, dim)

    x_ref = x.to(torch.float64).requires_grad_()
    w_ref = w_experts.to(torch.float64).requires_grad_()
    weight_ref = weight.to(dtype).to(torch.float64).requires_grad_()
    out_ref = reference_moe(x_ref, topk_idx, weight_ref, w_ref, keep)
    out_ref.backward(grad_out.to(torch.float64))

    rtol, atol_fraction = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1e-2)
    assert out.dtype == dtype
    for name, actual, expected in [
        ("out", out, out_ref),
        ("grad_x", x_ours.grad, x_ref.grad),
        ("grad_w_experts", w_ours.grad, w_ref.grad),
        ("grad_weight", weight_ours.grad, weight_ref.grad),
    ]:
        scale = max(expected.abs().max().item(), 1e-3)
        assert_close_report(actual, expected, rtol=rtol, atol=atol_fraction * scale, name=name)


def test_padding_rows_of_expert_input_are_ignored_by_combine() -> None:
    num_tokens, top_k, num_experts = 30, 2, 3
    topk_idx = routing(num_tokens, top_k, num_experts, seed=3, skew=True)
    x = torch.randn(num_tokens, 8, generator=torch.Generator().manual_seed(4))
    weight = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(5))
    dispatcher = LocalDispatcher(num_experts, capacity_factor=0.5)
    expert_input, tokens_per_expert, handle = dispatcher.dispatch(x, topk_idx, weight)
    num_kept = int(tokens_per_expert.sum())
    assert num_kept + int(handle.dropped_copies) == num_tokens * top_k
    assert num_kept < num_tokens * top_k

    expert_output = expert_input.clone()
    expert_output[num_kept:] = float("nan")  # whatever experts leave in the padding rows
    expert_output.requires_grad_()
    out = dispatcher.combine(expert_output, handle)
    out.sum().backward()
    keep = reference_keep(topk_idx.tolist(), num_experts, dispatcher.capacity(num_tokens, top_k))
    expected = reference_moe(
        x.double(),
        topk_idx,
        weight.double(),
        torch.eye(8, dtype=torch.float64).expand(3, 8, 8),
        keep,
    )
    assert_close_report(out, expected, rtol=1e-6, atol=1e-6, name="out")
    assert torch.equal(expert_output.grad[num_kept:], torch.zeros(2 * num_tokens - num_kept, 8))


def test_dropless_never_drops_even_when_all_tokens_pick_one_expert() -> None:
    topk_idx = torch.zeros(17, 1, dtype=torch.int64)
    x = torch.randn(17, 4)
    dispatcher = LocalDispatcher(4)
    expert_input, tokens_per_expert, handle = dispatcher.dispatch(x, topk_idx, torch.ones(17, 1))
    assert tokens_per_expert.tolist() == [17, 0, 0, 0]
    assert int(handle.dropped_copies) == 0
    assert torch.equal(expert_input, x)
    assert torch.equal(dispatcher.combine(expert_input, handle), x)


def test_local_dispatcher_satisfies_the_protocol() -> None:
    dispatcher = make_dispatcher("local", num_experts=8)
    assert isinstance(dispatcher, Dispatcher)
    assert isinstance(dispatcher, LocalDispatcher)
    assert dispatcher.num_experts == 8
    assert dispatcher.num_local_experts == 8


def test_make_dispatcher_names() -> None:
    assert DISPATCHER_NAMES == ("local", "all_to_all", "rowwise", "deepep", "all_to_all_dedup")
    for name in ("all_to_all", "rowwise"):
        with pytest.raises(ValueError, match=f"parallel.dispatcher={name} needs"):
            make_dispatcher(name, num_experts=4, capacity_factor=1.0)
    with pytest.raises(ValueError, match="local, all_to_all, rowwise, deepep"):
        make_dispatcher("alltoall", num_experts=4)


@pytest.mark.parametrize("capacity_factor", [0.0, -1.0])
def test_non_positive_capacity_factor_is_rejected(capacity_factor: float) -> None:
    with pytest.raises(ValueError, match="capacity_factor"):
        LocalDispatcher(4, capacity_factor=capacity_factor)


def test_dispatch_rejects_mismatched_routing_shapes() -> None:
    with pytest.raises(ValueError, match="must both be"):
        LocalDispatcher(4).dispatch(
            torch.zeros(3, 8), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 1)
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capacity_dispatch_is_sync_free_on_gpu() -> None:
    topk_idx = routing(64, 2, 8, seed=6, skew=True).cuda()
    x = torch.randn(64, 32, device="cuda", requires_grad=True)
    weight = torch.rand(64, 2, device="cuda", requires_grad=True)
    dispatcher = LocalDispatcher(8, capacity_factor=1.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        expert_input, _, handle = dispatcher.dispatch(x, topk_idx, weight)
        out = dispatcher.combine(expert_input, handle)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    keep = reference_keep(topk_idx.tolist(), 8, dispatcher.capacity(64, 2))
    assert int(handle.dropped_copies) == sum(not kept for row in keep for kept in row)


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_the_routers_counts_give_the_same_dispatch_without_recounting(capacity_factor) -> None:
    """Handing dispatch the histogram the router counted changes nothing but the work: the
    same rows, counts and drops; the handle's group ends are the counts' cumulative sums."""
    num_tokens, top_k, num_experts = 45, 2, 6
    topk_idx = routing(num_tokens, top_k, num_experts, seed=11, skew=True)
    x = torch.randn(num_tokens, 8, generator=torch.Generator().manual_seed(3))
    weight = torch.full((num_tokens, top_k), 0.5)
    counts = torch.bincount(topk_idx.flatten(), minlength=num_experts)
    dispatcher = make_dispatcher(
        "local", num_experts=num_experts, capacity_factor=capacity_factor, group_alignment=4
    )
    plain = dispatcher.dispatch(x, topk_idx, weight)
    counted = dispatcher.dispatch(x, topk_idx, weight, counts)
    assert torch.equal(counted[0], plain[0])
    assert torch.equal(counted[1], plain[1])
    assert int(counted[2].dropped_copies) == int(plain[2].dropped_copies)
    assert (int(plain[2].dropped_copies) > 0) == (capacity_factor is not None)
    for _, rows_per_expert, handle in (plain, counted):
        ends = torch.cumsum(rows_per_expert, 0).to(torch.int32)
        assert torch.equal(handle.group_ends, ends)
    assert torch.equal(
        dispatcher.combine(counted[0], counted[2]), dispatcher.combine(plain[0], plain[2])
    )
