"""Which transformers architecture computes exactly what a model config computes, and how.

One table serves both directions: `Architecture.tensors` lists every hub tensor with the
checkpoint tensor it is cut from (`tensor_map.hub_tensors`), and each cut (`HFTensor.take`) is
a view of its source, so export reads through it and import (`moe_train.hf.import_hf`) writes
through it. `tensor_map.checkpoint_shapes` gives the shapes of the checkpoint tensors those cuts tile.

Every target shares our block: RMSNorm (eps `model.norm_eps`, weight times the fp32
normalised input) on the inputs of attention and feed-forward (on their outputs for FlexOlmo),
grouped-query attention with RoPE in the half-split convention
(`rotate_half`: channel i pairs with channel i + head_dim/2) on the whole head, SwiGLU
feed-forwards `down(silu(gate(x)) * up(x))`, a final RMSNorm and a bias-free head. The
softmax-routed ones pick the top k by probability (no selection bias, no groups, unscaled).

- `Qwen3MoeForCausalLM`: QK-norm per head before RoPE (always on), `norm_topk_prob`, no
  shared experts, dense layers as `mlp_only_layers`.
- `OlmoeForCausalLM`: QK-norm over the whole q and k projections (all heads together, one
  weight per channel; `model.qk_norm: projection`), `norm_topk_prob`, no shared
  experts, an MoE feed-forward in every layer.
- `MixtralForCausalLM`: no QK-norm, top-k weights always renormalised (`normalize_topk`), no
  shared experts, an MoE feed-forward in every layer; exported without router jitter.
- `Qwen2MoeForCausalLM`: no QK-norm, optional q/k/v biases (`qkv_bias`), `norm_topk_prob`,
  one shared-expert MLP of width `shared_expert_intermediate_size` whose output is scaled by
  `sigmoid(shared_expert_gate(x))` (`model.moe.shared_expert_gate`), dense layers as
  `mlp_only_layers`.
- `FlexOlmoForCausalLM`: OLMoE's attention and experts with the norms on the outputs of
  attention and feed-forward (`model.norm_placement: output`, OLMo-2's block).
- `Glm4MoeForCausalLM`: sigmoid router whose selection adds `e_score_correction_bias` and whose
  combine weights do not, `norm_topk_prob`, `n_shared_experts` ungated SwiGLU experts of width
  `n_shared_experts * moe_intermediate_size`, optional per-head QK-norm (`use_qk_norm`),
  dense-first layers (`first_k_dense_replace`), group-limited routing (`n_group`,
  `topk_group`) and `routed_scaling_factor`. Exported with `partial_rotary_factor = 1` (RoPE on
  the whole head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_plan.config import Config, ModelConfig
from moe_train.errors import MoeTrainError
from moe_train.hf.tensor_map import (
    GLM4,
    MIXTRAL,
    OLMOE,
    QWEN2,
    QWEN3,
    HFTensor,
    hub_tensors,
)


class ExportError(MoeTrainError):
    """An export cannot run: an option no target architecture represents, or an unusable --out."""


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
    if moe.router == "sigmoid":
        _refuse_output_norms(model, "GLM-4-MoE, the sigmoid-routed architecture,")
        return _sigmoid_routed(config)
    if expert_bias_nonzero:
        raise ExportError(
            "model.moe.bias_update_rate: the softmax router's selection bias is not zero; "
            "no exported architecture adds a bias to softmax routing"
        )
    if moe.topk_group < moe.n_group or moe.routed_scaling_factor != 1.0:
        raise ExportError(
            f"model.moe.n_group={moe.n_group}, topk_group={moe.topk_group}, "
            f"routed_scaling_factor={moe.routed_scaling_factor} with "
            "model.moe.router='softmax': the softmax-routed architectures route over all "
            "experts unscaled; group-limited or scaled routing exports only with "
            "router='sigmoid' (GLM-4-MoE)"
        )
    if model.norm_placement == "output":
        return _flex_olmo(config)
    if moe.shared_experts or model.qkv_bias:
        return _with_gated_shared_expert(config)
    if not model.qk_norm:
        if not moe.normalize_topk:
            raise ExportError(
                "model.moe.normalize_topk=false with model.qk_norm=false: Mixtral always "
                "renormalises the top-k weights, and the other softmax-routed architectures "
                "without shared experts have QK-norm"
            )
        _refuse_dense_layers(model, "Mixtral")
        return _mixtral(config)
    if model.qk_norm == "projection":
        _refuse_dense_layers(model, "OLMoE")
        return _olmoe(config)
    return _qwen3_moe(config)


def _refuse_output_norms(model: ModelConfig, family: str) -> None:
    if model.norm_placement != "input":
        raise ExportError(
            f"model.norm_placement={model.norm_placement!r} normalises the outputs of attention "
            f"and feed-forward; {family} normalises their inputs (input)"
        )


def _flex_olmo(config: Config) -> Architecture:
    """FlexOlmo: OLMoE's attention and experts in OLMo-2's block, the norms on the outputs of
    attention and feed-forward (`model.norm_placement: output`); the one MoE architecture of
    transformers that places them so."""
    model, moe = config.model, config.model.moe
    family = "FlexOlmo, the MoE architecture that normalises the sublayers' outputs,"
    if moe.shared_experts or model.qkv_bias or model.qk_norm != "projection":
        value = {True: "true", False: "false"}.get(model.qk_norm, repr(model.qk_norm))  # type: ignore[arg-type]
        raise ExportError(
            f"model.norm_placement='output' with model.moe.shared_experts={moe.shared_experts}, "
            f"model.qkv_bias={str(model.qkv_bias).lower()}, model.qk_norm={value}: {family} "
            "has no shared experts and no q/k/v biases, and normalises q and k over the whole "
            "projections (model.qk_norm: projection)"
        )
    _refuse_dense_layers(model, "FlexOlmo")
    kwargs = _olmoe_config(config)
    tensors = hub_tensors(model, OLMOE)
    return Architecture("FlexOlmoForCausalLM", "FlexOlmoConfig", kwargs, tensors)


def _refuse_dense_layers(model: ModelConfig, family: str) -> None:
    if model.dense_layers:
        raise ExportError(
            f"model.dense_layers={model.dense_layers}: {family}, the architecture the other "
            "options match, has an MoE feed-forward in every layer"
        )


def _sigmoid_routed(config: Config) -> Architecture:
    """GLM-4-MoE, the one sigmoid-routed target, if the attention and shared experts match."""
    model, moe = config.model, config.model.moe
    if moe.num_experts < 2:
        raise ExportError(
            f"model.moe.num_experts={moe.num_experts} with model.moe.router='sigmoid': "
            "GLM-4-MoE's router needs at least 2 experts"
        )
    if model.qkv_bias:
        raise ExportError(
            "model.qkv_bias=true with model.moe.router='sigmoid': GLM-4-MoE is exported "
            "without attention biases; q/k/v biases export with router='softmax' and gated "
            "shared experts (Qwen2-MoE)"
        )
    if model.qk_norm == "projection":
        raise ExportError(
            "model.qk_norm='projection' with model.moe.router='sigmoid': GLM-4-MoE "
            "normalises q and k per head (model.qk_norm=true)"
        )
    if moe.shared_expert_gate:
        raise ExportError(
            "model.moe.shared_expert_gate=true with model.moe.router='sigmoid': GLM-4-MoE's "
            "shared experts are ungated; gated ones export with router='softmax' (Qwen2-MoE)"
        )
    return _glm4_moe(config)


def _with_gated_shared_expert(config: Config) -> Architecture:
    """Qwen2-MoE, the softmax-routed target with shared experts or q/k/v biases: one
    sigmoid-gated shared-expert MLP in every MoE layer, no QK-norm."""
    model, moe = config.model, config.model.moe
    if not moe.shared_experts:
        raise ExportError(
            "model.qkv_bias=true with model.moe.shared_experts=0: q/k/v biases export as "
            "Qwen2-MoE, whose MoE layers always have a gated shared expert"
        )
    if not moe.shared_expert_gate:
        raise ExportError(
            f"model.moe.shared_experts={moe.shared_experts} with "
            "model.moe.shared_expert_gate=false and model.moe.router='softmax': Qwen2-MoE "
            "gates its shared expert with a sigmoid and Qwen3-MoE, OLMoE and Mixtral have "
            "none; ungated shared experts export only with router='sigmoid' (GLM-4-MoE)"
        )
    if model.qk_norm:
        value = "true" if model.qk_norm is True else repr(model.qk_norm)
        raise ExportError(
            f"model.qk_norm={value} with gated shared experts (Qwen2-MoE): Qwen2-MoE has no QK-norm"
        )
    return _qwen2_moe(config)


def _base_config(config: Config) -> dict[str, Any]:
    """The config.json options every target has."""
    model = config.model
    return {
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": _max_positions(config),
        "initializer_range": model.init_std,
        "rms_norm_eps": model.norm_eps,
        "rope_parameters": rope_parameters(model),
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tie_embeddings,
        "num_experts_per_tok": model.moe.top_k,
        "output_router_logits": False,
    }


def _common_config(config: Config) -> dict[str, Any]:
    """The options Qwen3-MoE and GLM-4-MoE add to the base ones."""
    model = config.model
    return _base_config(config) | {
        "head_dim": model.d_model // model.n_heads,
        "attention_bias": False,
        "intermediate_size": model.dense_hidden,
        "moe_intermediate_size": model.moe.expert_hidden,
        "norm_topk_prob": model.moe.normalize_topk,
    }


def _olmoe_config(config: Config) -> dict[str, Any]:
    """The options OLMoE and FlexOlmo, which share attention and experts, add to the base ones."""
    moe = config.model.moe
    return _base_config(config) | {
        "intermediate_size": moe.expert_hidden,
        "num_experts": moe.num_experts,
        "norm_topk_prob": moe.normalize_topk,
        "router_aux_loss_coef": moe.lb_loss_weight,
        "attention_bias": False,
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
    return Architecture("Qwen3MoeForCausalLM", "Qwen3MoeConfig", kwargs, hub_tensors(model, QWEN3))


def _glm4_moe(config: Config) -> Architecture:
    model = config.model
    kwargs = _common_config(config) | {
        "n_routed_experts": model.moe.num_experts,
        "n_shared_experts": model.moe.shared_experts,
        "first_k_dense_replace": model.dense_layers,
        "routed_scaling_factor": model.moe.routed_scaling_factor,
        "n_group": model.moe.n_group,
        "topk_group": model.moe.topk_group,
        "use_qk_norm": bool(model.qk_norm),
        "partial_rotary_factor": 1.0,
        "num_nextn_predict_layers": 0,
    }
    kwargs["rope_parameters"] = kwargs["rope_parameters"] | {"partial_rotary_factor": 1.0}
    return Architecture("Glm4MoeForCausalLM", "Glm4MoeConfig", kwargs, hub_tensors(model, GLM4))


def _olmoe(config: Config) -> Architecture:
    kwargs = _olmoe_config(config) | {"clip_qkv": None}
    tensors = hub_tensors(config.model, OLMOE)
    return Architecture("OlmoeForCausalLM", "OlmoeConfig", kwargs, tensors)


def _mixtral(config: Config) -> Architecture:
    model = config.model
    kwargs = _base_config(config) | {
        "head_dim": model.d_model // model.n_heads,
        "intermediate_size": model.moe.expert_hidden,
        "num_local_experts": model.moe.num_experts,
        "router_aux_loss_coef": model.moe.lb_loss_weight,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }
    return Architecture("MixtralForCausalLM", "MixtralConfig", kwargs, hub_tensors(model, MIXTRAL))


def _qwen2_moe(config: Config) -> Architecture:
    model, moe = config.model, config.model.moe
    kwargs = _base_config(config) | {
        "intermediate_size": model.dense_hidden,
        "moe_intermediate_size": moe.expert_hidden,
        "shared_expert_intermediate_size": moe.shared_experts * moe.expert_hidden,
        "num_experts": moe.num_experts,
        "norm_topk_prob": moe.normalize_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(model.dense_layers)),
        "router_aux_loss_coef": moe.lb_loss_weight,
        "qkv_bias": model.qkv_bias,
        "use_sliding_window": False,
    }
    return Architecture("Qwen2MoeForCausalLM", "Qwen2MoeConfig", kwargs, hub_tensors(model, QWEN2))
