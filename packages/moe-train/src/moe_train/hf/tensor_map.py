"""The hub layout's tensors and the checkpoint tensors they are cut from: `hub_tensors` lists
every tensor a family's state dict holds, each an `HFTensor` whose `take` is a view of its
source, and `checkpoint_shapes` gives the shapes of the checkpoint tensors those views tile.
`architectures.py` chooses the family; export reads through the views and import writes
through them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from moe_plan.config import ModelConfig


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the exported state dict, made from one tensor of our checkpoint."""

    name: str
    """Its name in the hub layout, e.g. ``model.layers.0.mlp.experts.3.up_proj.weight``."""
    source: str | None
    """The checkpoint tensor it is cut from, e.g. ``blocks.0.ffn.experts.w_gate_up_EDO``;
    None for an empty tensor (no elements)."""
    shape: tuple[int, ...]
    """Its shape."""
    take: Callable[[Tensor], Tensor]
    """Cuts it from the source tensor (from its row `row` when that is set) as a view: export
    copies out of the view, import copies into it."""
    row: int | None = None
    """The expert (row of the source tensor) it comes from: only that row is read."""
    keep_fp32: bool = False
    """Written in float32 whatever the export dtype (the target keeps it in fp32)."""


@dataclass(frozen=True)
class HubNames:
    """Where a family keeps its MoE tensors in the hub layout."""

    moe: str
    """The MoE block under a layer: ``mlp`` (``block_sparse_moe`` for Mixtral)."""
    gate_up_down: tuple[str, str, str]
    """An expert's gate, up and down projections: ``gate_proj``, ``up_proj``, ``down_proj``
    (``w1``, ``w3``, ``w2`` for Mixtral)."""
    shared: str | None = None
    """The shared-expert MLP under the MoE block (None: the family has none)."""
    shared_gate: bool = False
    """A ``shared_expert_gate`` beside it (Qwen2-MoE)."""
    fp32_router: bool = False
    """The router weight and selection bias are kept in fp32 (GLM-4-MoE)."""


_MLP = ("gate_proj", "up_proj", "down_proj")
QWEN3 = HubNames("mlp", _MLP)
GLM4 = HubNames("mlp", _MLP, shared="shared_experts", fp32_router=True)
OLMOE = HubNames("mlp", _MLP)
MIXTRAL = HubNames("block_sparse_moe", ("w1", "w3", "w2"))
QWEN2 = HubNames("mlp", _MLP, shared="shared_expert", shared_gate=True)


def _qk_norm_width(model: ModelConfig) -> tuple[int, int]:
    """The widths of the query and key norm weights."""
    head_dim = model.d_model // model.n_heads
    if model.qk_norm == "projection":
        return model.d_model, model.n_kv_heads * head_dim
    return head_dim, head_dim


def checkpoint_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The model tensors of our checkpoint (one name per storage: no ``head.weight`` when
    tied) and their shapes: what `hub_tensors`' sources are cut from."""
    d, moe = model.d_model, model.moe
    head_dim = d // model.n_heads
    kv, experts, hidden = model.n_kv_heads * head_dim, moe.num_experts, moe.expert_hidden
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (model.vocab_size, d)}
    for layer in range(model.n_layers):
        ours = f"blocks.{layer}"
        shapes[f"{ours}.attn_norm.weight"] = (d,)
        shapes[f"{ours}.attn.qkv.weight"] = (d + 2 * kv, d)
        if model.qkv_bias:
            shapes[f"{ours}.attn.qkv.bias"] = (d + 2 * kv,)
        shapes[f"{ours}.attn.out.weight"] = (d, d)
        if model.qk_norm:
            q_width, k_width = _qk_norm_width(model)
            shapes[f"{ours}.attn.q_norm.weight"] = (q_width,)
            shapes[f"{ours}.attn.k_norm.weight"] = (k_width,)
        shapes[f"{ours}.ffn_norm.weight"] = (d,)
        if layer < model.dense_layers:
            shapes[f"{ours}.ffn.gate_up.weight"] = (2 * model.dense_hidden, d)
            shapes[f"{ours}.ffn.down.weight"] = (d, model.dense_hidden)
            continue
        shapes[f"{ours}.ffn.router.expert_bias"] = (experts,)
        shapes[f"{ours}.ffn.router.gate.weight"] = (experts, d)
        shapes[f"{ours}.ffn.experts.w_gate_up_EDO"] = (experts, d, 2 * hidden)
        shapes[f"{ours}.ffn.experts.w_down_EHD"] = (experts, hidden, d)
        if moe.shared_experts:
            width = moe.shared_experts * hidden
            shapes[f"{ours}.ffn.shared.gate_up.weight"] = (2 * width, d)
            shapes[f"{ours}.ffn.shared.down.weight"] = (d, width)
        if moe.shared_expert_gate:
            shapes[f"{ours}.ffn.shared_gate.weight"] = (1, d)
    shapes["norm.weight"] = (d,)
    if not model.tie_embeddings:
        shapes["head.weight"] = (model.vocab_size, d)
    return shapes


def _rows(start: int, stop: int) -> Callable[[Tensor], Tensor]:
    return lambda t: t[start:stop]


def _gate(hidden: int) -> Callable[[Tensor], Tensor]:
    """An expert's gate projection [H, D] from its fused [D, 2H] weight (gate is the first half)."""
    return lambda t: t[:, :hidden].T


def _up(hidden: int) -> Callable[[Tensor], Tensor]:
    """An expert's up projection [H, D] from its fused [D, 2H] weight."""
    return lambda t: t[:, hidden:].T


def _transposed(t: Tensor) -> Tensor:
    return t.T


def _same(t: Tensor) -> Tensor:
    return t


