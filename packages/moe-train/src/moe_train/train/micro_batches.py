"""This rank's share of a step's global batch, as the micro-batches it trains on."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_data import inputs_and_targets, token_ids
from moe_train.model import Documents
from moe_train.parallelize import ContextShard


@dataclass(frozen=True)
class MicroBatches:
    """Micro-batches of token rows, with the documents of each when attention stays inside
    documents (data.document_masking)."""

    tokens: torch.Tensor
    """[n, mbs, seq+1] on the rank's device: inputs are [..., :-1], targets [..., 1:]."""
    documents: tuple[Documents, ...] | None = None
    """Per micro-batch, where the documents of its inputs end (found on the host)."""

    @classmethod
    def of(
        cls,
        rows: torch.Tensor,
        shape: tuple[int, int, int],
        device: torch.device,
        eos_id: int | None,
    ) -> MicroBatches:
        """`rows` (on the host) viewed as micro-batches of `shape` and copied to `device`
        (overlapping compute from pinned memory); with `eos_id`, the documents of each."""
        micro_batches = rows.view(shape)
        documents = None
        if eos_id is not None:  # (token_ids reads the ids under a label mask too)
            documents = tuple(
                Documents.of(token_ids(micro[:, :-1]), eos_id) for micro in micro_batches
            )
        return cls(micro_batches.to(device, non_blocking=rows.is_pinned()), documents)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, Documents | None]]:
        """Each micro-batch [mbs, seq+1] with its documents (None without masking)."""
        for index, micro in enumerate(self.tokens):
            yield micro, self.documents[index] if self.documents is not None else None


def model_inputs(
    tokens: torch.Tensor, masked: bool, context: ContextShard | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets [..., S] of token rows [..., S + 1] (with IGNORE_INDEX targets
    where a label mask says so when `masked`); under context parallelism (`context`), this
    rank's positions [..., 2 C] of them."""
    if masked:
        inputs, targets = inputs_and_targets(tokens)
    else:
        inputs, targets = tokens[..., :-1], tokens[..., 1:]
    if context is None:
        return inputs, targets
    rows = inputs.shape[:-1]
    inputs, targets = (context.local(t.reshape(-1, t.shape[-1])) for t in (inputs, targets))
    return inputs.view(*rows, -1), targets.view(*rows, -1)
