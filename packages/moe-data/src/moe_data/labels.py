"""Label masks: which target tokens a step trains on.

A prepared directory may hold, beside each token shard `tokens-NNNNNN.bin`, a mask shard
`mask-NNNNNN.bin`: one byte per token, 1 where the token is a training target (an assistant's
reply), 0 where it is not (a prompt, a system message). Its meta.json says so with
`"label_mask": true`.

In a batch (int64 ids [rows, seq_len + 1]) read with masks, a token that is not a training
target is stored as `-1 - id`, so the batch stays one tensor through reading ahead, the
split into micro-batches and the pipeline; `inputs_and_targets` turns a micro-batch into the
model's inputs (the ids) and targets (IGNORE_INDEX where nothing is trained).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

IGNORE_INDEX = -100
"""A target that no loss is computed for."""
LABEL_MASK_KEY = "label_mask"
"""The meta.json key saying the directory holds mask shards."""


def mask_file_name(index: int) -> str:
    """File name of mask shard `index` in a v2 directory (beside `tokens-NNNNNN.bin`)."""
    return f"mask-{index:06d}.bin"


def mask_file_of(token_file: str) -> str:
    """The mask shard beside token shard `token_file` (tokens-NNNNNN.bin -> mask-NNNNNN.bin)."""
    return "mask-" + token_file.removeprefix("tokens-")


def encode_masked(ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """`ids` (int64) with each token whose `trained` flag is 0 stored as `-1 - id`."""
    return np.where(trained.astype(bool), ids, -1 - ids)


def token_ids(tokens: Tensor) -> Tensor:
    """The ids of tokens read with masks (an untrained token's `-1 - id` decoded)."""
    import torch

    return torch.where(tokens < 0, -1 - tokens, tokens)


def inputs_and_targets(tokens_BS1: Tensor) -> tuple[Tensor, Tensor]:
    """Inputs [B, S] and targets [B, S] of a batch read with masks: the ids, and the next
    ids with IGNORE_INDEX where that token is not trained on."""
    import torch

    inputs = token_ids(tokens_BS1[..., :-1])
    targets = tokens_BS1[..., 1:]
    targets = torch.where(targets < 0, torch.full_like(targets, IGNORE_INDEX), targets)
    return inputs, targets


def trained_targets(tokens_BS1: Tensor) -> Tensor:
    """How many targets of a batch read with masks are trained on (an int64 tensor)."""
    return (tokens_BS1[..., 1:] >= 0).sum()
