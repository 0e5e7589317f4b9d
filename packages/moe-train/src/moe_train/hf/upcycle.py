"""`moe-train upcycle`: a dense transformers model as an MoE checkpoint of ours.

Reads a dense Qwen3 (`Qwen3ForCausalLM`), Llama (`LlamaForCausalLM`) or OLMo-2
(`Olmo2ForCausalLM`, its norms on the sublayers' outputs: `model.norm_placement: output`,
its QK-norm over the whole projections: `model.qk_norm: projection`) model directory and
writes what `import-hf` writes (OUT/step_00000000, a weights-only checkpoint of step 0
keeping the end tokens the directory names, and OUT/config.yaml with `checkpoint.init_from`
set to OUT), with every feed-forward replaced by an MoE layer of `experts` experts, `top_k`
of them per token, built from the dense MLP.

The construction, exact at step 0 when `noise` is 0. The dense MLP of width F is cut along
its hidden dimension into G = `granularity` slices of width F / G; the dense MLP is the sum
of its slices' outputs, as SwiGLU acts channel by channel before the down projection sums
over the channels. There are C = experts / G copies of the MLP; expert c * G + g is slice g
of copy c, its down projection multiplied by G. Router rows: one random row per copy, the
same row for its G experts, so the G experts of a copy always have equal scores. Routing is
softmax top-k with the chosen scores renormalised (`normalize_topk`), and top_k = m * G:
the top k scores are then whole copies (ties inside a copy, none between copies), the m best
ones, and each chosen expert of copy c gets the weight p_c / (G * P), P the sum of the m
chosen copies' probabilities. The output is sum over chosen c of (p_c / P) * sum over g of
slice_g = the dense MLP, whatever the router: so the router can start random (as sparse
upcycling starts it), and the experts, seeing different tokens, diverge once trained. With
G = 1 this is the plain case: k copies of the MLP, weights summing to one.

`noise` S > 0 adds to every expert weight, independently per expert, Gaussian noise of
standard deviation S times the root-mean-square of the dense weight it copies (so the copies
differ from the first step; the function is then only close to the dense one).

Attention, norms, embeddings and head are copied as they are. Nothing is written when the
model is not a dense model of a supported family or the options do not fit it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from moe_plan.config import Config, config_from_dict
from moe_train.end_tokens import END_IDS_KEY, model_dir_end_ids
from moe_train.errors import MoeTrainError
from moe_train.hf.architectures import Architecture
from moe_train.hf.import_hf import (
    ImportHFError,
    _read_weights,
    _refuse,
    _rope_scaling,
    _transformers,
    check_heads_and_activation,
    read_config_json,
    write_step_zero,
)
from moe_train.hf.tensor_map import QWEN3, HFTensor, hub_tensors

SUPPORTED = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "olmo2": "Olmo2ForCausalLM"}
"""model_type -> the dense transformers class upcycling reads."""


class UpcycleError(ImportHFError):
    """An upcycling cannot run: not a dense model of a supported family, options that do not
    fit it, or an unusable --out."""


@dataclass(frozen=True)
class UpcycleOptions:
    experts: int
    """Routed experts per MoE layer (copies of the MLP times `granularity`)."""
    top_k: int
    """Experts per token; a multiple of `granularity`."""
    granularity: int = 1
    """Slices each copy of the MLP is cut into along its hidden dimension."""
    noise: float = 0.0
    """Relative standard deviation of the noise added to the experts' weights."""
    seed: int = 0
    """Seed of the router's random rows and of the noise."""


@dataclass
class UpcycleResult:
    out: Path
    """The directory written: config.yaml and the checkpoint."""
    checkpoint: Path
    """The checkpoint, OUT/step_00000000."""
    architecture: str
    """The dense transformers class read, e.g. ``Qwen3ForCausalLM``."""
    config: Config
    """The trainer config written to OUT/config.yaml."""


