"""`moe-train import-hf`: a transformers model directory as a weights-only checkpoint of ours.

Reads HF_DIR/config.json (Qwen3-MoE, GLM-4-MoE, OLMoE, Mixtral or Qwen2-MoE) and its safetensors (one model.safetensors,
or shards with model.safetensors.index.json), and writes OUT/step_00000000, a checkpoint of
step 0 that holds only model tensors, and OUT/config.yaml, a trainer config whose model section
computes what the transformers model computes, with `checkpoint.init_from` set to OUT. The
fused tensors are rebuilt through the same table as export (`architectures`): each hub tensor
is copied into the view of our tensor that export cuts it from. Any option our model cannot
represent exactly is refused before anything is written; the output goes to a scratch
directory beside OUT that is moved into place at the end. The end tokens the directory names
(`eos_token_id` of generation_config.json or config.json) are kept in the checkpoint's
trainer state, so generation from it ends there (`moe_train.end_tokens`).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from moe_checkpoint import CheckpointError, OwnedSlice, save_checkpoint
from moe_plan.config import Config, config_from_dict, dump_config
from moe_train.end_tokens import END_IDS_KEY, model_dir_end_ids
from moe_train.errors import MoeTrainError
from moe_train.hf.architectures import Architecture, ExportError, choose_architecture
from moe_train.hf.output_dir import written_whole
from moe_train.hf.tensor_map import HFTensor, checkpoint_shapes

SUPPORTED = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "flex_olmo": "FlexOlmoForCausalLM",
}
"""model_type -> the transformers class import reads."""
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class ImportHFError(MoeTrainError):
    """An import cannot run: an architecture or option our model does not represent, a
    damaged model directory, or an unusable --out."""


@dataclass
class ImportResult:
    out: Path
    """The directory written: config.yaml and the checkpoint."""
    checkpoint: Path
    """The checkpoint, OUT/step_00000000."""
    architecture: str
    """The transformers class read, e.g. ``Qwen3MoeForCausalLM``."""
    config: Config
    """The trainer config written to OUT/config.yaml."""
    ignored: list[str]
    """Hub tensors not read (multi-token-prediction layers transformers ignores too)."""


def import_hf(hf_dir: str | Path, out: str | Path) -> ImportResult:
    """Write the transformers model in `hf_dir` to `out` as a checkpoint and config.yaml; an
    ImportHFError (before anything is written) for what our model cannot compute exactly."""
    hf_dir, out = Path(hf_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ImportHFError(f"--out {out} already exists and is not an empty directory")
    config, architecture = read_hf_config(hf_dir)
    config.checkpoint.init_from = str(out.resolve())
    end_ids = model_dir_end_ids(hf_dir)
    tensors, ignored = _read_weights(hf_dir, config, architecture)

    provenance: dict[str, Any] = {
        "imported_from": str(hf_dir.resolve()),
        "architecture": architecture.name,
    }
    if end_ids:
        provenance[END_IDS_KEY] = end_ids
    write_step_zero(out, "import", config, tensors, provenance, ImportHFError)
    return ImportResult(out, out / "step_00000000", architecture.name, config, ignored)


def write_step_zero(
    out: Path,
    what: str,
    config: Config,
    tensors: dict[str, Tensor],
    provenance: dict[str, Any],
    error: type[MoeTrainError],
) -> None:
    """Write `tensors` as OUT/step_00000000 (its state: step 0, the config, `provenance`) and
    OUT/config.yaml, all or nothing (`written_whole`); a failed write raises `error`."""
    with written_whole(out, what) as scratch:
        state = {"step": 0, "config": config.to_dict(), **provenance, "saved_at": time.time()}
        slices = [OwnedSlice.whole(name, t) for name, t in tensors.items()]
        try:
            save_checkpoint(scratch, 0, slices, lambda _: "model", state, group=None).wait()
        except CheckpointError as e:
            raise error(f"writing the checkpoint failed: {e}") from e
        dump_config(config, scratch / "config.yaml")


# ---- config ------------------------------------------------------------------------------


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportHFError(
            "import-hf needs the 'transformers' library: pip install 'moestack-train[hf]' "
            "(or pip install transformers)"
        ) from e
    return transformers


def read_config_json(path: Path, error: type[MoeTrainError], dir_arg: str) -> Any:
    """The JSON of a model directory's config.json at `path`; `error` when it is missing
    (`dir_arg`, the argument that named the directory, must be one) or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise error(f"{path} does not exist: {dir_arg} must be a model directory") from e
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{path} is not readable JSON: {e}") from e


