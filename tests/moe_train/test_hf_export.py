"""`moe-train export`: transformers loads the directory and computes our logits and tokens."""

import json
from pathlib import Path

import pytest
import torch

from moe_checkpoint import read_trainer_state
from moe_train.cli import main
from moe_train.generate import generate_ids
from moe_train.train import train
from tokenizer_files import bpe_tokenizer_file
from training import CODE_TEXT

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

NEW_TOKENS = 8

CASES = {
    # Qwen3-MoE: softmax router, per-head QK-norm, top-k renormalised or not, dense-first layers.
    "qwen3_moe": ("Qwen3MoeForCausalLM", {"model": {"qk_norm": True}}),
    "qwen3_moe_dense_first_unnormalised_tied": (
        "Qwen3MoeForCausalLM",
        {
            "model": {
                "n_layers": 3,
                "dense_layers": 1,
                "dense_hidden": 48,
                "tie_embeddings": True,
                "moe": {"normalize_topk": False},
            }
        },
    ),
    # GLM-4-MoE: sigmoid router with a selection bias, shared experts, dense-first layers.
    "glm4_moe_shared_bias": (
        "Glm4MoeForCausalLM",
        {
            "model": {
                "n_layers": 3,
                "dense_layers": 1,
                "dense_hidden": 48,
                "moe": {"router": "sigmoid", "shared_experts": 1, "bias_update_rate": 0.01},
            }
        },
    ),
    # FlexOlmo: QK-norm over the whole projections, norms on the sublayers' outputs.
    "flex_olmo": (
        "FlexOlmoForCausalLM",
        {"model": {"qk_norm": "projection", "norm_placement": "output"}},
    ),
    # YaRN context extension (rope_parameters.rope_type = yarn), the default attention factor
    # and a given one.
    "qwen3_moe_yarn": (
        "Qwen3MoeForCausalLM",
        {
            "model": {
                "qk_norm": True,
                "rope_theta": 1000.0,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 6,
                },
            }
        },
    ),
    "glm4_moe_yarn_attention_factor": (
        "Glm4MoeForCausalLM",
        {
            "model": {
                "moe": {"router": "sigmoid"},
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 2.0,
                    "original_max_position_embeddings": 12,
                    "beta_fast": 16.0,
                    "attention_factor": 1.3,
                },
            }
        },
    ),
    # Node-limited routing (4 groups, 2 per token) with scaled combine weights.
    "glm4_moe_groups_scaled": (
        "Glm4MoeForCausalLM",
        {
            "model": {
                "moe": {
                    "router": "sigmoid",
                    "num_experts": 8,
                    "top_k": 3,
                    "n_group": 4,
                    "topk_group": 2,
                    "routed_scaling_factor": 2.5,
                    "bias_update_rate": 0.01,
                }
            }
        },
    ),
    "glm4_moe_no_qk_norm_no_shared": (
        "Glm4MoeForCausalLM",
        {"model": {"qk_norm": False, "moe": {"router": "sigmoid", "normalize_topk": False}}},
    ),
    # OLMoE: QK-norm over the whole q and k projections, top-k not renormalised.
    "olmoe": (
        "OlmoeForCausalLM",
        {
            "model": {
                "qk_norm": "projection",
                "moe": {"normalize_topk": False},
            }
        },
    ),
    # Mixtral: no QK-norm, softmax top-k renormalised, tied embeddings.
    "mixtral_tied": ("MixtralForCausalLM", {"model": {"qk_norm": False, "tie_embeddings": True}}),
    # Qwen2-MoE: q/k/v biases, a sigmoid-gated shared expert (2 wide), a dense first layer.
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        {
            "model": {
                "qk_norm": False,
                "qkv_bias": True,
                "n_layers": 3,
                "dense_layers": 1,
                "dense_hidden": 48,
                "moe": {"shared_experts": 2, "shared_expert_gate": True},
            }
        },
    ),
}


def _trained(make_config, tmp_path: Path, sections: dict):
    config = make_config(tmp_path, train={"max_steps": 3}, **sections)
    result = train(config)
    assert result.checkpoint is not None
    return config, result


