"""Which transformers architecture computes exactly what a model config computes, and how.

One table serves both directions: `Architecture.tensors` lists every hub tensor with the
checkpoint tensor it is cut from, and each cut (`HFTensor.take`) is a view of its source, so
export reads through it and import (`moe_train.hf.import_hf`) writes through it.
`checkpoint_shapes` gives the shapes of the checkpoint tensors those cuts tile.

Both targets share our block: pre-norm RMSNorm (eps `model.norm_eps`, weight times the fp32
normalised input), grouped-query attention with RoPE in the half-split convention
(`rotate_half`: channel i pairs with channel i + head_dim/2) on the whole head, SwiGLU
feed-forwards `down(silu(gate(x)) * up(x))`, a final RMSNorm and a bias-free head.

- `Qwen3MoeForCausalLM`: softmax router, top-k by probability, `norm_topk_prob`, QK-norm per
  head before RoPE (always on), no shared experts, dense layers as `mlp_only_layers`.
- `Glm4MoeForCausalLM`: sigmoid router whose selection adds `e_score_correction_bias` and whose
  combine weights do not, `norm_topk_prob`, `n_shared_experts` ungated SwiGLU experts of width
  `n_shared_experts * moe_intermediate_size`, optional per-head QK-norm (`use_qk_norm`),
  dense-first layers (`first_k_dense_replace`), group-limited routing (`n_group`,
  `topk_group`) and `routed_scaling_factor`. Exported with `partial_rotary_factor = 1` (RoPE on
  the whole head).

OLMoE (`OlmoeForCausalLM`) is no target: its QK-norm always normalises the whole q and k
projections (all heads together), which our per-head QK-norm equals only for one query and one
key/value head, where Qwen3-MoE applies as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from moe_train.config import Config, ModelConfig
from moe_train.errors import MoeTrainError


class ExportError(MoeTrainError):
    """An export cannot run: an option no target architecture represents, or an unusable --out."""


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
class Architecture:
    name: str
    """The transformers class, e.g. ``Qwen3MoeForCausalLM``."""
    config_class: str
    """The transformers config class, e.g. ``Qwen3MoeConfig``."""
    config_kwargs: dict[str, Any]
    """Arguments of the config class."""
    tensors: list[HFTensor]
    """Every tensor to write, in order."""


def choose_architecture(config: Config, expert_bias_nonzero: bool) -> Architecture:
    """The architecture that computes exactly what `config`'s model does, or an ExportError
    naming the first option none represents. `expert_bias_nonzero`: some MoE layer's
    selection bias (`model.moe.bias_update_rate`) is not all zero."""
    model, moe = config.model, config.model.moe
    if moe.random_routing:
        raise ExportError(
            "model.moe.random_routing=true routes at random; no exported architecture does "
            "(export a checkpoint trained with learned routing)"
        )
    if moe.capacity_factor is not None:
        raise ExportError(
            f"model.moe.capacity_factor={moe.capacity_factor} drops token copies over capacity; "
            "transformers' MoE architectures are dropless, so the logits would differ"
        )
    if moe.router == "softmax":
        if expert_bias_nonzero:
            raise ExportError(
                "model.moe.bias_update_rate: the softmax router's selection bias is not zero; "
                "no exported architecture adds a bias to softmax routing (Qwen3-MoE has none)"
            )
        if moe.topk_group < moe.n_group or moe.routed_scaling_factor != 1.0:
            raise ExportError(
                f"model.moe.n_group={moe.n_group}, topk_group={moe.topk_group}, "
                f"routed_scaling_factor={moe.routed_scaling_factor} with "
                "model.moe.router='softmax': Qwen3-MoE routes over all experts unscaled; "
                "group-limited or scaled routing exports only with router='sigmoid' (GLM-4-MoE)"
            )
        if moe.shared_experts:
            raise ExportError(
                f"model.moe.shared_experts={moe.shared_experts} with model.moe.router='softmax': "
                "Qwen3-MoE has no shared experts and Qwen2-MoE gates them with a sigmoid; "
                "ungated shared experts export only with router='sigmoid' (GLM-4-MoE)"
            )
        if not model.qk_norm:
            raise ExportError(
                "model.qk_norm=false with model.moe.router='softmax': Qwen3-MoE always "
                "normalises q and k per head and OLMoE over the whole projection; no exported "
                "architecture with softmax routing has no QK-norm"
            )
        return _qwen3_moe(config)
    if moe.num_experts < 2:
        raise ExportError(
            f"model.moe.num_experts={moe.num_experts} with model.moe.router='sigmoid': "
            "GLM-4-MoE's router needs at least 2 experts"
        )
    return _glm4_moe(config)


def _common_config(config: Config) -> dict[str, Any]:
    model = config.model
    return {
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.d_model // model.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": _max_positions(config),
        "initializer_range": model.init_std,
        "rms_norm_eps": model.norm_eps,
        "rope_parameters": rope_parameters(model),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tie_embeddings,
        "intermediate_size": model.dense_hidden,
        "moe_intermediate_size": model.moe.expert_hidden,
        "num_experts_per_tok": model.moe.top_k,
        "norm_topk_prob": model.moe.normalize_topk,
        "output_router_logits": False,
    }


def rope_parameters(model: ModelConfig) -> dict[str, Any]:
    """config.json's `rope_parameters` for the model's RoPE (and its scaling)."""
    scaling = model.rope_scaling
    if scaling.type == "none":
        return {"rope_type": "default", "rope_theta": model.rope_theta}
    parameters = {
        "rope_type": scaling.type,
        "rope_theta": model.rope_theta,
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "truncate": True,
    }
    if scaling.attention_factor is not None:
        parameters["attention_factor"] = scaling.attention_factor
    return parameters


def _max_positions(config: Config) -> int:
    """The context the exported model is meant for: the training sequence length, or with
    YaRN the original context times its factor (what transformers checks the factor by)."""
    scaling = config.model.rope_scaling
    if scaling.type == "yarn" and scaling.original_max_position_embeddings is not None:
        return round(scaling.original_max_position_embeddings * scaling.factor)
    return config.data.seq_len


def _qwen3_moe(config: Config) -> Architecture:
    model = config.model
    kwargs = _common_config(config) | {
        "num_experts": model.moe.num_experts,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(model.dense_layers)),
        "router_aux_loss_coef": model.moe.lb_loss_weight,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    return Architecture("Qwen3MoeForCausalLM", "Qwen3MoeConfig", kwargs, _tensors(model, glm=False))


def _glm4_moe(config: Config) -> Architecture:
    model = config.model
    kwargs = _common_config(config) | {
        "n_routed_experts": model.moe.num_experts,
        "n_shared_experts": model.moe.shared_experts,
        "first_k_dense_replace": model.dense_layers,
        "routed_scaling_factor": model.moe.routed_scaling_factor,
        "n_group": model.moe.n_group,
        "topk_group": model.moe.topk_group,
        "use_qk_norm": model.qk_norm,
        "partial_rotary_factor": 1.0,
        "num_nextn_predict_layers": 0,
    }
    kwargs["rope_parameters"] = kwargs["rope_parameters"] | {"partial_rotary_factor": 1.0}
    return Architecture("Glm4MoeForCausalLM", "Glm4MoeConfig", kwargs, _tensors(model, glm=True))


def checkpoint_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The model tensors of our checkpoint (one name per storage: no ``head.weight`` when
    tied) and their shapes: what `_tensors`' sources are cut from."""
    d, moe = model.d_model, model.moe
    head_dim = d // model.n_heads
    kv, experts, hidden = model.n_kv_heads * head_dim, moe.num_experts, moe.expert_hidden
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (model.vocab_size, d)}
    for layer in range(model.n_layers):
        ours = f"blocks.{layer}"
        shapes[f"{ours}.attn_norm.weight"] = (d,)
        shapes[f"{ours}.attn.qkv.weight"] = (d + 2 * kv, d)
        shapes[f"{ours}.attn.out.weight"] = (d, d)
        if model.qk_norm:
            shapes[f"{ours}.attn.q_norm.weight"] = (head_dim,)
            shapes[f"{ours}.attn.k_norm.weight"] = (head_dim,)
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


