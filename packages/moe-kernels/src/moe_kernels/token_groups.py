"""Rows grouped by expert (``offsets_E``: each group's cumulative row end) spread so that every
group starts at a multiple of an alignment, as the quantizers that scale per block of a
group's rows and the FP8 weight-gradient GEMMs need.

Shape suffixes: T rows, D columns, E groups.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_of_rows(num_rows: int, offsets_E: Tensor) -> Tensor:
    """[T] int64 group of each row: g for rows in ``offsets[g-1]:offsets[g]``, E past the end."""
    row_T = torch.arange(num_rows, device=offsets_E.device)
    return torch.searchsorted(offsets_E.long(), row_T, right=True)


def pad_token_groups(
    x_TD: Tensor, offsets_E: Tensor, alignment: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Rows scattered so that every group starts at a multiple of ``alignment`` (zero rows
    between); rows past ``offsets[-1]`` follow as a group of their own. The buffer has a static
    size, T + E (alignment - 1) rounded up to the alignment, so there is no host sync.

    Returns (padded rows, [E] int64 padded group ends, [T] destination row of each input row).
    """
    num_rows = x_TD.shape[0]
    ends_E = offsets_E.long()
    counts_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    padded_counts_E = (counts_E + alignment - 1) // alignment * alignment
    padded_ends_E = torch.cumsum(padded_counts_E, 0)
    shift_E = (padded_ends_E - padded_counts_E) - (ends_E - counts_E)
    trailing_shift = padded_ends_E[-1:] - ends_E[-1:]
    group_T = group_of_rows(num_rows, offsets_E)
    destination_T = torch.arange(num_rows, device=x_TD.device)
    destination_T = destination_T + torch.cat([shift_E, trailing_shift])[group_T]
    capacity = num_rows + offsets_E.shape[0] * (alignment - 1)
    capacity = (capacity + alignment - 1) // alignment * alignment
    padded = x_TD.new_zeros(capacity, x_TD.shape[1]).index_copy_(0, destination_T, x_TD)
    return padded, padded_ends_E, destination_T
