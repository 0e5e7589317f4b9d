"""Trainer checkpoints through moe-checkpoint: global tensors, whatever the layout.

Tensor names: the model's own (`blocks.3.ffn.experts.w_down_EHD`, with every expert) and
`optim.exp_avg.<param>`, `optim.exp_avg_sq.<param>`, `optim.step.<param>` for AdamW. Owners:
dense tensors are written by dp rank 0; expert tensors by the ranks of expert-data-parallel
rank 0, each its own experts' rows. Every rank loads what it holds.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from moe_checkpoint import OwnedSlice, load_into
from moe_parallel import Layout, is_expert_parameter
from moe_train.model import Transformer

OPTIM_STATES = ("exp_avg", "exp_avg_sq")


def category_of(name: str) -> str:
    """File prefix of a tensor: `optim` for optimizer state, `model` for the rest."""
    return "optim" if name.startswith("optim.") else "model"


def _named_state(model: Transformer) -> Iterator[tuple[str, Tensor]]:
    """Parameters and persistent buffers by global name, each storage once (tied weights)."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def _first_expert(model: Transformer, name: str) -> int:
    return model.get_submodule(name.rsplit(".", 1)[0]).first_expert


def _slice(
    model: Transformer, name: str, tensor: Tensor, num_experts: int, expert: bool
) -> OwnedSlice:
    if expert:
        global_shape = (num_experts, *tensor.shape[1:])
        return OwnedSlice.rows(name, global_shape, _first_expert(model, name), tensor.detach())
    return OwnedSlice.whole(name, tensor.detach())


def training_slices(
    model: Transformer, optimizer: torch.optim.Optimizer, layout: Layout, *, owned_only: bool
) -> list[OwnedSlice]:
    """The pieces of model and optimizer state this rank holds (`owned_only`: writes)."""
    num_experts = model.config.moe.num_experts
    slices = []
    for name, tensor in _named_state(model):
        expert = isinstance(tensor, nn.Parameter) and is_expert_parameter(tensor)
        owner = layout.edp_rank == 0 if expert else layout.dp_rank == 0
        if owned_only and not owner:
            continue
        slices.append(_slice(model, name, tensor, num_experts, expert))
        state = optimizer.state.get(tensor) if isinstance(tensor, nn.Parameter) else None
        if state is None:
            continue
        for key in OPTIM_STATES:
            piece = _slice(model, name, state[key], num_experts, expert)
            slices.append(
                OwnedSlice(f"optim.{key}.{name}", piece.global_shape, piece.flat_start, piece.data)
            )
        if not owned_only or layout.dp_rank == 0:  # one scalar: written once
            slices.append(OwnedSlice.whole(f"optim.step.{name}", state["step"].reshape(())))
    return slices


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state (zeros) for every parameter, so a checkpoint can fill it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in optimizer.state or not optimizer.state[p]:
                optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def load_training_state(
    ckpt_dir: Path, model: Transformer, optimizer: torch.optim.Optimizer, layout: Layout
) -> None:
    """Fill this rank's model and optimizer tensors from `ckpt_dir` (any saving layout)."""
    init_optimizer_state(optimizer)
    load_into(ckpt_dir, training_slices(model, optimizer, layout, owned_only=False))


def encode_rng_state() -> dict[str, Any]:
    """Torch's RNG states as JSON-able text (random routing draws from them)."""
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        buffer = io.BytesIO()
        torch.save(torch.cuda.get_rng_state_all(), buffer)
        state["cuda"] = base64.b64encode(buffer.getvalue()).decode()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    raw = base64.b64decode(state["cpu"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(torch.load(io.BytesIO(base64.b64decode(state["cuda"]))))
