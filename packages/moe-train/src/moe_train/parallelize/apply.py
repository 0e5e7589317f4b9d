"""A rank's part of a parallel layout, made from the single-process model after construction.

The model (`moe_train.model`) knows nothing of processes; these functions fill its hooks
with the layout's: each MoE layer's dispatcher, the attention core and `SequencePart` of
context parallelism, and drop what other pipeline stages hold.

Build the model on the meta device (`torch.device("meta")`: shapes, no storage), apply the
layout, then materialise only what the rank holds:

```
with torch.device("meta"):
    model = Transformer(config.model)
apply_expert_parallel(model, dispatchers)                   # the rank's experts
apply_context_parallel(model, shard)                         # the rank's part of sequences
apply_pipeline_split(model, layers, first=..., last=...)     # the rank's stages
materialize(model, device, seed)                             # allocate and initialise
```

Each tensor is initialised from its global name (and global expert index), so values equal
the single-process model's whatever the layout, and no rank allocates more than its share.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from moe_train.model import Router, Transformer
from moe_train.model.attention import Attention
from moe_train.model.exchange_worker import ExchangeWorker
from moe_train.model.moe_overlap import OVERLAP_CHUNKS
from moe_train.parallelize.context_parallel import ContextShard
from moe_train.parallelize.dispatchers import DispatcherFactory


def apply_expert_parallel(model: Transformer, dispatchers: DispatcherFactory) -> None:
    """Give every MoE layer its dispatcher (`dispatchers(layer index)`) and keep only the
    experts that dispatcher's rank holds."""
    for index, layer in model.moe_layers().items():
        layer.use_dispatcher(dispatchers(index))


def apply_exchange_overlap(
    model: Transformer, worker: ExchangeWorker, chunks: int = OVERLAP_CHUNKS
) -> None:
    """Run every MoE layer's routed experts in `chunks` chunks whose token exchanges run on
    `worker` while the experts compute another chunk (`moe_train.model.moe_overlap`)."""
    for layer in model.moe_layers().values():
        layer.exchange_worker, layer.exchange_chunks = worker, chunks


def apply_context_parallel(model: Transformer, shard: ContextShard) -> None:
    """Make `model` run on this rank's part of each sequence (`shard`, see
    `moe_train.parallelize.context_parallel`): its inputs and targets are the rank's
    positions (`Transformer.sequence`), attention gathers the keys and values of the whole
    sequence (`Attention.core`), and the routers' balancing losses count the tokens of every
    rank of the shard's group (`Router.sequence`)."""
    model.sequence = shard
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = shard.attend
        elif isinstance(module, Router):
            module.sequence = shard


def apply_pipeline_split(
    model: Transformer, layers: Iterable[int], *, first: bool, last: bool
) -> None:
    """Keep only the blocks `layers` (global indices), the embedding if `first` and the final
    norm, head and MTP modules if `last`; parameter names stay global. (Tied embeddings cannot be split:
    `Config.validate` refuses them with pipeline stages.)"""
    kept = {str(i) for i in layers}
    unknown = sorted(int(name) for name in kept - set(model.blocks))
    if unknown:
        raise ValueError(f"layers {unknown} are not among the model's blocks")
    for name in [name for name in model.blocks if name not in kept]:
        del model.blocks[name]
    if not first:
        model.embed = None
    if not last:
        model.norm = None
        model.head = None
        model.mtp = nn.ModuleDict()


@torch.no_grad()
def materialize(model: Transformer, device: torch.device | str, seed: int) -> None:
    """Allocate the meta tensors of `model` on `device` and initialise them
    (`Transformer.init_weights`, whose values do not depend on the device). Parameters keep
    their attributes (the expert marks) and their sharing (tied embeddings)."""
    allocated: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in allocated:
                fresh = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
                fresh.__dict__.update(param.__dict__)
                allocated[id(param)] = fresh
            setattr(module, name, allocated[id(param)])
        for name, buffer in module.named_buffers(recurse=False):
            module.register_buffer(
                name,
                torch.empty_like(buffer, device=device),
                persistent=name not in module._non_persistent_buffers_set,
            )
    model.init_weights(seed)
