"""permute / unpermute against per-token Python loops in float64, with and without drops."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from assertions import assert_close_report
from moe_kernels import Permutation, grouped_mm, permute, unpermute

TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-2)}


def reference_layout(
    topk_idx: list[list[int]], num_experts: int, keep: list[list[bool]] | None
) -> list[tuple[int, int]]:
    """(token, k) of each permuted row: experts in order, tokens then k; dropped copies last."""
    num_tokens, top_k = len(topk_idx), len(topk_idx[0]) if topk_idx else 0

    def kept(t: int, k: int) -> bool:
        return keep is None or keep[t][k]

    rows = [
        (t, k)
        for expert in range(num_experts)
        for t in range(num_tokens)
        for k in range(top_k)
        if topk_idx[t][k] == expert and kept(t, k)
    ]
    rows += [(t, k) for t in range(num_tokens) for k in range(top_k) if not kept(t, k)]
    return rows


def reference_unpermute(
    y_PD: Tensor, layout: list[tuple[int, int]], weight_TK: Tensor, keep: list[list[bool]] | None
) -> Tensor:
    """One token at a time in float64: sum over its kept copies of weight * expert output."""
    num_tokens = weight_TK.shape[0]
    row_of = {copy: row for row, copy in enumerate(layout)}
    y64, weight64 = y_PD.to(torch.float64), weight_TK.to(torch.float64)
    out = []
    for t in range(num_tokens):
        total = torch.zeros(y_PD.shape[1], dtype=torch.float64)
        for k in range(weight_TK.shape[1]):
            if keep is None or keep[t][k]:
                total = total + weight64[t, k] * y64[row_of[(t, k)]]
        out.append(total)
    return torch.stack(out) if out else torch.zeros(0, y_PD.shape[1], dtype=torch.float64)


def random_routing(
    num_tokens: int, top_k: int, num_experts: int, generator: torch.Generator
) -> Tensor:
    """[T, K] distinct experts per token."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    return scores.topk(top_k, dim=1).indices


ROUTINGS = {
    # name: (T, K, E, how the experts are chosen)
    "random": (37, 2, 6, "random"),
    "top1": (23, 1, 4, "random"),
    "top4_many_experts": (19, 4, 16, "random"),  # some experts get nothing
    "all_to_one_expert": (17, 1, 5, "one"),
    "repeated_expert_in_topk": (11, 3, 4, "repeat"),
    "single_token": (1, 2, 3, "random"),
}


def make_routing(name: str, seed: int) -> tuple[Tensor, int, torch.Generator]:
    num_tokens, top_k, num_experts, kind = ROUTINGS[name]
    generator = torch.Generator().manual_seed(seed)
    if kind == "random":
        topk_idx = random_routing(num_tokens, top_k, num_experts, generator)
    elif kind == "one":
        topk_idx = torch.full((num_tokens, top_k), 3)
    else:
        topk_idx = torch.randint(num_experts, (num_tokens, top_k), generator=generator)
    return topk_idx, num_experts, generator


def check_permutation_structure(
    permutation: Permutation, layout: list[tuple[int, int]], topk_idx: Tensor, num_experts: int
) -> None:
    num_tokens, top_k = topk_idx.shape
    assert permutation.num_tokens == num_tokens
    assert permutation.top_k == top_k
    assert permutation.source_token.tolist() == [t for t, _ in layout]
    assert permutation.row_of_copy.tolist() == [
        layout.index((t, k)) for t in range(num_tokens) for k in range(top_k)
    ]
    assert permutation.tokens_per_expert.dtype == torch.int64
    assert permutation.offsets.dtype == torch.int32
    assert permutation.tokens_per_expert.shape == (num_experts,)
    assert permutation.offsets.tolist() == torch.cumsum(permutation.tokens_per_expert, 0).tolist()