def upcycle(hf_dir: str | Path, out: str | Path, options: UpcycleOptions) -> UpcycleResult:
    """Write the dense model in `hf_dir` to `out` as an MoE checkpoint and config.yaml (see
    the module docstring); an UpcycleError, before anything is written, for bad input."""
    hf_dir, out = Path(hf_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UpcycleError(f"--out {out} already exists and is not an empty directory")
    raw, architecture = _read_raw_config(hf_dir)
    hf = _transformers().AutoConfig.for_model(**raw)
    _check_options(options, hf.intermediate_size)
    end_ids = model_dir_end_ids(hf_dir)
    dense_config = _dense_config(hf, hf_dir / "config.json", raw["model_type"])
    table = Architecture(architecture, "", {}, _dense_tensors(dense_config))
    dense, _ = _read_weights(hf_dir, dense_config, table)
    config = _moe_config(dense_config, options)
    config.checkpoint.init_from = str(out.resolve())
    tensors = _moe_tensors(dense, config, options)
    provenance: dict[str, Any] = {
        "upcycled_from": str(hf_dir.resolve()),
        "architecture": architecture,
        "upcycling": asdict(options),
    }
    if end_ids:
        provenance[END_IDS_KEY] = end_ids
    write_step_zero(out, "upcycle", config, tensors, provenance, UpcycleError)
    return UpcycleResult(out, out / "step_00000000", architecture, config)


def _read_raw_config(hf_dir: Path) -> tuple[dict[str, Any], str]:
    """config.json of a dense model of a supported family, and its transformers class."""
    path = hf_dir / "config.json"
    raw = read_config_json(path, UpcycleError, "HF_DENSE_DIR")
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    architectures = raw.get("architectures") or [] if isinstance(raw, dict) else []
    supported = ", ".join(f"{c} ({t})" for t, c in SUPPORTED.items())
    name = architectures[0] if architectures else model_type
    if model_type not in SUPPORTED:
        raise UpcycleError(
            f"{path}: {name} (model_type {model_type!r}) is not a dense model upcycle reads; "
            f"supported: {supported}"
        )
    if architectures and architectures != [SUPPORTED[model_type]]:
        raise UpcycleError(
            f"{path}: architectures={architectures} is not upcyclable; supported: {supported}"
        )
    if "quantization_config" in raw:
        raise UpcycleError(f"{path}: quantization_config: quantized weights are not upcyclable")
    return raw, SUPPORTED[model_type]


def _check_options(options: UpcycleOptions, width: int) -> None:
    """The options fit a dense MLP of hidden width `width`."""
    experts, top_k, granularity = options.experts, options.top_k, options.granularity
    for flag, value in (("--experts", experts), ("--top-k", top_k), ("--granularity", granularity)):  # fmt: skip
        if value < 1:
            raise UpcycleError(f"{flag} {value} must be at least 1")
    if not options.noise >= 0:
        raise UpcycleError(f"--noise {options.noise} must be at least 0 (0: exact upcycling)")
    if width % granularity:
        raise UpcycleError(
            f"--granularity {granularity} does not divide the MLP width intermediate_size="
            f"{width}; each expert is one of G equal slices of it"
        )
    if experts % granularity:
        raise UpcycleError(
            f"--experts {experts} is not a multiple of --granularity {granularity}: the experts "
            "are whole copies of the MLP, each cut into G slices"
        )
    if top_k > experts:
        raise UpcycleError(f"--top-k {top_k} is more than --experts {experts}")
    if top_k % granularity:
        raise UpcycleError(
            f"--top-k {top_k} is not a multiple of --granularity {granularity}: each token "
            "must pick every slice of the copies it uses for the MoE to compute the dense MLP"
        )


def _dense_config(hf: Any, path: Path, model_type: str) -> Config:
    """Our config of the dense model: every layer a dense SwiGLU of the MLP's width."""
    check_heads_and_activation(hf, path)
    heads, d = hf.num_attention_heads, hf.hidden_size
    for key in ("attention_bias", "mlp_bias"):
        if getattr(hf, key, False):
            raise _refuse(path, key, True, "our projections have no bias")
    if hf.attention_dropout:
        raise _refuse(path, "attention_dropout", hf.attention_dropout, "our attention has no dropout")  # fmt: skip
    if getattr(hf, "use_sliding_window", False) and getattr(hf, "sliding_window", None):
        raise _refuse(path, "sliding_window", hf.sliding_window, "our attention is full")
    layer_types = set(getattr(hf, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise _refuse(path, "layer_types", sorted(layer_types), "our attention is full")
    if getattr(hf, "pretraining_tp", 1) != 1:
        raise _refuse(path, "pretraining_tp", hf.pretraining_tp, "our projections are whole (1)")
    rope = dict(hf.rope_parameters or {})
    model = {
        "vocab_size": hf.vocab_size,
        "d_model": d,
        "n_layers": hf.num_hidden_layers,
        "n_heads": heads,
        "n_kv_heads": hf.num_key_value_heads,
        # Qwen3 normalises each head's q and k, OLMo-2 the whole projections, Llama neither.
        "qk_norm": {"qwen3": True, "olmo2": "projection"}.get(model_type, False),
        "norm_placement": "output" if model_type == "olmo2" else "input",
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": _rope_scaling(rope, path),
        "norm_eps": float(hf.rms_norm_eps),
        "tie_embeddings": bool(hf.tie_word_embeddings),
        "init_std": float(hf.initializer_range),
        "dense_layers": hf.num_hidden_layers,
        "dense_hidden": hf.intermediate_size,
        "moe": {"num_experts": 1, "top_k": 1, "expert_hidden": hf.intermediate_size},
    }
    try:
        return config_from_dict({"model": model})
    except MoeTrainError as e:
        raise UpcycleError(f"{path} is not representable: {e}") from e


def _dense_tensors(config: Config) -> list[HFTensor]:
    """The dense model's hub tensors and the tensors of our dense config they fill (with the
    norms on the outputs, OLMo-2's post_attention_layernorm and post_feedforward_layernorm)."""
    return hub_tensors(config.model, QWEN3)


def _moe_config(dense: Config, options: UpcycleOptions) -> Config:
    """The upcycled model's config: the dense one with an MoE feed-forward in every layer."""
    data = dense.to_dict()
    data["model"]["dense_layers"] = 0
    data["model"]["moe"] |= {
        "num_experts": options.experts,
        "top_k": options.top_k,
        "expert_hidden": dense.model.dense_hidden // options.granularity,
        "router": "softmax",
        "normalize_topk": True,
    }
    return config_from_dict(data)


def _moe_tensors(dense: dict[str, Tensor], config: Config, options: UpcycleOptions) -> dict[str, Tensor]:  # fmt: skip
    """Our MoE model's tensors from the dense model's: experts cut from each layer's MLP,
    router rows shared by the slices of a copy (see the module docstring)."""
    model = config.model
    granularity, copies = options.granularity, options.experts // options.granularity
    width = model.moe.expert_hidden
    generator = torch.Generator().manual_seed(options.seed)
    tensors = {}
    for name, tensor in dense.items():
        if not name.startswith("blocks.") or ".ffn." not in name:
            tensors[name] = tensor
    for layer in range(model.n_layers):
        ffn = f"blocks.{layer}.ffn"
        gate_up, down = dense[f"{ffn}.gate_up.weight"], dense[f"{ffn}.down.weight"]
        gate, up = gate_up.chunk(2, dim=0)  # [F, D] each: our fused rows are [gate; up]
        gate_up_EDO, down_EHD = [], []
        for _copy in range(copies):
            for g in range(granularity):
                rows = slice(g * width, (g + 1) * width)
                gate_up_EDO.append(torch.cat([gate[rows], up[rows]]).T)
                down_EHD.append(down[:, rows].T * granularity)
        gate_up_EDO = _with_noise(torch.stack(gate_up_EDO), gate_up, options.noise, generator)
        down_EHD = _with_noise(torch.stack(down_EHD), down * granularity, options.noise, generator)
        tensors[f"{ffn}.experts.w_gate_up_EDO"] = gate_up_EDO.contiguous()
        tensors[f"{ffn}.experts.w_down_EHD"] = down_EHD.contiguous()
        rows_CD = torch.randn(copies, model.d_model, generator=generator) * model.init_std
        tensors[f"{ffn}.router.gate.weight"] = rows_CD.repeat_interleave(granularity, dim=0)
        tensors[f"{ffn}.router.expert_bias"] = torch.zeros(options.experts)
    return tensors


def _with_noise(experts: Tensor, dense: Tensor, noise: float, generator: torch.Generator) -> Tensor:  # fmt: skip
    """`experts` plus Gaussian noise of std `noise` times the RMS of `dense` (none when 0)."""
    if noise == 0:
        return experts
    scale = noise * float(dense.pow(2).mean().sqrt())
    return experts + torch.randn(experts.shape, generator=generator) * scale
