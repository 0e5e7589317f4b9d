"""pad_token_groups against a row-by-row reference: every group starts at a multiple of the
alignment, rows keep their order, the gaps are zero, and the buffer's size depends only on the
shapes (no host sync)."""

from __future__ import annotations

import pytest
import torch

from moe_kernels.token_groups import group_of_rows, pad_token_groups


def _reference(x_TD: torch.Tensor, ends: list[int], alignment: int) -> tuple[list[int], list[int]]:
    """Padded group ends and each row's destination, group by group (past-the-end rows last)."""
    padded_ends, destinations, start, padded_start = [], [], 0, 0
    for end in [*ends, x_TD.shape[0]]:
        destinations += [padded_start + i for i in range(end - start)]
        count = -(-(end - start) // alignment) * alignment
        padded_ends.append(padded_start + count)
        start, padded_start = end, padded_start + count
    return padded_ends[:-1], destinations


@pytest.mark.parametrize(
    ("ends", "num_rows", "alignment"),
    [
        ([3, 3, 10, 17], 17, 16),  # an empty group
        ([0, 5], 9, 8),  # an empty first group, rows past the end
        ([32, 64], 64, 32),  # already aligned
        ([1], 1, 1),
    ],
)
def test_groups_start_aligned_in_a_buffer_of_static_size(ends, num_rows, alignment):
    x_TD = torch.randn(num_rows, 3, dtype=torch.float64)
    offsets_E = torch.tensor(ends, dtype=torch.int32)
    padded, padded_ends_E, destination_T = pad_token_groups(x_TD, offsets_E, alignment)
    want_ends, want_destinations = _reference(x_TD, ends, alignment)
    assert padded_ends_E.tolist() == want_ends
    assert destination_T.tolist() == want_destinations
    capacity = -(-(num_rows + len(ends) * (alignment - 1)) // alignment) * alignment
    assert padded.shape == (capacity, 3)
    assert torch.equal(padded[destination_T], x_TD)
    gaps = torch.ones(capacity, dtype=torch.bool)
    gaps[destination_T] = False
    assert not padded[gaps].any()


def test_group_of_rows_counts_past_the_end_rows_as_group_e():
    offsets_E = torch.tensor([2, 2, 5])
    assert group_of_rows(7, offsets_E).tolist() == [0, 0, 2, 2, 2, 3, 3]
