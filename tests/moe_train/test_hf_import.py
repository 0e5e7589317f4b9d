"""`moe-train import-hf`: a transformers model becomes our checkpoint, computing its logits,
training alike in any layout, and round-tripping export bitwise."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from harness.ranks import run_distributed
from moe_checkpoint import (
    OwnedSlice,
    SliceRequest,
    checkpoint_summary,
    load_into,
    load_slices,
    read_trainer_state,
)
from moe_plan.config import config_from_dict, load_config
from moe_train.cli import main
from moe_train.end_tokens import END_IDS_KEY, model_dir_end_ids
from moe_train.errors import ConfigError
from moe_train.generate import generate_ids
from moe_train.hf.tensor_map import checkpoint_shapes
from moe_train.model import Transformer
from moe_train.train import train
from training import assert_losses_match, train_cases

transformers = pytest.importorskip("transformers")

STEPS = 3
NEW_TOKENS = 6

COMMON = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "moe_intermediate_size": 16,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-6,
}

TWO_LAYERS = {"num_hidden_layers": 2}
"""For the families trained on pp2 as well (two pipeline stages)."""

HF_MODELS = {
    # Softmax routing, QK-norm, one dense first layer (mlp_only_layers), top-k renormalised.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            **COMMON,
            "num_experts": 4,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        },
    ),
    # YaRN: rope_parameters.rope_type = yarn (imported as model.rope_scaling).
    "qwen3_moe_yarn": (
        "Qwen3MoeConfig",
        {
            **COMMON,
            "num_experts": 4,
            "max_position_embeddings": 32,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "beta_fast": 16.0,
            },
        },
    ),
    # Unnormalised top-k, tied embeddings, no dense layer.
    "qwen3_moe_tied": (
        "Qwen3MoeConfig",
        {**COMMON, "num_experts": 4, "norm_topk_prob": False, "tie_word_embeddings": True},
    ),
    # Sigmoid routing with a selection bias, a shared expert, first_k_dense_replace, QK-norm.
    "glm4_moe": (
        "Glm4MoeConfig",
        {
            **COMMON,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "use_qk_norm": True,
            "norm_topk_prob": True,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 1.0,
            },
        },
    ),
    # Node-limited routing: 8 experts in 4 groups, each token in the 2 best groups, scaled.
    "glm4_moe_groups": (
        "Glm4MoeConfig",
        {
            **COMMON,
            "n_routed_experts": 8,
            "n_shared_experts": 0,
            "first_k_dense_replace": 0,
            "norm_topk_prob": True,
            "num_experts_per_tok": 3,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0},
        },
    ),
    # No shared experts (transformers builds an empty shared MLP), no QK-norm, unnormalised.
    "glm4_moe_no_shared": (
        "Glm4MoeConfig",
        {
            **COMMON,
            "n_routed_experts": 4,
            "n_shared_experts": 0,
            "first_k_dense_replace": 0,
            "norm_topk_prob": False,
            "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0},
        },
    ),
    # OLMoE: QK-norm over the whole q and k projections, an MoE feed-forward in every layer.
    "olmoe": (
        "OlmoeConfig",
        {
            **COMMON,
            **TWO_LAYERS,
            "intermediate_size": 16,
            "num_experts": 4,
            "norm_topk_prob": False,
        },
    ),
    # FlexOlmo: OLMoE's attention and experts with OLMo-2's norms on the sublayers' outputs.
    "flex_olmo": (
        "FlexOlmoConfig",
        {
            **COMMON,
            **TWO_LAYERS,
            "intermediate_size": 16,
            "num_experts": 4,
            "norm_topk_prob": True,
            "pad_token_id": 0,
            "eos_token_id": 1,
        },
    ),
    # Mixtral: no QK-norm, softmax top-k always renormalised.
    "mixtral": ("MixtralConfig", {**COMMON, "intermediate_size": 16, "num_local_experts": 4}),
    # Qwen2-MoE: q/k/v biases, a sigmoid-gated shared expert (2 experts wide), a dense layer.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            **COMMON,
            **TWO_LAYERS,
            "num_experts": 4,
            "shared_expert_intermediate_size": 32,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
        },
    ),
}


def _hf_model(case: str, directory: Path, seed: int = 0, **save_kwargs):
    """A random transformers model saved to `directory`; every weight (norms and the
    selection bias too) perturbed so that any misplaced tensor changes the logits."""
    config_class, kwargs = HF_MODELS[case]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and tensor.numel():
                scale = 0.5 if name.endswith("e_score_correction_bias") else 0.05
                tensor.add_(torch.randn_like(tensor) * scale)
    model.save_pretrained(directory, **save_kwargs)
    return model.eval()


def _named_state(model: Transformer) -> dict[str, torch.Tensor]:
    seen, named = set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            named[name] = tensor.detach()
    return named


def _our_model(out: Path) -> Transformer:
    config = load_config(out / "config.yaml")
    model = Transformer(config.model)
    load_into(out / "step_00000000", [OwnedSlice.whole(n, t) for n, t in _named_state(model).items()])  # fmt: skip
    return model.eval()


def _max_relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, str]:
    difference = (ours - theirs).abs()
    index = tuple(int(i) for i in torch.unravel_index(difference.argmax(), ours.shape))
    relative = float(difference.max() / ours.abs().max())
    return relative, f"worst at {index}: ours {ours[index]:.7g}, transformers {theirs[index]:.7g}"


@pytest.mark.parametrize(("case", "sharded"), [(c, c == "glm4_moe") for c in HF_MODELS])
def test_imported_model_gives_the_transformers_logits(case, sharded, tmp_path, capsys):
    hf_dir, out = tmp_path / "hf", tmp_path / "imported"
    hf_model = _hf_model(case, hf_dir, **({"max_shard_size": "20KB"} if sharded else {}))
    assert (hf_dir / "model.safetensors.index.json").is_file() == sharded
    assert main(["import-hf", str(hf_dir), "--out", str(out)]) == 0
    assert type(hf_model).__name__ in capsys.readouterr().out

    config = load_config(out / "config.yaml")
    assert config.checkpoint.init_from == str(out.resolve())
    assert config.model.vocab_size == COMMON["vocab_size"]
    assert config.data == config_from_dict({}).data
    summary = checkpoint_summary(out / "step_00000000")
    assert summary["step"] == 0 and set(summary["bytes_by_category"]) == {"model"}
    model = _our_model(out)
    assert {n: tuple(t.shape) for n, t in _named_state(model).items()} == checkpoint_shapes(
        config.model
    )

    tokens_BS = torch.randint(0, COMMON["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))  # fmt: skip
    with torch.no_grad():
        ours, theirs = model(tokens_BS).float(), hf_model(input_ids=tokens_BS).logits.float()
    relative, where = _max_relative_difference(ours, theirs)
    print(f"{case}: max relative logit difference {relative:.3g}")
    assert relative < 1e-5, f"{case}: relative difference {relative:.3g}; {where}"


FAMILIES = ("olmoe", "mixtral", "qwen2_moe")
"""The families whose every feature (projection-wide QK-norm, no QK-norm, q/k/v biases and a
gated shared expert) only import and export alike can check against transformers."""


@pytest.mark.parametrize("case", (*FAMILIES, "flex_olmo"))
def test_a_family_exports_back_bitwise_and_generates_alike(case, tmp_path, capsys):
    hf_dir, out, back = tmp_path / "hf", tmp_path / "imported", tmp_path / "exported"
    hf_model = _hf_model(case, hf_dir)
    assert main(["import-hf", str(hf_dir), "--out", str(out)]) == 0
    checkpoint = out / "step_00000000"
    assert main(["export", str(checkpoint), "--out", str(back), "--dtype", "float32"]) == 0
    assert type(hf_model).__name__ in capsys.readouterr().out

    from safetensors.torch import load_file

    original = load_file(hf_dir / "model.safetensors")
    exported = {}
    for shard in sorted(back.glob("model-*.safetensors")):
        exported |= load_file(shard)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(exported[name], tensor), name
    reloaded, loading = transformers.AutoModelForCausalLM.from_pretrained(
        back, dtype=torch.float32, output_loading_info=True
    )
    assert type(reloaded).__name__ == type(hf_model).__name__
    assert not any(loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        loading
    )

    # Greedy generation: ours with its KV cache, transformers' generate with its own.
    prompt_BS = torch.randint(0, COMMON["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(2))  # fmt: skip
    with torch.no_grad():
        ours = generate_ids(_our_model(out), prompt_BS, NEW_TOKENS)
        theirs = hf_model.generate(
            prompt_BS,
            attention_mask=torch.ones_like(prompt_BS),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )[:, prompt_BS.shape[1] :]
    assert torch.equal(ours, theirs), (ours, theirs)


def _training_data(out: Path, token_file: Path, run_dir: Path, **overrides) -> dict:
    """The imported config.yaml, set to train a few fp32 steps on `token_file`."""
    data = yaml.safe_load((out / "config.yaml").read_text())
    data["data"] |= {"paths": [str(token_file)], "seq_len": 32, "global_batch_size": 8,
                     "micro_batch_size": 2}  # fmt: skip
    data["train"] |= {"max_steps": STEPS, "run_dir": str(run_dir), "progress": False,
                      "peak_flops": 1e11}  # fmt: skip
    data["optim"] |= {"lr": 3e-3, "warmup_steps": 1}
    data["precision"]["compute_dtype"] = "float32"
    for key, value in overrides.items():
        data[key] |= value
    return data


@pytest.mark.slow
def test_init_from_trains_alike_on_one_process_and_expert_parallel(token_file, tmp_path, capsys):
    hf_dir, out = tmp_path / "hf", tmp_path / "imported"
    _hf_model("glm4_moe", hf_dir)
    assert main(["import-hf", str(hf_dir), "--out", str(out)]) == 0

    single = train(config_from_dict(_training_data(out, token_file, tmp_path / "single")))
    printed = capsys.readouterr().err
    assert f"started from the model tensors of {out.resolve() / 'step_00000000'}" in printed
    fresh_data = _training_data(out, token_file, tmp_path / "fresh")
    fresh_data["checkpoint"]["init_from"] = None
    fresh = train(config_from_dict(fresh_data))
    assert abs(single.losses[0] - fresh.losses[0]) > 1e-3, "init_from changed nothing"

    # ep2, with replicated AdamW and with the distributed optimizer (its own master weights);
    # and each family added by issue 32 on ep2 (and pp2 where it has a new option), all in one
    # spawn.
    cases, references = {}, {}
    for name, zero in (("ep2", False), ("ep2_distributed_optimizer", True)):
        parallel = {"ep": 2, "dispatcher": "all_to_all", "distributed_optimizer": zero}
        cases[name] = _training_data(out, token_file, tmp_path / name, parallel=parallel)
        references[name] = single.losses
    for family in FAMILIES:
        family_out = tmp_path / f"{family}-imported"
        _hf_model(family, tmp_path / family)
        assert main(["import-hf", str(tmp_path / family), "--out", str(family_out)]) == 0
        alone = _training_data(family_out, token_file, tmp_path / f"{family}-single")
        references[f"{family}_ep2"] = train(config_from_dict(alone)).losses
        parallel = {"ep": 2, "dispatcher": "all_to_all"}
        run_dir = tmp_path / f"{family}-ep2"
        cases[f"{family}_ep2"] = _training_data(family_out, token_file, run_dir, parallel=parallel)
        if family != "mixtral":  # projection-wide QK-norm, q/k/v biases, the shared gate
            references[f"{family}_pp2"] = references[f"{family}_ep2"]
            run_dir = tmp_path / f"{family}-pp2"
            cases[f"{family}_pp2"] = _training_data(family_out, token_file, run_dir, parallel={"pp": 2})  # fmt: skip
    per_rank = run_distributed(train_cases, world_size=2, args=(cases,))
    for name in cases:
        losses, reference = per_rank[0][name], references[name]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        with capsys.disabled():
            print(f"{name}: losses {reference[0]:.4f} -> {reference[-1]:.4f}, "
                  f"max relative difference {worst:.3g}")  # fmt: skip
        assert_losses_match(f"{name} from imported weights", losses, reference)

    # A relaunch with resume=auto continues its own run and ignores init_from.
    again = _training_data(out, token_file, tmp_path / "single", train={"max_steps": STEPS + 1},
                           checkpoint={"resume": "auto"})  # fmt: skip
    resumed = train(config_from_dict(again))
    assert resumed.start_step == STEPS
    assert "checkpoint.init_from=" in capsys.readouterr().err


def test_init_from_refuses_another_model(token_file, tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "imported"
    _hf_model("qwen3_moe", hf_dir)
    assert main(["import-hf", str(hf_dir), "--out", str(out)]) == 0
    data = _training_data(out, token_file, tmp_path / "run", model={"n_kv_heads": 4})
    with pytest.raises(ConfigError, match=r"^model\.n_kv_heads=4 differs from 2 in checkpoint"):
        train(config_from_dict(data))
    assert not (tmp_path / "run").exists()
    # The expert-GEMM choice is not the model: it may differ from the importer's default.
    data = _training_data(out, token_file, tmp_path / "run", train={"max_steps": 1})
    data["precision"]["expert_gemm"] = "auto"
    assert len(train(config_from_dict(data)).losses) == 1


@pytest.mark.parametrize(
    "sections",
    [
        {"model": {"qk_norm": True, "dense_layers": 1, "dense_hidden": 48}},
        {
            "model": {
                "n_layers": 3,
                "dense_layers": 1,
                "dense_hidden": 48,
                "tie_embeddings": True,
                "moe": {"router": "sigmoid", "shared_experts": 1, "bias_update_rate": 0.05},
            }
        },
        {
            "model": {
                "qk_norm": True,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 8.0,
                    "original_max_position_embeddings": 4,
                    "attention_factor": 1.25,
                },
            }
        },
    ],
    ids=["qwen3_moe", "glm4_moe_tied_bias", "qwen3_moe_yarn"],
)
def test_export_then_import_reproduces_every_tensor_bitwise(sections, make_config, tmp_path):
    config = make_config(tmp_path, train={"max_steps": 3}, **sections)
    result = train(config)
    hf_dir, out = tmp_path / "hf", tmp_path / "imported"
    assert main(["export", str(result.checkpoint), "--out", str(hf_dir)]) == 0
    assert main(["import-hf", str(hf_dir), "--out", str(out)]) == 0

    imported = load_config(out / "config.yaml").model
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "qk_norm",
                "rope_theta", "rope_scaling", "norm_eps", "dense_layers", "tie_embeddings"):  # fmt: skip
        assert getattr(imported, key) == getattr(config.model, key), key
    for key in ("num_experts", "top_k", "expert_hidden", "shared_experts", "router"):
        assert getattr(imported.moe, key) == getattr(config.model.moe, key), key
    shapes = checkpoint_shapes(config.model)
    original = dict(zip(shapes, load_slices(result.checkpoint, [SliceRequest.whole(n, s) for n, s in shapes.items()]), strict=True))  # fmt: skip
    after = dict(zip(shapes, load_slices(out / "step_00000000", [SliceRequest.whole(n, s) for n, s in shapes.items()]), strict=True))  # fmt: skip
    if config.model.moe.bias_update_rate:
        assert any(bool(t.any()) for n, t in original.items() if n.endswith("expert_bias"))
    for name in shapes:
        assert original[name].dtype == after[name].dtype == torch.float32, name
        assert torch.equal(original[name], after[name]), name


def _refused(tmp_path: Path, capsys, hf_dir: Path, option: str) -> None:
    out = tmp_path / "imported"
    capsys.readouterr()
    assert main(["import-hf", str(hf_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and option in err, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".import-" in p.name]


@pytest.mark.parametrize(
    ("config_class", "kwargs", "option"),
    [
        ("Glm4MoeConfig", {}, "partial_rotary_factor=0.5"),  # GLM-4-MoE's default
        ("Qwen3MoeConfig", {"use_sliding_window": True, "sliding_window": 16}, "sliding_window=16"),
        ("Qwen3MoeConfig", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
        ("Qwen3MoeConfig", {"attention_bias": True}, "attention_bias=True"),
        ("Qwen3MoeConfig", {"head_dim": 16}, "head_dim=16"),
        (
            "Qwen3MoeConfig",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            "rope_type",
        ),
        (
            "Qwen3MoeConfig",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "original_max_position_embeddings": 8,
                    "mscale": 0.7,
                    "mscale_all_dim": 1.0,
                }
            },
            "mscale=0.7",
        ),
        ("OlmoeConfig", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
        ("MixtralConfig", {"router_jitter_noise": 0.01}, "router_jitter_noise=0.01"),
        ("MixtralConfig", {"sliding_window": 16}, "sliding_window=16"),
        (
            "Qwen2MoeConfig",
            {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 24},
            "shared_expert_intermediate_size=24",
        ),
        (
            "Qwen2MoeConfig",
            {"use_sliding_window": True, "sliding_window": 16},
            "sliding_window=16",
        ),
    ],
)
def test_an_option_our_model_does_not_represent_is_refused(config_class, kwargs, option, tmp_path, capsys):  # fmt: skip
    hf_dir = tmp_path / "hf"
    base = {k: v for k, v in COMMON.items() if k != "head_dim"}
    getattr(transformers, config_class)(**(base | kwargs)).save_pretrained(hf_dir)
    _refused(tmp_path, capsys, hf_dir, option)


def test_another_architecture_is_refused(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    (hf_dir / "config.json").write_text(json.dumps(config))
    _refused(tmp_path, capsys, hf_dir, "DeepseekV3ForCausalLM")


def test_a_tensor_without_a_place_is_refused(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    _hf_model("qwen3_moe", hf_dir)
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    _refused(tmp_path, capsys, hf_dir, "model.layers.0.self_attn.q_proj.bias")


def test_the_end_tokens_a_model_directory_names_end_generation(tmp_path, capsys):
    hf_dir, out, back = tmp_path / "hf", tmp_path / "imported", tmp_path / "exported"
    hf_model = _hf_model("qwen3_moe", hf_dir)
    prompt = [1, 2, 3]
    with torch.no_grad():
        free = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, 3, dtype=torch.long),
            do_sample=False, max_new_tokens=8, pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
    # The end: the first token after two drawn for the first time; `unused` is never drawn.
    stop = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    unused = next(i for i in range(COMMON["vocab_size"] - 1, 0, -1) if i not in free)
    # A list in generation_config.json, preferred to config.json's (the first token drawn).
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused, free[stop]]}))  # fmt: skip
    raw = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(raw | {"eos_token_id": free[0]}))
    assert main(["import-hf", str(hf_dir), "--out", str(out)]) == 0
    checkpoint = out / "step_00000000"
    assert read_trainer_state(checkpoint)[END_IDS_KEY] == [unused, free[stop]]

    capsys.readouterr()
    args = ["generate", str(checkpoint), "--prompt-ids", "1,2,3", "--max-new-tokens", "8"]
    assert main([*args, "--json"]) == 0
    generated = json.loads(capsys.readouterr().out)
    assert generated["ids"] == free[: stop + 1] and generated["stop_reason"] == "eos", (generated, free)  # fmt: skip
    # Exported again, the model names the same end tokens.
    assert main(["export", str(checkpoint), "--out", str(back)]) == 0
    generation = json.loads((back / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [unused, free[stop]], generation


def test_end_tokens_come_from_config_json_without_generation_config(tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    assert model_dir_end_ids(hf_dir) == []
    (hf_dir / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert model_dir_end_ids(hf_dir) == [5]
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    (hf_dir / "config.json").write_text(json.dumps({"eos_token_id": [7, 3, 7]}))
    assert model_dir_end_ids(hf_dir) == [7, 3]

    # A value that is no token id is refused before anything is written.
    base = {k: v for k, v in COMMON.items() if k != "head_dim"}
    transformers.Qwen3MoeConfig(**base).save_pretrained(hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, "two"]}))
    _refused(tmp_path, capsys, hf_dir, "generation_config.json: eos_token_id=[1, 'two'] must be")