def read_hf_config(hf_dir: Path) -> tuple[Config, Architecture]:
    """Our config for the model in `hf_dir` (model section from config.json, the rest at
    defaults) and the table mapping its tensors; refuses what is not represented exactly."""
    path = hf_dir / "config.json"
    raw = read_config_json(path, ImportHFError, "HF_DIR")
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    supported = ", ".join(f"{c} ({t})" for t, c in SUPPORTED.items())
    if model_type not in SUPPORTED:
        name = architectures[0] if architectures else model_type
        raise ImportHFError(
            f"{path}: architecture {name} (model_type {model_type!r}) is not importable; "
            f"supported: {supported}"
        )
    expected = SUPPORTED[model_type]
    if architectures and architectures != [expected]:
        raise ImportHFError(
            f"{path}: architectures={architectures} is not importable; supported: {supported}"
        )
    if "quantization_config" in raw:
        raise ImportHFError(
            f"{path}: quantization_config: quantized weights are not importable; "
            "import the unquantized model"
        )
    transformers = _transformers()
    hf = transformers.AutoConfig.for_model(**raw)
    model = _model_section(hf, path, model_type)
    try:
        config = config_from_dict({"model": model})
    except MoeTrainError as e:
        raise ImportHFError(f"{path} is not representable: {e}") from e
    try:
        architecture = choose_architecture(config, expert_bias_nonzero=False)
    except ExportError as e:  # not reached for what _model_section accepts
        raise ImportHFError(f"{path} is not representable: {e}") from e
    assert architecture.name == expected, (architecture.name, expected)
    return config, architecture


def _refuse(path: Path, key: str, value: Any, why: str) -> ImportHFError:
    return ImportHFError(f"{path}: {key}={value!r} is not importable: {why}")


YARN_KEYS = {
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "attention_factor",
}
"""The YaRN parameters of `rope_parameters` that `model.rope_scaling` holds."""


def _rope_scaling(rope: dict[str, Any], path: Path) -> dict[str, Any]:
    """`rope_parameters`' scaling as our model.rope_scaling section, refusing schemes and
    parameters our RoPE does not compute."""
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return {"type": "none"}
    if rope_type != "yarn":
        raise _refuse(path, "rope_parameters.rope_type", rope_type,
                      "our RoPE is the default one or YaRN (yarn)")  # fmt: skip
    if rope.get("truncate", True) is not True:
        raise _refuse(path, "rope_parameters.truncate", rope["truncate"],
                      "our YaRN rounds its channel bounds outwards (truncate = true)")  # fmt: skip
    for key in ("mscale", "mscale_all_dim"):
        if rope.get(key):
            raise _refuse(path, f"rope_parameters.{key}", rope[key],
                          "our YaRN scales attention by attention_factor alone")  # fmt: skip
    if rope.get("factor") is None:
        raise _refuse(path, "rope_parameters.factor", None, "our YaRN needs its factor")
    section = {"type": "yarn"} | {k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}
    return section


def check_heads_and_activation(hf: Any, path: Path) -> None:
    """Refuse a transformers config (`hf`, read from `path`) whose head width is not
    hidden_size / num_attention_heads or whose feed-forward activation is not silu."""
    heads, d = hf.num_attention_heads, hf.hidden_size
    head_dim = getattr(hf, "head_dim", None) or d // heads
    if head_dim * heads != d:
        raise _refuse(path, "head_dim", head_dim, f"our attention has head_dim = hidden_size / "
                      f"num_attention_heads = {d} / {heads}")  # fmt: skip
    if hf.hidden_act != "silu":
        raise _refuse(path, "hidden_act", hf.hidden_act, "our feed-forwards are SwiGLU (silu)")


def _model_section(hf: Any, path: Path, model_type: str) -> dict[str, Any]:
    """config.json's options as our `model` section, refusing any our model computes
    differently."""
    check_heads_and_activation(hf, path)
    heads, d = hf.num_attention_heads, hf.hidden_size
    if getattr(hf, "attention_bias", False):
        raise _refuse(path, "attention_bias", True, "our output projection has no bias")
    if hf.attention_dropout:
        raise _refuse(path, "attention_dropout", hf.attention_dropout, "our attention has no dropout")  # fmt: skip
    rope = dict(hf.rope_parameters or {})
    if model_type == "glm4_moe" and rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(path, "partial_rotary_factor", rope["partial_rotary_factor"],
                      "our RoPE rotates the whole head (1.0)")  # fmt: skip
    model: dict[str, Any] = {
        "vocab_size": hf.vocab_size,
        "d_model": d,
        "n_layers": hf.num_hidden_layers,
        "n_heads": heads,
        "n_kv_heads": hf.num_key_value_heads,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_scaling": _rope_scaling(rope, path),
        "norm_eps": float(hf.rms_norm_eps),
        "tie_embeddings": bool(hf.tie_word_embeddings),
        "init_std": float(hf.initializer_range),
    }
    moe: dict[str, Any] = {"top_k": hf.num_experts_per_tok, "router": "softmax"}
    family = {
        "glm4_moe": _glm4_moe_options,
        "qwen3_moe": _qwen3_moe_options,
        "qwen2_moe": _qwen2_moe_options,
        "olmoe": _olmoe_options,
        "flex_olmo": _flex_olmo_options,
        "mixtral": _mixtral_options,
    }[model_type]
    family(hf, path, model, moe)
    model["moe"] = moe
    return model