def _max_relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, str]:
    """max |ours - theirs| / max |ours|, and where the worst element is with both values."""
    difference = (ours - theirs).abs()
    worst = int(difference.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ours.shape))
    relative = float(difference.max() / ours.abs().max())
    return relative, f"worst at {index}: ours {ours[index]:.7g}, transformers {theirs[index]:.7g}"


@pytest.mark.parametrize("case", list(CASES))
def test_exported_model_gives_our_logits_and_greedy_tokens(case, make_config, tmp_path, capsys):
    architecture, sections = CASES[case]
    config, result = _trained(make_config, tmp_path, sections)
    out = tmp_path / "hf"
    assert main(["export", str(result.checkpoint), "--out", str(out), "--dtype", "float32"]) == 0
    assert architecture in capsys.readouterr().out

    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["architectures"] == [architecture]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    num_experts = config.model.moe.num_experts
    last = config.model.n_layers - 1
    block = "block_sparse_moe" if architecture == "MixtralForCausalLM" else "mlp"
    projections = ("w1", "w3", "w2") if block == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")  # fmt: skip
    for n in range(num_experts):
        for projection in projections:
            name = f"model.layers.{last}.{block}.experts.{n}.{projection}.weight"
            assert name in index["weight_map"], name
    assert (out / "generation_config.json").is_file()

    hf_model, loading = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert type(hf_model).__name__ == architecture
    assert not any(loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        loading
    )
    hf_model.eval()
    model = result.model.eval()

    generator = torch.Generator().manual_seed(1)
    tokens_BS = torch.randint(0, config.model.vocab_size, (2, 24), generator=generator)
    with torch.no_grad():
        ours = model(tokens_BS).float()
        theirs = hf_model(input_ids=tokens_BS).logits.float()
    relative, where = _max_relative_difference(ours, theirs)
    print(f"{case}: max relative logit difference {relative:.3g}")
    assert relative < 1e-5, f"{case}: relative difference {relative:.3g}; {where}"

    prompt_BS = tokens_BS[:, :8]
    with torch.no_grad():
        ours_new = generate_ids(model, prompt_BS, NEW_TOKENS)  # greedy, with our KV cache
        generated = hf_model.generate(
            prompt_BS,
            attention_mask=torch.ones_like(prompt_BS),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
        )
    assert torch.equal(generated[:, prompt_BS.shape[1] :], ours_new), (generated, ours_new)


@pytest.mark.parametrize(
    ("sections", "option"),
    [
        (
            {"model": {"qk_norm": False, "moe": {"normalize_topk": False}}},
            "model.moe.normalize_topk=false with model.qk_norm=false",
        ),
        ({"model": {"moe": {"shared_experts": 1}}}, "model.moe.shared_experts=1"),
        ({"model": {"qk_norm": False, "qkv_bias": True}}, "model.qkv_bias=true"),
        (
            {"model": {"moe": {"shared_experts": 1, "shared_expert_gate": True}}},
            "model.qk_norm=true with gated shared experts",
        ),
        (
            {
                "model": {
                    "qk_norm": "projection",
                    "n_layers": 3,
                    "dense_layers": 1,
                    "dense_hidden": 48,
                }
            },
            "model.dense_layers=1: OLMoE",
        ),
        (
            {"model": {"qk_norm": "projection", "moe": {"router": "sigmoid"}}},
            "model.qk_norm='projection' with model.moe.router='sigmoid'",
        ),
        (
            {"model": {"qk_norm": True, "norm_placement": "output"}},
            "model.norm_placement='output' with model.moe.shared_experts=0, "
            "model.qkv_bias=false, model.qk_norm=true: FlexOlmo",
        ),
        (
            {"model": {"norm_placement": "output", "moe": {"router": "sigmoid"}}},
            "model.norm_placement='output' normalises the outputs of attention and "
            "feed-forward; GLM-4-MoE",
        ),
        ({"model": {"moe": {"capacity_factor": 2.0}}}, "model.moe.capacity_factor=2.0"),
        ({"model": {"moe": {"bias_update_rate": 0.01}}}, "model.moe.bias_update_rate"),
    ],
)
def test_an_option_no_architecture_represents_is_refused(sections, option, make_config, tmp_path, capsys):  # fmt: skip
    _, result = _trained(make_config, tmp_path, sections)
    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["export", str(result.checkpoint), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and option in err, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".export-" in p.name]