def _tensors(model: ModelConfig, *, glm: bool) -> list[HFTensor]:
    d, moe = model.d_model, model.moe
    head_dim = d // model.n_heads
    kv = model.n_kv_heads * head_dim
    hidden = moe.expert_hidden
    tensors = [HFTensor("model.embed_tokens.weight", "embed.weight", (model.vocab_size, d), _same)]
    for layer in range(model.n_layers):
        ours, hf = f"blocks.{layer}", f"model.layers.{layer}"
        qkv = f"{ours}.attn.qkv.weight"
        tensors += [
            HFTensor(f"{hf}.input_layernorm.weight", f"{ours}.attn_norm.weight", (d,), _same),
            HFTensor(f"{hf}.self_attn.q_proj.weight", qkv, (d, d), _rows(0, d)),
            HFTensor(f"{hf}.self_attn.k_proj.weight", qkv, (kv, d), _rows(d, d + kv)),
            HFTensor(f"{hf}.self_attn.v_proj.weight", qkv, (kv, d), _rows(d + kv, d + 2 * kv)),
            HFTensor(f"{hf}.self_attn.o_proj.weight", f"{ours}.attn.out.weight", (d, d), _same),
        ]
        if model.qk_norm:
            tensors += [
                HFTensor(
                    f"{hf}.self_attn.{n}.weight", f"{ours}.attn.{n}.weight", (head_dim,), _same
                )
                for n in ("q_norm", "k_norm")
            ]
        tensors.append(
            HFTensor(
                f"{hf}.post_attention_layernorm.weight", f"{ours}.ffn_norm.weight", (d,), _same
            )
        )
        if layer < model.dense_layers:
            tensors += _swiglu(f"{hf}.mlp", f"{ours}.ffn", d, model.dense_hidden)
            continue
        tensors.append(
            HFTensor(
                f"{hf}.mlp.gate.weight",
                f"{ours}.ffn.router.gate.weight",
                (moe.num_experts, d),
                _same,
                keep_fp32=glm,
            )
        )
        if glm:
            tensors.append(
                HFTensor(
                    f"{hf}.mlp.gate.e_score_correction_bias",
                    f"{ours}.ffn.router.expert_bias",
                    (moe.num_experts,),
                    _same,
                    keep_fp32=True,
                )
            )
        for expert in range(moe.num_experts):
            prefix = f"{hf}.mlp.experts.{expert}"
            gate_up, down = f"{ours}.ffn.experts.w_gate_up_EDO", f"{ours}.ffn.experts.w_down_EHD"
            tensors += [
                HFTensor(f"{prefix}.gate_proj.weight", gate_up, (hidden, d), _gate(hidden), expert),
                HFTensor(f"{prefix}.up_proj.weight", gate_up, (hidden, d), _up(hidden), expert),
                HFTensor(f"{prefix}.down_proj.weight", down, (d, hidden), _transposed, expert),
            ]  # fmt: skip
        if glm:
            # GLM-4-MoE always builds its shared-expert MLP; with none it has width 0 and adds 0.
            width = moe.shared_experts * hidden
            if width:
                tensors += _swiglu(f"{hf}.mlp.shared_experts", f"{ours}.ffn.shared", d, width)
            else:
                tensors += [
                    HFTensor(f"{hf}.mlp.shared_experts.{n}_proj.weight", None, shape, _same)
                    for n, shape in (("gate", (0, d)), ("up", (0, d)), ("down", (d, 0)))
                ]
    tensors.append(HFTensor("model.norm.weight", "norm.weight", (d,), _same))
    if not model.tie_embeddings:
        tensors.append(HFTensor("lm_head.weight", "head.weight", (model.vocab_size, d), _same))
    return tensors
