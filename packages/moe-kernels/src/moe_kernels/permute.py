"""Token permutation into expert-contiguous order and the weighted sum back, without host sync.

A token routed to K experts becomes K "copies"; copy ``f = t * K + k`` goes to expert
``topk_idx[t, k]``. ``permute`` lays the T*K copies out grouped by expert (stable: token order,
then k order), kept copies first and dropped copies after ``offsets[-1]``. ``unpermute`` sums
each token's kept copies back with its routing weights.

With ``group_alignment`` A > 1 every expert's row group is padded with zero rows to a multiple
of A, and the output has the static size T*K + E*(A-1) rows. GEMM libraries then see group
sizes from a small set and reuse their kernels (on CPU, oneDNN compiles one per new shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_kernels.triton_support import import_kernels

__all__ = ["PERMUTE_BACKENDS", "Permutation", "PermuteBackend", "permute", "unpermute"]

PermuteBackend = Literal["torch", "triton"]
"""How ``permute``/``unpermute`` move the rows: torch indexing ops (the reference, any
device) or the Triton kernels of ``moe_kernels.triton_permute`` (GPU, or CPU under the Triton
interpreter). The layout and the index computation are the same."""

PERMUTE_BACKENDS: tuple[str, ...] = get_args(PermuteBackend)


@dataclass(frozen=True)
class Permutation:
    """How ``permute`` laid out the token copies; everything ``unpermute`` needs to invert it."""

    source_token: Tensor
    """[P] int64: the token each permuted row was copied from (T for alignment padding)."""
    row_of_copy: Tensor
    """[T*K] int64: the permuted row of copy ``t * K + k`` (inverse of the sort order)."""
    tokens_per_expert: Tensor
    """[E] int64: kept copies routed to each expert."""
    rows_per_expert: Tensor
    """[E] int64: rows of each expert's group: ``tokens_per_expert`` rounded up to the
    alignment (the extra rows are zero)."""
    offsets: Tensor
    """[E] int32: cumulative ends of ``rows_per_expert`` (the grouped_mm offsets)."""
    num_tokens: int
    """T."""
    top_k: int
    """K."""
    kept_copies: Tensor | None = None
    """[T*K] bool, False for dropped copies; None when nothing can be dropped."""

    @property
    def num_experts(self) -> int:
        """E."""
        return self.tokens_per_expert.shape[0]


def _fused_gather_sum_applies(rows_PD: Tensor) -> bool:
    """Whether ``embedding_bag`` (a fused gather and sum over each token's copies) is used.

    On CPU it is faster than gathering [T, K, D] and then summing (it never materialises the
    [T, K, D] copies). Elsewhere the plain gather (sync-free) is kept.
    """
    return rows_PD.device.type == "cpu" and rows_PD.shape[1] > 0


def _sum_over_copies(rows_TKD: Tensor) -> Tensor:
    """[T, K, D] -> [T, D] sum over k (elementwise adds: faster on CPU than a strided sum)."""
    top_k = rows_TKD.shape[1]
    if top_k == 1:
        return rows_TKD[:, 0]
    total_TD = torch.add(rows_TKD[:, 0], rows_TKD[:, 1])
    for k in range(2, top_k):
        total_TD.add_(rows_TKD[:, k])
    return total_TD


def _padding_rows(source_token_P: Tensor, num_tokens: int, num_padding: int) -> Tensor:
    """[num_padding] int64 indices of the rows whose source is T, found on the device."""
    is_padding_P = source_token_P == num_tokens
    # The j-th padding row goes to slot j; every other row to a spare slot past the end.
    slot_P = torch.where(is_padding_P, torch.cumsum(is_padding_P, 0) - 1, num_padding)
    rows = torch.empty(num_padding + 1, dtype=torch.int64, device=source_token_P.device)
    rows.scatter_(0, slot_P, torch.arange(source_token_P.shape[0], device=source_token_P.device))
    return rows[:num_padding]


class _GatherRows(torch.autograd.Function):
    """``x_perm[r] = x[source_token[r]]`` (zero where the source is T); backward gathers too.

    The backward sums each token's copies by gathering them (``row_of_copy``; fused into one
    ``embedding_bag`` on CPU) instead of ``index_add``, which runs as a slow scatter on CPU.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x_TD: Tensor, source_token_P: Tensor, row_of_copy_F: Tensor, top_k: int
    ) -> Tensor:
        num_tokens, dim = x_TD.shape
        num_rows, num_copies = source_token_P.shape[0], row_of_copy_F.shape[0]
        ctx.save_for_backward(row_of_copy_F)
        ctx.num_tokens, ctx.top_k = num_tokens, top_k
        if num_rows == num_copies:
            return x_TD.index_select(0, source_token_P)
        if num_tokens == 0:
            return x_TD.new_zeros(num_rows, dim)
        # Padding rows read token T-1 and are then zeroed: cheaper than appending a zero row
        # to x, which copies all of x.
        x_perm_PD = x_TD.index_select(0, source_token_P.clamp(max=num_tokens - 1))
        padding_rows = _padding_rows(source_token_P, num_tokens, num_rows - num_copies)
        return x_perm_PD.index_fill_(0, padding_rows, 0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_PD: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (row_of_copy_F,) = ctx.saved_tensors
        num_tokens, top_k = ctx.num_tokens, ctx.top_k
        if _fused_gather_sum_applies(grad_PD):
            row_of_copy_TK = row_of_copy_F.view(num_tokens, top_k)
            return (
                F.embedding_bag(row_of_copy_TK, grad_PD.contiguous(), mode="sum"),
                None,
                None,
                None,
            )
        grad_TKD = grad_PD.index_select(0, row_of_copy_F).view(num_tokens, top_k, grad_PD.shape[1])
        return _sum_over_copies(grad_TKD), None, None, None


class _CombineRows(torch.autograd.Function):
    """``y[t] = sum_k w[t, k] * rows[row_of_copy[t, k]]`` over kept copies, in the rows' dtype.

    On CPU the forward is one fused ``embedding_bag``; elsewhere the copies are gathered into
    [T, K, D] and summed by a batched matmul (sync-free). The backward writes each row's
    gradient by a gather over tokens (``source_token``) times the row's weight, instead of
    ``index_add`` (a slow scatter on CPU); padding rows and dropped copies get weight zero.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        rows_PD: Tensor,
        source_token_P: Tensor,
        row_of_copy_F: Tensor,
        weight_TK: Tensor,
        kept_F: Tensor | None,
    ) -> Tensor:
        num_tokens, top_k = weight_TK.shape
        ctx.fused = _fused_gather_sum_applies(rows_PD)
        if ctx.fused:
            # The backward gathers the rows again for the weight gradient.
            ctx.save_for_backward(rows_PD, source_token_P, row_of_copy_F, weight_TK, kept_F)
            if kept_F is None:
                return F.embedding_bag(
                    row_of_copy_F.view(num_tokens, top_k),
                    rows_PD.contiguous(),
                    mode="sum",
                    per_sample_weights=weight_TK,
                )
            # One bag of kept copies per token, so dropped rows are never read (they may hold
            # NaN). The boolean selects read the kept count on the host: free on CPU. With
            # every copy kept this sums exactly as the dropless call above.
            kept_per_token_T = kept_F.view(num_tokens, top_k).sum(1)
            return F.embedding_bag(
                row_of_copy_F[kept_F],
                rows_PD.contiguous(),
                torch.cumsum(kept_per_token_T, 0) - kept_per_token_T,
                mode="sum",
                per_sample_weights=weight_TK.reshape(-1)[kept_F],
            )
        rows_TKD = rows_PD.index_select(0, row_of_copy_F).view(num_tokens, top_k, rows_PD.shape[1])
        if kept_F is not None:
            # A select, not a multiply: dropped rows may hold anything, NaN included.
            rows_TKD.masked_fill_(~kept_F.view(num_tokens, top_k, 1), 0)
        ctx.save_for_backward(rows_TKD, source_token_P, row_of_copy_F, weight_TK, kept_F)
        # [T, 1, K] @ [T, K, D]: the weighted sum over k, accumulated by the matmul kernel.
        return torch.bmm(weight_TK.unsqueeze(1), rows_TKD).squeeze(1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx, grad_TD: Tensor
    ) -> tuple[Tensor | None, None, None, Tensor | None, None]:
        rows, source_token_P, row_of_copy_F, weight_TK, kept_F = ctx.saved_tensors
        num_tokens, top_k = weight_TK.shape
        grad_rows_PD = grad_weight_TK = None
        if ctx.needs_input_grad[3]:
            rows_TKD = rows
            if ctx.fused:
                rows_TKD = rows.index_select(0, row_of_copy_F).view(
                    num_tokens, top_k, rows.shape[1]
                )
                if kept_F is not None:
                    rows_TKD.masked_fill_(~kept_F.view(num_tokens, top_k, 1), 0)
            # Dropped copies' rows were zeroed, so their weight gradient is zero.
            grad_weight_TK = torch.bmm(rows_TKD, grad_TD.unsqueeze(2)).squeeze(2)
        if ctx.needs_input_grad[0]:
            num_rows, dim = source_token_P.shape[0], grad_TD.shape[1]
            weight_F = weight_TK.reshape(-1)
            if kept_F is not None:
                weight_F = weight_F.masked_fill(~kept_F, 0)
            weight_of_row_P = weight_F.new_zeros(num_rows).index_copy_(0, row_of_copy_F, weight_F)
            if num_tokens == 0:
                grad_rows_PD = grad_TD.new_zeros(num_rows, dim)
            else:
                # Padding rows (source T) read token T-1 and are multiplied by weight zero.
                source_in_range_P = source_token_P.clamp(max=num_tokens - 1)
                # Out of place: an in-place broadcast multiply is much slower in bf16 on CPU.
                grad_rows_PD = torch.mul(
                    grad_TD.index_select(0, source_in_range_P), weight_of_row_P.unsqueeze(1)
                )
        return grad_rows_PD, None, None, grad_weight_TK, None


def _check_backend(caller: str, backend: str) -> None:
    if backend not in PERMUTE_BACKENDS:
        raise ValueError(
            f"{caller}: backend={backend!r} is not a permute backend; valid: "
            f"{', '.join(PERMUTE_BACKENDS)}"
        )


def permute(
    x_TD: Tensor,
    topk_idx_TK: Tensor,
    num_experts: int,
    keep_TK: Tensor | None = None,
    group_alignment: int = 1,
    backend: PermuteBackend = "torch",
    tokens_per_expert_E: Tensor | None = None,
) -> tuple[Tensor, Permutation]:
    """Copy each token once per chosen expert, grouped by expert (stable within an expert).

    Args:
        x_TD: [T, D] tokens.
        topk_idx_TK: [T, K] expert of each copy, in ``[0, num_experts)`` (not checked on device).
        num_experts: E.
        keep_TK: optional [T, K] bool; copies with False are dropped: placed after every
            expert's rows (past ``offsets[-1]``) and not counted in ``tokens_per_expert``.
        group_alignment: pad each expert's group with zero rows to a multiple of this.
        backend: how rows are moved, one of ``PERMUTE_BACKENDS`` (the layout is the same).
        tokens_per_expert_E: optional [E] int64 kept copies per expert, when the caller has
            counted them already (e.g. the router's histogram, capped by a capacity): saves
            counting again. Must be the counts of ``topk_idx`` and ``keep`` (not checked).

    Returns:
        ``(x_perm_PD, permutation)`` with always P = T*K + E*(group_alignment-1) rows,
        differentiable wrt ``x_TD``.
    """
    _check_permute_args(x_TD, topk_idx_TK, num_experts, keep_TK, group_alignment, backend)

    num_tokens, top_k = topk_idx_TK.shape
    expert_of_copy_F, kept_copies_F = _bucket_of_copies(topk_idx_TK, num_experts, keep_TK)
    copy_of_sorted_S = torch.argsort(expert_of_copy_F, stable=True)
    copies_per_bucket, tokens_per_expert_E = _count_copies(
        expert_of_copy_F, num_experts, num_tokens * top_k, tokens_per_expert_E
    )
    row_of_copy_F, rows_per_expert_E, source_token_P = _rows_of_copies(
        expert_of_copy_F,
        copy_of_sorted_S,
        copies_per_bucket,
        tokens_per_expert_E,
        num_tokens,
        top_k,
        group_alignment,
    )
    x_perm_PD = _gather_rows(x_TD, source_token_P, row_of_copy_F, top_k, backend)

    permutation = Permutation(
        source_token=source_token_P,
        row_of_copy=row_of_copy_F,
        tokens_per_expert=tokens_per_expert_E,
        rows_per_expert=rows_per_expert_E,
        offsets=torch.cumsum(rows_per_expert_E, 0).to(torch.int32),
        num_tokens=num_tokens,
        top_k=top_k,
        kept_copies=kept_copies_F,
    )
    return x_perm_PD, permutation


def _check_permute_args(
    x_TD: Tensor,
    topk_idx_TK: Tensor,
    num_experts: int,
    keep_TK: Tensor | None,
    group_alignment: int,
    backend: PermuteBackend,
) -> None:
    """Raise ValueError (one line) for arguments `permute` cannot take."""
    if x_TD.dim() != 2:
        raise ValueError(f"permute: x must be 2-D [T, D], got shape {tuple(x_TD.shape)}")
    if topk_idx_TK.dim() != 2 or topk_idx_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"permute: topk_idx must be [T, K] with T={x_TD.shape[0]} (from x), got shape "
            f"{tuple(topk_idx_TK.shape)}"
        )
    if keep_TK is not None and (keep_TK.shape != topk_idx_TK.shape or keep_TK.dtype != torch.bool):
        raise ValueError(
            f"permute: keep must be a bool tensor shaped like topk_idx {tuple(topk_idx_TK.shape)}, "
            f"got {keep_TK.dtype} {tuple(keep_TK.shape)}"
        )
    if num_experts < 1:
        raise ValueError(f"permute: num_experts={num_experts} must be at least 1")
    if group_alignment < 1:
        raise ValueError(f"permute: group_alignment={group_alignment} must be at least 1")
    _check_backend("permute", backend)


def _bucket_of_copies(
    topk_idx_TK: Tensor, num_experts: int, keep_TK: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """The [T*K] bucket of each copy (its expert, or E when dropped) and the flat keep mask."""
    expert_of_copy_F = topk_idx_TK.reshape(-1).to(torch.int64)
    kept_copies_F = None
    if keep_TK is not None:
        kept_copies_F = keep_TK.reshape(-1)
        # Dropped copies go to an extra bucket E, sorted after all real experts.
        expert_of_copy_F = torch.where(
            kept_copies_F, expert_of_copy_F, torch.full_like(expert_of_copy_F, num_experts)
        )
    return expert_of_copy_F, kept_copies_F


def _count_copies(
    expert_of_copy_F: Tensor,
    num_experts: int,
    num_copies: int,
    tokens_per_expert_E: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Copies per bucket [E+1] (the last one dropped) and kept copies per expert [E] (int64).

    Counts the buckets unless the caller passed ``tokens_per_expert_E``.
    """
    if tokens_per_expert_E is None:
        device = expert_of_copy_F.device
        copies_per_bucket = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
        copies_per_bucket.scatter_add_(0, expert_of_copy_F, torch.ones_like(expert_of_copy_F))
        tokens_per_expert_E = copies_per_bucket[:num_experts].clone()
    else:
        tokens_per_expert_E = tokens_per_expert_E.to(torch.int64)
        dropped = (num_copies - tokens_per_expert_E.sum()).reshape(1)
        copies_per_bucket = torch.cat([tokens_per_expert_E, dropped])
    return copies_per_bucket, tokens_per_expert_E


def _gather_rows(
    x_TD: Tensor,
    source_token_P: Tensor,
    row_of_copy_F: Tensor,
    top_k: int,
    backend: PermuteBackend,
) -> Tensor:
    """The [P, D] permuted rows of ``x_TD``, moved by ``backend``; differentiable."""
    if backend == "triton":
        return import_kernels("triton_permute", "permute").gather_rows(
            x_TD, source_token_P, row_of_copy_F, top_k
        )
    return _GatherRows.apply(x_TD, source_token_P, row_of_copy_F, top_k)


def _rows_of_copies(
    expert_of_copy_F: Tensor,
    copy_of_sorted_S: Tensor,
    copies_per_bucket: Tensor,
    tokens_per_expert_E: Tensor,
    num_tokens: int,
    top_k: int,
    group_alignment: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Where each copy goes: ``(row_of_copy_F, rows_per_expert_E, source_token_P)``, each
    expert's group padded with rows of token `num_tokens` (a zero row) to a multiple of
    `group_alignment`. `copies_per_bucket` counts the kept copies of each expert
    (`tokens_per_expert_E`), then the dropped ones (bucket E)."""
    num_experts = tokens_per_expert_E.numel()
    num_copies = expert_of_copy_F.numel()
    device = expert_of_copy_F.device
    if group_alignment == 1:
        row_of_copy_F = torch.empty_like(copy_of_sorted_S).scatter_(
            0, copy_of_sorted_S, torch.arange(num_copies, device=device)
        )
        return row_of_copy_F, tokens_per_expert_E, copy_of_sorted_S // top_k
    rows_per_bucket = copies_per_bucket.clone()
    rows_per_bucket[:num_experts] = (
        (tokens_per_expert_E + group_alignment - 1) // group_alignment * group_alignment
    )
    rows_per_expert_E = rows_per_bucket[:num_experts].clone()
    # A copy's row: the start of its bucket's (padded) group plus its rank in the bucket.
    first_sorted_B = torch.cumsum(copies_per_bucket, 0) - copies_per_bucket
    group_start_B = torch.cumsum(rows_per_bucket, 0) - rows_per_bucket
    bucket_of_sorted_S = expert_of_copy_F.index_select(0, copy_of_sorted_S)
    rank_S = torch.arange(num_copies, device=device) - first_sorted_B.index_select(
        0, bucket_of_sorted_S
    )
    row_of_sorted_S = group_start_B.index_select(0, bucket_of_sorted_S) + rank_S
    row_of_copy_F = torch.empty_like(row_of_sorted_S).scatter_(0, copy_of_sorted_S, row_of_sorted_S)
    num_rows = num_copies + num_experts * (group_alignment - 1)
    source_token_P = torch.full((num_rows,), num_tokens, dtype=torch.int64, device=device)
    source_token_P.scatter_(0, row_of_sorted_S, copy_of_sorted_S // top_k)
    return row_of_copy_F, rows_per_expert_E, source_token_P


def unpermute(
    y_PD: Tensor,
    permutation: Permutation,
    topk_weight_TK: Tensor,
    backend: PermuteBackend = "torch",
) -> Tensor:
    """Sum each token's kept copies back: ``y[t] = sum_k w[t, k] * y_perm[row of (t, k)]``.

    Dropped copies contribute exactly zero (even if their rows hold NaN) and get zero gradient.
    Computed in the dtype of ``y_PD``; the weights are cast to it. Differentiable wrt ``y_PD``
    and ``topk_weight_TK``.

    Args:
        y_PD: [P, D] expert outputs in permuted order (P rows as ``permute`` gave).
        permutation: what ``permute`` returned.
        topk_weight_TK: [T, K] routing weights.
        backend: how rows are moved, one of ``PERMUTE_BACKENDS``.

    Returns:
        [T, D].
    """
    _check_backend("unpermute", backend)
    num_tokens, top_k = permutation.num_tokens, permutation.top_k
    num_rows = permutation.source_token.shape[0]
    if y_PD.dim() != 2 or y_PD.shape[0] != num_rows:
        raise ValueError(
            f"unpermute: y must be [P, D] with P={num_rows} rows (as permute gave), got shape "
            f"{tuple(y_PD.shape)}"
        )
    if tuple(topk_weight_TK.shape) != (num_tokens, top_k):
        raise ValueError(
            f"unpermute: topk_weight must be [T, K]=[{num_tokens}, {top_k}], got shape "
            f"{tuple(topk_weight_TK.shape)}"
        )
    weight_TK = topk_weight_TK.to(y_PD.dtype)
    if backend == "triton":
        return import_kernels("triton_permute", "unpermute").combine_rows(
            y_PD, permutation.row_of_copy, weight_TK, permutation.kept_copies
        )
    return _CombineRows.apply(
        y_PD, permutation.source_token, permutation.row_of_copy, weight_TK, permutation.kept_copies
    )