def _glm4_moe_options(hf: Any, path: Path, model: dict[str, Any], moe: dict[str, Any]) -> None:
    model |= {
        "qk_norm": bool(hf.use_qk_norm),
        "dense_layers": hf.first_k_dense_replace,
        "dense_hidden": hf.intermediate_size,
    }
    moe |= {
        "router": "sigmoid",
        "num_experts": hf.n_routed_experts,
        "shared_experts": hf.n_shared_experts,
        "expert_hidden": hf.moe_intermediate_size,
        "normalize_topk": bool(hf.norm_topk_prob),
        "n_group": hf.n_group,
        "topk_group": hf.topk_group,
        "routed_scaling_factor": float(hf.routed_scaling_factor),
    }


def _qwen_moe_options(hf: Any, path: Path, model: dict[str, Any], moe: dict[str, Any]) -> None:
    """What Qwen3-MoE and Qwen2-MoE share: experts, dense layers, full attention."""
    if hf.num_experts < 1:
        raise _refuse(path, "num_experts", hf.num_experts, "our MoE layers need experts")
    if getattr(hf, "use_sliding_window", False) and getattr(hf, "sliding_window", None):
        raise _refuse(path, "sliding_window", hf.sliding_window, "our attention is full")
    dense = [
        layer
        for layer in range(hf.num_hidden_layers)
        if layer in hf.mlp_only_layers or (layer + 1) % hf.decoder_sparse_step
    ]
    if dense != list(range(len(dense))):
        raise _refuse(path, "mlp_only_layers", hf.mlp_only_layers, f"with decoder_sparse_"
                      f"step={hf.decoder_sparse_step} the dense layers are {dense}; ours are "
                      "the first ones")  # fmt: skip
    model |= {"dense_layers": len(dense), "dense_hidden": hf.intermediate_size}
    moe |= _routed_experts(hf, hf.moe_intermediate_size)


def _routed_experts(hf: Any, expert_hidden: int) -> dict[str, Any]:
    """The `model.moe` keys of the Qwen-MoE and OLMoE families' routed experts."""
    return {
        "num_experts": hf.num_experts,
        "expert_hidden": expert_hidden,
        "normalize_topk": bool(hf.norm_topk_prob),
        "lb_loss_weight": float(hf.router_aux_loss_coef),
    }


def _qwen3_moe_options(hf: Any, path: Path, model: dict[str, Any], moe: dict[str, Any]) -> None:
    if getattr(hf, "sliding_window", None) is not None:
        raise _refuse(path, "sliding_window", hf.sliding_window, "our attention is full")
    _qwen_moe_options(hf, path, model, moe)
    model["qk_norm"] = True