def test_bfloat16_export_writes_bfloat16_tensors(make_config, tmp_path):
    _, result = _trained(make_config, tmp_path, {"model": {"qk_norm": True}})
    root = result.checkpoint.parent  # a checkpoints root: its newest checkpoint is exported
    out = tmp_path / "hf"
    assert main(["export", str(root), "--out", str(out), "--dtype", "bfloat16"]) == 0
    shards = sorted(out.glob("model-*.safetensors"))
    assert shards
    dtypes = {t.dtype for shard in shards for t in safetensors_torch.load_file(shard).values()}
    assert dtypes == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert next(hf_model.parameters()).dtype == torch.bfloat16


def test_export_refuses_a_non_empty_out_directory(make_config, tmp_path, capsys):
    _, result = _trained(make_config, tmp_path, {"model": {"qk_norm": True}})
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(result.checkpoint), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_export_writes_the_tokenizer_the_data_was_prepared_with(make_config, tmp_path, capsys):
    from moe_data import prepare_data

    text = CODE_TEXT * 400
    (tmp_path / "train.txt").write_text(text)
    tokenizer_file = bpe_tokenizer_file(tmp_path, text)
    meta = prepare_data([tmp_path / "train.txt"], tmp_path / "data", tokenizer=str(tokenizer_file))
    data = {"paths": [str(tmp_path / "data")], "seq_len": 16}
    model = {"qk_norm": True, "vocab_size": 320}
    _, result = _trained(make_config, tmp_path, {"model": model, "data": data})
    out = tmp_path / "hf"
    assert main(["export", str(result.checkpoint), "--out", str(out)]) == 0
    assert "note:" not in capsys.readouterr().out

    assert (out / "tokenizer.json").is_file()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    sample = "class Point:\n    return a + b"
    ids = _bpe_encode(tokenizer_file, sample)
    assert hf_tokenizer(sample, add_special_tokens=False)["input_ids"] == ids
    assert hf_tokenizer.eos_token_id == meta["eos_id"]
    assert hf_tokenizer.decode(ids) == sample
    assert (
        json.loads((out / "generation_config.json").read_text())["eos_token_id"] == (meta["eos_id"])
    )


def _bpe_encode(tokenizer_file: Path, text: str) -> list[int]:
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(tokenizer_file)).encode(text).ids


def test_byte_tokenizer_exports_as_a_tokenizer_json_giving_utf8_bytes(
    make_config, tmp_path, capsys
):
    from moe_data import ByteTokenizer, prepare_data

    (tmp_path / "train.txt").write_text(CODE_TEXT * 400)
    prepare_data([tmp_path / "train.txt"], tmp_path / "data")
    data = {"paths": [str(tmp_path / "data")]}
    model = {"qk_norm": True, "vocab_size": 320}
    _, result = _trained(make_config, tmp_path, {"model": model, "data": data})
    out = tmp_path / "hf"
    assert main(["export", str(result.checkpoint), "--out", str(out)]) == 0
    assert "note:" not in capsys.readouterr().out
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours = ByteTokenizer()
    for text in ("héllo wörld\n\t  x", "日本語 🙂", "  a  b\r\n", "a<|endoftext|>b"):
        ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == ours.encode(text).tolist(), text
        assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.eos_token_id == ours.eos_id
    assert hf_tokenizer.convert_tokens_to_ids(hf_tokenizer.eos_token) == 256
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256


def test_token_array_data_exports_without_tokenizer_files_and_says_so(
    make_config, tmp_path, capsys
):
    _, result = _trained(make_config, tmp_path, {"model": {"qk_norm": True}})
    out = tmp_path / "hf"
    assert main(["export", str(result.checkpoint), "--out", str(out)]) == 0
    assert "note: wrote no tokenizer files" in capsys.readouterr().out
    assert not (out / "tokenizer.json").exists()


