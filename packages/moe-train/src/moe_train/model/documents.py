"""Attention kept inside each document of packed sequences, in memory linear in their length.

B batch, H heads, S positions, D channels per head.

A packed sequence holds several documents, each ended by an end-of-document token. Each
document is attended to on its own, by the causal kernel (`scaled_dot_product_attention`
with `is_causal`): no S x S mask is built, and the kernels that compute attention block by
block (flash attention on the CPU and on GPUs) never hold the S x S scores either. Where the
documents end is found once per micro-batch on the host, from the token rows the data loader
gives, so that the device never waits for a copy back.

Chosen by measurement on the CPU (one attention layer, forward and backward, 4 heads of 32
channels; `benchmarks/document_masking.py` measures whole training steps): a boolean S x S
mask takes the kernel's unblocked path, which is slower than one causal call per document at
every size tried, from 256 documents of 8 tokens to 4 documents of 2,048. FlexAttention has
no backward on the CPU, so it could not serve as the CPU path of the same algorithm.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Documents:
    """Where the documents of each row of packed sequences end."""

    ends: tuple[tuple[int, ...], ...]
    """Per row, the end (exclusive) of each of its documents, ascending; the last is the row's
    length. An end-of-document token belongs to the document it ends."""

    @classmethod
    def of(cls, tokens_BS: Tensor, eos_id: int) -> Documents:
        """The documents of token rows [B, S] held on the host (a device tensor would make
        the device wait for the copy: find them on the rows before they go to the device)."""
        if tokens_BS.device.type != "cpu":
            raise ValueError("Documents.of reads token rows on the host; pass the CPU rows")
        length = tokens_BS.shape[1]
        ends = []
        for row in tokens_BS:
            after_eos = ((row == eos_id).nonzero().flatten() + 1).tolist()
            ends.append((*(e for e in after_eos if e < length), length))
        return cls(tuple(ends))

    def ids(self) -> Tensor:
        """The document of each position [B, S] (int64), counted from 0 in each row."""
        rows = []
        for ends in self.ends:
            lengths = torch.tensor([ends[0], *(b - a for a, b in itertools.pairwise(ends))])
            rows.append(torch.repeat_interleave(torch.arange(len(ends)), lengths))
        return torch.stack(rows)

    def attend(self, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, *, gqa: bool) -> Tensor:
        """Causal attention of each document to itself alone: [B, H, S, D] like `q_BHSD`.
        Rows that split alike run together (all of them when no row holds an end-of-document
        token before its last position)."""
        if len(self.ends) != q_BHSD.shape[0] or any(e[-1] != q_BHSD.shape[2] for e in self.ends):
            raise ValueError(
                f"documents of {len(self.ends)} rows do not fit attention inputs of shape "
                f"{tuple(q_BHSD.shape)}"
            )
        if len(set(self.ends)) == 1:
            return _attend_pieces(q_BHSD, k_BHSD, v_BHSD, self.ends[0], gqa)
        rows = [
            _attend_pieces(q_BHSD[b : b + 1], k_BHSD[b : b + 1], v_BHSD[b : b + 1], ends, gqa)
            for b, ends in enumerate(self.ends)
        ]
        return torch.cat(rows)


def _attend_pieces(
    q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, ends: tuple[int, ...], gqa: bool
) -> Tensor:
    """Causal attention within each piece [start, end) of the sequence dimension."""
    pieces, start = [], 0
    for end in ends:
        pieces.append(
            F.scaled_dot_product_attention(
                q_BHSD[:, :, start:end],
                k_BHSD[:, :, start:end],
                v_BHSD[:, :, start:end],
                is_causal=True,
                enable_gqa=gqa,
            )
        )
        start = end
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