def _qwen2_moe_options(hf: Any, path: Path, model: dict[str, Any], moe: dict[str, Any]) -> None:
    _qwen_moe_options(hf, path, model, moe)
    shared, expert = hf.shared_expert_intermediate_size, hf.moe_intermediate_size
    if shared <= 0 or shared % expert:
        raise _refuse(path, "shared_expert_intermediate_size", shared, "our shared experts "
                      f"are a positive multiple of moe_intermediate_size={expert} wide")  # fmt: skip
    model |= {"qk_norm": False, "qkv_bias": bool(hf.qkv_bias)}
    moe |= {"shared_experts": shared // expert, "shared_expert_gate": True}


def _olmoe_options(hf: Any, path: Path, model: dict[str, Any], moe: dict[str, Any]) -> None:
    if getattr(hf, "clip_qkv", None) is not None:
        raise _refuse(path, "clip_qkv", hf.clip_qkv, "our attention does not clip q, k and v")
    model["qk_norm"] = "projection"
    moe |= _routed_experts(hf, hf.intermediate_size)


def _flex_olmo_options(hf: Any, path: Path, model: dict[str, Any], moe: dict[str, Any]) -> None:
    """OLMoE's options in OLMo-2's block: norms on the outputs of attention and feed-forward."""
    _olmoe_options(hf, path, model, moe)
    model["norm_placement"] = "output"


def _mixtral_options(hf: Any, path: Path, model: dict[str, Any], moe: dict[str, Any]) -> None:
    if hf.sliding_window is not None:
        raise _refuse(path, "sliding_window", hf.sliding_window, "our attention is full")
    if hf.router_jitter_noise:
        raise _refuse(path, "router_jitter_noise", hf.router_jitter_noise,
                      "our routers add no noise to their input in training")  # fmt: skip
    model["qk_norm"] = False
    moe |= {
        "num_experts": hf.num_local_experts,
        "expert_hidden": hf.intermediate_size,
        "normalize_topk": True,  # Mixtral always renormalises the top-k weights
        "lb_loss_weight": float(hf.router_aux_loss_coef),
    }


# ---- weights -----------------------------------------------------------------------------


def _shard_files(hf_dir: Path) -> dict[str, Path]:
    """Hub tensor name -> the safetensors file holding it."""
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ImportHFError(f"{index} is not a safetensors index: {e}") from e
        return {name: hf_dir / file for name, file in weight_map.items()}
    single = hf_dir / SINGLE_FILE
    if not single.is_file():
        raise ImportHFError(f"{hf_dir} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def _read_weights(
    hf_dir: Path, config: Config, architecture: Architecture
) -> tuple[dict[str, Tensor], list[str]]:
    """Our model tensors (float32), each assembled from the hub tensors cut from it."""
    files = _shard_files(hf_dir)
    shapes = checkpoint_shapes(config.model)
    by_source: dict[str, list[HFTensor]] = defaultdict(list)
    for t in architecture.tensors:
        if t.source is not None:
            by_source[t.source].append(t)
    ignored = _ignored_hub_tensors(hf_dir, files, architecture, config.model.n_layers)

    tensors: dict[str, Tensor] = {}
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def read(t: HFTensor) -> Tensor:
            return _read_hub_tensor(hf_dir, files, stack, opened, t)

        for t in architecture.tensors:
            if t.source is None:  # GLM-4-MoE's empty shared-expert MLP: present, no elements
                read(t)
        for name, shape in shapes.items():
            tensors[name] = _assemble(name, shape, by_source, files, read)
    return tensors, ignored


def _ignored_hub_tensors(
    hf_dir: Path, files: dict[str, Path], architecture: Architecture, n_layers: int
) -> list[str]:
    """The hub tensors we leave out (multi-token prediction); raise for any other extra one."""
    wanted = {t.name for t in architecture.tensors}
    unexpected, ignored = [], []
    for name in files:
        if name in wanted:
            continue
        parts = name.split(".")
        # Multi-token-prediction layers follow the last layer; transformers ignores them too.
        if name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= n_layers:
            ignored.append(name)
        else:
            unexpected.append(name)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ImportHFError(
            f"{hf_dir}: tensor {unexpected[0]}{more} has no place in our model "
            f"({architecture.name} as our model represents it)"
        )
    return ignored


def _read_hub_tensor(
    hf_dir: Path, files: dict[str, Path], stack: ExitStack, opened: dict[Path, Any], t: HFTensor
) -> Tensor:
    """Read hub tensor `t` from its shard (opened once, kept open in `stack`); check its shape."""
    from safetensors import SafetensorError, safe_open

    if t.name not in files:
        raise ImportHFError(f"{hf_dir}: tensor {t.name} is missing")
    file = files[t.name]
    try:
        if file not in opened:
            opened[file] = stack.enter_context(safe_open(file, "pt"))
        value = opened[file].get_tensor(t.name)
    except (OSError, SafetensorError) as e:
        raise ImportHFError(f"{file}: cannot read tensor {t.name}: {e}") from e
    if tuple(value.shape) != t.shape:
        raise ImportHFError(
            f"{file}: tensor {t.name} has shape {tuple(value.shape)}, config.json gives {t.shape}"
        )
    return value


def _assemble(
    name: str,
    shape: tuple[int, ...],
    by_source: dict[str, list[HFTensor]],
    files: dict[str, Path],
    read: Callable[[HFTensor], Tensor],
) -> Tensor:
    """Our tensor `name` (float32), filled from the hub tensors cut from it, each place once."""
    target = torch.zeros(shape, dtype=torch.float32)
    covered = torch.zeros(shape, dtype=torch.uint8)
    for t in by_source.get(name, []):
        value = read(t)
        if not value.is_floating_point():
            raise ImportHFError(f"{files[t.name]}: tensor {t.name} is {value.dtype}")
        rows = (target, covered) if t.row is None else (target[t.row], covered[t.row])
        t.take(rows[0]).copy_(value)
        t.take(rows[1]).add_(1)
    # Only GLM-4-MoE stores a selection bias; a softmax router's stays zero.
    bias_zero = name.endswith(".router.expert_bias") and name not in by_source
    if not bias_zero and not bool((covered == 1).all()):
        raise AssertionError(f"the mapping does not tile {name} exactly once")
    return target