@pytest.mark.parametrize("with_drops", [False, True], ids=["dropless", "drops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_permute_unpermute_match_token_loop(
    routing: str, dtype: torch.dtype, with_drops: bool
) -> None:
    topk_idx, num_experts, generator = make_routing(routing, seed=len(routing) * 101 + with_drops)
    num_tokens, top_k = topk_idx.shape
    dim = 24
    keep = torch.rand(num_tokens, top_k, generator=generator) > 0.3 if with_drops else None
    keep_list = keep.tolist() if keep is not None else None
    x = torch.randn(num_tokens, dim, generator=generator, dtype=torch.float64).to(dtype)
    weight = torch.rand(num_tokens, top_k, generator=generator)
    expert_scale = torch.randn(num_experts, generator=generator, dtype=torch.float64).to(dtype)
    grad_out = torch.randn(num_tokens, dim, generator=generator).to(dtype)

    layout = reference_layout(topk_idx.tolist(), num_experts, keep_list)

    # Ours: permute, a per-row "expert" (scale by the row's expert), unpermute.
    x_ours = x.clone().requires_grad_()
    weight_ours = weight.clone().requires_grad_()
    x_perm, permutation = permute(x_ours, topk_idx, num_experts, keep)
    check_permutation_structure(permutation, layout, topk_idx, num_experts)
    expected_counts = [
        sum(1 for t, k in layout if topk_idx[t, k] == e and (keep is None or keep[t, k]))
        for e in range(num_experts)
    ]
    assert permutation.tokens_per_expert.tolist() == expected_counts
    assert x_perm.shape == (num_tokens * top_k, dim)
    assert torch.equal(x_perm, x[[t for t, _ in layout]]), "permute must copy rows exactly"

    expert_of_row = torch.tensor([int(topk_idx[t, k]) for t, k in layout], dtype=torch.int64)
    y_perm = x_perm * expert_scale[expert_of_row].unsqueeze(1)
    y_perm.retain_grad()
    out = unpermute(y_perm, permutation, weight_ours)
    out.backward(grad_out)

    # Reference: the same maths, one token at a time in float64.
    x_ref = x.to(torch.float64).requires_grad_()
    weight_ref = weight.to(dtype).to(torch.float64).requires_grad_()
    y_perm_ref = (
        torch.stack([x_ref[t] * expert_scale[topk_idx[t, k]].to(torch.float64) for t, k in layout])
        if layout
        else torch.zeros(0, dim, dtype=torch.float64)
    )
    y_perm_ref.retain_grad()
    out_ref = reference_unpermute(y_perm_ref, layout, weight_ref, keep_list)
    out_ref.backward(grad_out.to(torch.float64))

    rtol, atol_fraction = TOLERANCES[dtype]
    assert out.dtype == dtype
    for name, actual, expected in [
        ("out", out, out_ref),
        ("grad_x", x_ours.grad, x_ref.grad),
        ("grad_y_perm", y_perm.grad, y_perm_ref.grad),
        ("grad_weight", weight_ours.grad, weight_ref.grad),
    ]:
        scale = max(expected.abs().max().item(), 1.0)
        assert_close_report(actual, expected, rtol=rtol, atol=atol_fraction * scale, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_identity_experts_with_weights_summing_to_one_return_x(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    num_tokens, top_k, num_experts = 53, 3, 8
    topk_idx = random_routing(num_tokens, top_k, num_experts, generator)
    weight = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), dim=1)
    x = torch.randn(num_tokens, 40, generator=generator).to(dtype)
    x_perm, permutation = permute(x, topk_idx, num_experts)
    out = unpermute(x_perm, permutation, weight)
    rtol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close_report(out, x, rtol=rtol, atol=rtol, name="identity round trip")


def test_dropped_rows_are_ignored_even_when_they_hold_nan() -> None:
    generator = torch.Generator().manual_seed(2)
    num_tokens, top_k, num_experts = 29, 2, 4
    topk_idx = random_routing(num_tokens, top_k, num_experts, generator)
    keep = torch.rand(num_tokens, top_k, generator=generator) > 0.5
    x = torch.randn(num_tokens, 16, generator=generator)
    weight = torch.rand(num_tokens, top_k, generator=generator, requires_grad=True)
    x_perm, permutation = permute(x, topk_idx, num_experts, keep)
    num_kept = int(keep.sum())
    assert int(permutation.offsets[-1]) == num_kept
    assert permutation.source_token[num_kept:].tolist() == [
        t for t in range(num_tokens) for k in range(top_k) if not keep[t, k]
    ]

    y_perm = x_perm.clone()
    y_perm[num_kept:] = float("nan")
    y_perm.requires_grad_()
    out = unpermute(y_perm, permutation, weight)
    out.backward(torch.ones_like(out))

    assert torch.isfinite(out).all()
    expected = reference_unpermute(
        x_perm,
        reference_layout(topk_idx.tolist(), num_experts, keep.tolist()),
        weight,
        keep.tolist(),
    )
    assert_close_report(out, expected, rtol=1e-6, atol=1e-6, name="out")
    assert torch.equal(y_perm.grad[num_kept:], torch.zeros_like(y_perm.grad[num_kept:]))
    assert torch.equal(weight.grad[~keep], torch.zeros(int((~keep).sum())))
    assert torch.isfinite(weight.grad).all()


def test_everything_dropped() -> None:
    topk_idx = torch.tensor([[0, 1], [1, 2]])
    keep = torch.zeros(2, 2, dtype=torch.bool)
    x = torch.randn(2, 8)
    x_perm, permutation = permute(x, topk_idx, 3, keep)
    assert permutation.tokens_per_expert.tolist() == [0, 0, 0]
    assert permutation.offsets.tolist() == [0, 0, 0]
    assert x_perm.shape == (4, 8)
    out = unpermute(torch.full_like(x_perm, float("nan")), permutation, torch.ones(2, 2))
    assert torch.equal(out, torch.zeros(2, 8))


def test_weights_are_cast_to_the_dtype_of_y() -> None:
    topk_idx = torch.tensor([[0, 1], [1, 0], [0, 0]])
    x = torch.randn(3, 8).to(torch.bfloat16)
    weight = torch.rand(3, 2, dtype=torch.float32, requires_grad=True)
    x_perm, permutation = permute(x, topk_idx, 2)
    out = unpermute(x_perm, permutation, weight)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert weight.grad is not None
    assert weight.grad.dtype == torch.float32


def test_permute_feeds_grouped_mm() -> None:
    generator = torch.Generator().manual_seed(4)
    num_tokens, top_k, num_experts, dim, hidden = 31, 2, 5, 16, 24
    topk_idx = random_routing(num_tokens, top_k, num_experts, generator)
    keep = torch.rand(num_tokens, top_k, generator=generator) > 0.2
    x = torch.randn(num_tokens, dim, generator=generator)
    w = torch.randn(num_experts, dim, hidden, generator=generator)
    weight = torch.rand(num_tokens, top_k, generator=generator)
    x_perm, permutation = permute(x, topk_idx, num_experts, keep)
    out = unpermute(grouped_mm(x_perm, w, permutation.offsets), permutation, weight)
    expected = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for t in range(num_tokens):
        for k in range(top_k):
            if keep[t, k]:
                expert = int(topk_idx[t, k])
                expected[t] += float(weight[t, k]) * (x[t].double() @ w[expert].double())
    assert_close_report(out, expected, rtol=1e-5, atol=1e-5, name="out")


@pytest.mark.parametrize(
    ("x_shape", "idx_shape", "keep_shape", "message"),
    [
        ((4, 8), (5, 2), None, "topk_idx must be"),
        ((4,), (4, 2), None, "x must be 2-D"),
        ((4, 8), (4, 2), (4, 1), "keep must be a bool tensor"),
    ],
)
def test_permute_rejects_bad_shapes(
    x_shape: tuple[int, ...],
    idx_shape: tuple[int, ...],
    keep_shape: tuple[int, ...] | None,
    message: str,
) -> None:
    keep = torch.ones(keep_shape, dtype=torch.bool) if keep_shape else None
    with pytest.raises(ValueError, match=message):
        permute(torch.zeros(x_shape), torch.zeros(idx_shape, dtype=torch.int64), 4, keep)


def test_unpermute_rejects_bad_shapes() -> None:
    x_perm, permutation = permute(torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match=r"y must be \[P, D\] with P=8 rows"):
        unpermute(x_perm[:7], permutation, torch.ones(4, 2))
    with pytest.raises(ValueError, match="topk_weight must be"):
        unpermute(x_perm, permutation, torch.ones(4, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_permute_unpermute_are_sync_free_on_gpu() -> None:
    generator = torch.Generator().manual_seed(5)
    topk_idx = random_routing(64, 2, 8, generator).cuda()
    keep = (torch.rand(64, 2, generator=generator) > 0.3).cuda()
    x = torch.randn(64, 32, generator=generator).cuda().requires_grad_()
    weight = torch.rand(64, 2, generator=generator).cuda().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x_perm, permutation = permute(x, topk_idx, 8, keep)
        out = unpermute(x_perm * 2, permutation, weight)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = 2 * x.detach() * (weight.detach() * keep).sum(1, keepdim=True)
    assert_close_report(out, expected, rtol=1e-5, atol=1e-5, name="out")


@pytest.mark.parametrize("with_drops", [False, True], ids=["dropless", "drops"])
@pytest.mark.parametrize("routing", ["random", "top4_many_experts", "all_to_one_expert"])
def test_group_alignment_pads_groups_with_zero_rows_and_changes_nothing_else(
    routing: str, with_drops: bool
) -> None:
    alignment = 4
    topk_idx, num_experts, generator = make_routing(routing, seed=7 + with_drops)
    num_tokens, top_k = topk_idx.shape
    keep = torch.rand(num_tokens, top_k, generator=generator) > 0.3 if with_drops else None
    x = torch.randn(num_tokens, 8, generator=generator, dtype=torch.float64)
    weight = torch.rand(num_tokens, top_k, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(num_tokens, 8, generator=generator, dtype=torch.float64)

    results = {}
    for a in (1, alignment):
        x_in = x.clone().requires_grad_()
        weight_in = weight.clone().requires_grad_()
        x_perm, permutation = permute(x_in, topk_idx, num_experts, keep, group_alignment=a)
        y_perm = x_perm * 3.0
        unpermute(y_perm, permutation, weight_in).backward(grad_out)
        results[a] = (x_perm.detach(), permutation, x_in.grad, weight_in.grad)

    plain_rows, plain, plain_grad_x, plain_grad_w = results[1]
    rows, aligned, grad_x, grad_w = results[alignment]
    counts = plain.tokens_per_expert.tolist()
    assert aligned.tokens_per_expert.tolist() == counts
    assert aligned.rows_per_expert.tolist() == [-(-c // alignment) * alignment for c in counts]
    assert aligned.offsets.tolist() == torch.cumsum(aligned.rows_per_expert, 0).tolist()
    assert rows.shape[0] == num_tokens * top_k + num_experts * (alignment - 1)
    start = plain_start = 0
    for expert, count in enumerate(counts):
        group_rows = int(aligned.rows_per_expert[expert])
        assert torch.equal(
            rows[start : start + count], plain_rows[plain_start : plain_start + count]
        )
        assert not rows[start + count : start + group_rows].any(), "padding rows must be zero"
        start, plain_start = start + group_rows, plain_start + count
    num_dropped = num_tokens * top_k - sum(counts)
    assert torch.equal(rows[start : start + num_dropped], plain_rows[plain_start:])
    assert not rows[start + num_dropped :].any()
    assert torch.equal(grad_x, plain_grad_x)
    assert torch.equal(grad_w, plain_grad_w)