def test_many_shards_load_as_one_model(make_config, tmp_path):
    from moe_train.hf import export_checkpoint

    config, result = _trained(make_config, tmp_path, {"model": {"qk_norm": True}})
    out = tmp_path / "hf"
    export_checkpoint(result.checkpoint, out, max_shard_bytes=20_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens_BS = torch.randint(0, config.model.vocab_size, (1, 16))
    with torch.no_grad():
        ours, theirs = result.model.eval()(tokens_BS), hf_model(input_ids=tokens_BS).logits
    relative, where = _max_relative_difference(ours, theirs)
    assert relative < 1e-5, where


def _prepared_corpus(root: Path, name: str, files: int, text: str) -> Path:
    """`files` small text files under root/NAME-inputs prepared into root/NAME (64K shards)."""
    from moe_data import prepare_data

    inputs = root / f"{name}-inputs"
    inputs.mkdir()
    for index in range(files):
        (inputs / f"doc{index:03d}.txt").write_text(f"# file {index}\n" + text)
    prepare_data(sorted(inputs.iterdir()), root / name, shard_size="64K")
    return root / name


def _listing_digest(directory: Path) -> str:
    """What `sha256sum tokens-*.bin | sha256sum` prints in `directory`, computed here."""
    import hashlib

    lines = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
        for p in sorted(directory.glob("tokens-*.bin"))
    )
    return hashlib.sha256(lines.encode()).hexdigest()


def test_model_card_lists_data_by_source_without_machine_paths(make_config, tmp_path, capsys):
    import re
    import sys

    sources = {
        "code": _prepared_corpus(tmp_path, "code", 30, CODE_TEXT * 60),
        "prose": _prepared_corpus(tmp_path, "prose", 20, "The cat sat on the mat.\n" * 150),
    }
    data = {"paths": [str(p) for p in sources.values()], "seq_len": 16}
    config, result = _trained(make_config, tmp_path, {"model": {"vocab_size": 320}, "data": data})
    out = tmp_path / "hf"
    assert main(["export", str(result.checkpoint), "--out", str(out), "--name", "tiny-coder"]) == 0
    card = (out / "README.md").read_text()

    assert len(card.encode()) < 4096, len(card.encode())
    assert card.split("---\n")[2].startswith("\n# tiny-coder\n")
    # A model under a million parameters is counted in thousands, not as "0.0M".
    assert re.search(
        r"A \d+\.\dK-parameter mixture-of-experts language model \(\d+\.\dK active", card
    )
    for leak in (str(tmp_path), str(Path.home()), sys.prefix, "site-packages", "doc000.txt"):
        assert leak not in card, leak
    assert re.search(r"(^|[\s`(|'\"])/\w", card, re.MULTILINE) is None, "an absolute path"
    seen = read_trainer_state(result.checkpoint)["tokens_per_source"]
    for name, directory in sources.items():
        meta = json.loads((directory / "meta.json").read_text())
        assert len(meta["shards"]) > 1 and len(meta["sources"]) in (30, 20)
        row = (
            f"| {name} | {meta['num_documents']:,} | {meta['num_tokens']:,} | "
            f"{seen[str(directory)]:,} | {len(meta['sources'])} | bytes | "
            f"{len(meta['shards'])} (`{_listing_digest(directory)}`) |"
        )
        assert row in card, row
    assert sum(seen.values()) == 3 * config.data.global_batch_size * config.data.seq_len

    # Without --name the title is the run's name (its run directory), not the output's.
    assert main(["export", str(result.checkpoint), "--out", str(tmp_path / "exported")]) == 0
    assert "\n# run\n" in (tmp_path / "exported" / "README.md").read_text()
    capsys.readouterr()
    assert (
        main(["export", str(result.checkpoint), "--out", str(tmp_path / "x"), "--name", " "]) == 2
    )
    assert (
        capsys.readouterr().err.strip() == "error: --name=' ' must be a non-empty name on one line"
    )
    assert not (tmp_path / "x").exists()


def test_the_run_name_is_its_run_directory_as_train_made_it(make_config, tmp_path):
    from moe_train.hf.export import run_name

    config = make_config(tmp_path)  # train.run_dir = tmp_path/run
    assert run_name(config, tmp_path / "run" / "checkpoints" / "step_00000003") == "run"
    assert run_name(config, tmp_path / "run.2" / "checkpoints" / "step_00000003") == "run.2"
    assert run_name(config, tmp_path / "copies" / "step_00000003") == "run"
    assert run_name(config, tmp_path / "other" / "checkpoints" / "step_00000003") == "run"
    elsewhere = make_config(tmp_path, checkpoint={"dir": str(tmp_path / "ckpts")})
    assert run_name(elsewhere, tmp_path / "run.2" / "checkpoints" / "step_00000003") == "run"