def _swiglu(prefix: str, source: str, d: int, hidden: int) -> list[HFTensor]:
    """A dense SwiGLU: our fused gate_up rows are [gate; up] (the first half is the gate)."""
    return [
        HFTensor(f"{prefix}.gate_proj.weight", f"{source}.gate_up.weight", (hidden, d), _rows(0, hidden)),
        HFTensor(f"{prefix}.up_proj.weight", f"{source}.gate_up.weight", (hidden, d), _rows(hidden, 2 * hidden)),
        HFTensor(f"{prefix}.down_proj.weight", f"{source}.down.weight", (d, hidden), _same),
    ]  # fmt: skip


def _attention(model: ModelConfig, ours: str, hf: str) -> list[HFTensor]:
    """One layer's q, k, v and o projections (and q/k/v biases), cut from our fused qkv, and
    its QK-norm weights."""
    d = model.d_model
    kv = model.n_kv_heads * (d // model.n_heads)
    tensors = []
    for kind in ("weight", "bias") if model.qkv_bias else ("weight",):
        fused = f"{ours}.attn.qkv.{kind}"
        for name, start, rows in (("q", 0, d), ("k", d, kv), ("v", d + kv, kv)):
            shape = (rows, d) if kind == "weight" else (rows,)
            cut = _rows(start, start + rows)
            tensors.append(HFTensor(f"{hf}.self_attn.{name}_proj.{kind}", fused, shape, cut))
    tensors.append(
        HFTensor(f"{hf}.self_attn.o_proj.weight", f"{ours}.attn.out.weight", (d, d), _same)
    )
    if model.qk_norm:
        for name, width in zip(("q_norm", "k_norm"), _qk_norm_width(model), strict=True):
            source = f"{ours}.attn.{name}.weight"
            tensors.append(HFTensor(f"{hf}.self_attn.{name}.weight", source, (width,), _same))
    return tensors


_NORMS = {
    "input": ("input_layernorm.weight", "post_attention_layernorm.weight"),
    "output": ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
}
"""The hub names of a layer's attention and feed-forward norms, by `model.norm_placement`."""


def hub_tensors(model: ModelConfig, names: HubNames) -> list[HFTensor]:
    """Every tensor of the hub layout of `model` in a family keeping its MoE tensors at
    `names`, in order, each with the checkpoint tensor it is cut from."""
    d = model.d_model
    tensors = [HFTensor("model.embed_tokens.weight", "embed.weight", (model.vocab_size, d), _same)]
    for layer in range(model.n_layers):
        ours, hf = f"blocks.{layer}", f"model.layers.{layer}"
        attn_norm, ffn_norm = _NORMS[model.norm_placement]
        tensors.append(HFTensor(f"{hf}.{attn_norm}", f"{ours}.attn_norm.weight", (d,), _same))
        tensors += _attention(model, ours, hf)
        tensors.append(HFTensor(f"{hf}.{ffn_norm}", f"{ours}.ffn_norm.weight", (d,), _same))
        if layer < model.dense_layers:
            tensors += _swiglu(f"{hf}.mlp", f"{ours}.ffn", d, model.dense_hidden)
        else:
            tensors += _moe_block(model, names, ours, f"{hf}.{names.moe}")
    tensors.append(HFTensor("model.norm.weight", "norm.weight", (d,), _same))
    if not model.tie_embeddings:
        tensors.append(HFTensor("lm_head.weight", "head.weight", (model.vocab_size, d), _same))
    return tensors


def _moe_block(model: ModelConfig, names: HubNames, ours: str, block: str) -> list[HFTensor]:
    """One MoE layer's router, experts and shared experts (our `ours`, the hub's `block`)."""
    d, moe = model.d_model, model.moe
    hidden = moe.expert_hidden
    tensors = [
        HFTensor(
            f"{block}.gate.weight",
            f"{ours}.ffn.router.gate.weight",
            (moe.num_experts, d),
            _same,
            keep_fp32=names.fp32_router,
        )
    ]
    if names.fp32_router:  # GLM-4-MoE: the selection bias too
        tensors.append(
            HFTensor(
                f"{block}.gate.e_score_correction_bias",
                f"{ours}.ffn.router.expert_bias",
                (moe.num_experts,),
                _same,
                keep_fp32=True,
            )
        )
    gate, up, down = names.gate_up_down
    for expert in range(moe.num_experts):
        prefix = f"{block}.experts.{expert}"
        gate_up, w_down = f"{ours}.ffn.experts.w_gate_up_EDO", f"{ours}.ffn.experts.w_down_EHD"
        tensors += [
            HFTensor(f"{prefix}.{gate}.weight", gate_up, (hidden, d), _gate(hidden), expert),
            HFTensor(f"{prefix}.{up}.weight", gate_up, (hidden, d), _up(hidden), expert),
            HFTensor(f"{prefix}.{down}.weight", w_down, (d, hidden), _transposed, expert),
        ]  # fmt: skip
    if names.shared is None:
        return tensors
    width = moe.shared_experts * hidden
    if width:
        tensors += _swiglu(f"{block}.{names.shared}", f"{ours}.ffn.shared", d, width)
    else:
        # GLM-4-MoE always builds its shared-expert MLP; with none it has width 0 and adds 0.
        tensors += [
            HFTensor(f"{block}.{names.shared}.{n}_proj.weight", None, shape, _same)
            for n, shape in (("gate", (0, d)), ("up", (0, d)), ("down", (d, 0)))
        ]
    if names.shared_gate:
        source = f"{ours}.ffn.shared_gate.weight"
        tensors.append(HFTensor(f"{block}.shared_expert_gate.weight", source, (1, d), _same))
    return tensors
