"""What a checkpoint holds of a rank's training state: global tensors, whatever the layout.

Tensor names: the model's own (`blocks.3.ffn.experts.w_down_EHD`, with every expert) and
`optim.exp_avg.<param>`, `optim.exp_avg_sq.<param>` for AdamW (`optim.momentum.<param>` for
a parameter that Muon updates), `optim.step.<param>`. Owners:
dense tensors are written by dp rank 0; expert tensors by the ranks of expert-data-parallel
rank 0, each its own experts' rows. Every rank loads what it holds.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from moe_checkpoint import CheckpointError, OwnedSlice, SliceRequest, load_into, load_slices
from moe_parallel import Layout, StateRequest, TrainingOptimizer, is_expert_parameter
from moe_train.model import Transformer


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


def _global_placement(model: Transformer, name: str) -> tuple[tuple[int, ...], int]:
    """Global shape of parameter `name` and the global flat offset of this rank's part."""
    param = model.get_parameter(name)
    if not is_expert_parameter(param):
        return tuple(param.shape), 0
    num_experts = model.config.moe.num_experts
    return (num_experts, *param.shape[1:]), _first_expert(model, name) * param[0].numel()


def _optimizer_slices(
    model: Transformer, optimizer: TrainingOptimizer, layout: Layout
) -> list[OwnedSlice]:
    """The moments this rank owns (each element has exactly one owner), the step count, and
    the FP32 master weights of parameters of a lower precision (the model tensors saved)."""
    slices = []
    for piece in optimizer.state_pieces():
        global_shape, offset = _global_placement(model, piece.name)
        if model.get_parameter(piece.name).dtype != torch.float32:
            slices.append(
                OwnedSlice(piece.name, global_shape, offset + piece.flat_start, piece.param)
            )
        for key, tensor in piece.moments().items():
            slices.append(
                OwnedSlice(
                    f"optim.{key}.{piece.name}", global_shape, offset + piece.flat_start, tensor
                )
            )
    if layout.dp_rank == 0:  # one scalar per parameter: written once
        step = torch.tensor(float(optimizer.step_count))
        for name, param in model.named_parameters():
            if param.requires_grad:
                slices.append(OwnedSlice.whole(f"optim.step.{name}", step))
    return slices


def model_slices(model: Transformer, layout: Layout, *, owned_only: bool) -> list[OwnedSlice]:
    """Parameters and buffers this rank holds (`owned_only`: those it writes; parameters of
    a lower precision than FP32 are written from the optimizer's FP32 masters instead)."""
    num_experts = model.config.moe.num_experts
    slices = []
    for name, tensor in _named_state(model):
        is_param = isinstance(tensor, nn.Parameter)
        expert = is_param and is_expert_parameter(tensor)
        owner = layout.edp_rank == 0 if expert else layout.dp_rank == 0
        if owned_only and (not owner or (is_param and tensor.dtype != torch.float32)):
            continue
        slices.append(_slice(model, name, tensor, num_experts, expert))
    return slices


def saved_slices(
    model: Transformer, optimizer: TrainingOptimizer, layout: Layout
) -> list[OwnedSlice]:
    """What this rank writes into a checkpoint: its owned model and optimizer pieces."""
    return model_slices(model, layout, owned_only=True) + _optimizer_slices(
        model, optimizer, layout
    )


def load_training_state(
    ckpt_dir: Path, model: Transformer, optimizer: TrainingOptimizer, layout: Layout
) -> str | None:
    """Fill this rank's model and optimizer state from `ckpt_dir` (any saving layout).

    Collective (the distributed optimizer gathers the loaded shards): every rank reaches the
    same collectives even when its reads fail, and gets back its error message (a checksum,
    size or name mismatch) instead of an exception, for the caller to share with the others.
    """
    return _load(ckpt_dir, model, optimizer, layout, with_optimizer=True)


def load_model_state(
    ckpt_dir: Path, model: Transformer, optimizer: TrainingOptimizer, layout: Layout
) -> str | None:
    """Fill this rank's model tensors from `ckpt_dir` and restart its optimizer at step 0
    with zero moments (master weights read from `ckpt_dir` too). Collective and error-sharing
    like `load_training_state`."""
    return _load(ckpt_dir, model, optimizer, layout, with_optimizer=False)


def _load(
    ckpt_dir: Path,
    model: Transformer,
    optimizer: TrainingOptimizer,
    layout: Layout,
    *,
    with_optimizer: bool,
) -> str | None:
    errors: list[str] = []

    def guarded(read: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
        if errors:
            return fallback()
        try:
            return read()
        except CheckpointError as e:
            errors.append(str(e))
            return fallback()

    guarded(lambda: load_into(ckpt_dir, model_slices(model, layout, owned_only=False)), list)
    step = 0
    if with_optimizer:
        first_param = next(name for name, p in model.named_parameters() if p.requires_grad)
        (saved_step,) = guarded(
            lambda: load_slices(ckpt_dir, [SliceRequest.whole(f"optim.step.{first_param}", ())]),
            lambda: [torch.zeros(())],
        )
        step = int(saved_step.item())

    def read(requests: list[StateRequest]) -> list[Tensor]:
        values = [torch.zeros(r.numel) for r in requests]
        wanted = [i for i, r in enumerate(requests) if with_optimizer or r.kind == "param"]
        slice_requests = []
        for i in wanted:
            request = requests[i]
            global_shape, offset = _global_placement(model, request.name)
            name = (
                request.name if request.kind == "param" else f"optim.{request.kind}.{request.name}"
            )
            slice_requests.append(
                SliceRequest(name, global_shape, offset + request.flat_start, request.numel)
            )
        loaded = guarded(lambda: load_slices(ckpt_dir, slice_requests), lambda: None)
        for i, value in zip(wanted, loaded or [], strict=False):
            values[i] = value
        return values

    optimizer.load_state(step, read)
    return errors[0] if errors else None


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
