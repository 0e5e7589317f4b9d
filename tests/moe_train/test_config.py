"""Config loading, overrides and validation errors that name the key and the constraint."""

import dataclasses

import pytest
import yaml

from moe_train.config import (
    Config,
    DataConfig,
    config_from_dict,
    dump_config,
    load_config,
    parse_overrides,
)
from moe_train.errors import ConfigError, DataError
from training import CONFIGS


@pytest.mark.parametrize(
    "name",
    [
        "tiny",
        "medium",
        "olmoe-1b-7b",
        "moe-47b-a3b",
        "published-47b-a3b",
        "published-1t-a58b",
        "published-qwen3-30b-a3b-b200",
        "published-qwen3-30b-a3b-h100",
        "published-qwen3-235b-a22b-b200",
        "published-qwen3-235b-a22b-h100",
    ],
)
def test_shipped_configs_load(name):
    """Every key the file sets holds the file's value; every other key its default."""
    path = CONFIGS / f"{name}.yaml"
    _assert_holds(load_config(path), Config(), yaml.safe_load(path.read_text()), "")


def _assert_holds(loaded, default, data: dict, path: str) -> None:
    """Each field of the dataclass `loaded` equals its entry in `data` or, without one, the
    same field of `default`."""
    names = [field.name for field in dataclasses.fields(loaded)]
    assert set(data) <= set(names), f"{path}: keys {sorted(set(data) - set(names))} not loaded"
    for name in names:
        value, key = getattr(loaded, name), f"{path}{name}"
        if dataclasses.is_dataclass(value):
            _assert_holds(value, getattr(default, name), data.get(name) or {}, f"{key}.")
        else:
            expected = data.get(name, getattr(default, name))
            assert value == expected, f"{key}: loaded {value!r}, expected {expected!r}"
            assert type(value) is type(expected) or isinstance(value, float), key


def test_overrides_reach_nested_keys_and_parse_types():
    config = load_config(
        CONFIGS / "tiny.yaml",
        ["--optim.lr=3e-4", "--model.moe.top_k", "1", "--model.moe.capacity_factor=null"],
    )
    assert config.optim.lr == pytest.approx(3e-4)
    assert config.model.moe.top_k == 1
    assert config.model.moe.capacity_factor is None


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 3e-4\n")
    assert load_config(path).optim.lr == pytest.approx(3e-4)


def test_resolved_config_round_trips(tmp_path):
    config = load_config(CONFIGS / "tiny.yaml", ["--model.moe.capacity_factor=1.25"])
    dump_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"model": {"moe": {"top_kk": 2}}},
            "unknown config key model.moe.top_kk; did you mean model.moe.top_k?",
        ),
        ({"optimm": {}}, "unknown config key optimm; did you mean optim?"),
        ({"model": {"d_model": "wide"}}, "model.d_model='wide' must be an integer"),
        ({"model": {"qk_norm": 1}}, "model.qk_norm=1 must be true/false"),
        (
            {"model": {"qk_norm": "heads"}},
            "model.qk_norm='heads' must be true/false or one of 'projection'",
        ),
        (
            {"model": {"moe": {"shared_expert_gate": True}}},
            "model.moe.shared_expert_gate=true gates the shared experts; set "
            "model.moe.shared_experts to at least 1",
        ),
        (
            {"model": {"moe": {"top_k": 9}}},
            "model.moe.top_k=9 must be between 1 and model.moe.num_experts=8",
        ),
        (
            {"model": {"d_model": 100, "n_heads": 3}},
            "model.n_heads=3 must divide model.d_model=100",
        ),
        (
            {"model": {"n_heads": 4, "n_kv_heads": 3}},
            "model.n_kv_heads=3 must divide model.n_heads=4",
        ),
        (
            {"data": {"global_batch_size": 10, "micro_batch_size": 4}},
            "data.micro_batch_size=4 must divide data.global_batch_size=10",
        ),
        (
            {"parallel": {"dispatcher": "magic"}},
            "parallel.dispatcher='magic' must be one of 'auto', 'local', 'all_to_all', 'rowwise', 'deepep'",
        ),
        (
            {"parallel": {"rowwise_transport": "nvlink"}},
            "parallel.rowwise_transport='nvlink' must be one of 'all_to_all', 'symmetric_memory'",
        ),
        ({"optim": {"betas": [0.9]}}, "optim.betas=[0.9] must be two numbers in [0, 1)"),
        ({"train": {"max_steps": 0}}, "train.max_steps=0 must be positive"),
        (
            {"model": {"moe": {"capacity_factor": -1}}},
            "model.moe.capacity_factor=-1.0 must be positive",
        ),
        (
            {"model": {"tie_embeddings": True}, "parallel": {"pp": 2}},
            "model.tie_embeddings=true cannot be split over pipeline stages (the embedding is on "
            "the first, the head on the last); set it to false or parallel.pp=1",
        ),
    ],
)
def test_bad_values_name_the_key_and_constraint(data, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match=r"must look like --section\.key=value"):
        parse_overrides(["optim.lr=1"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--optim.lr"])


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML at line"):
        load_config(bad)


def test_document_masking_needs_data_that_declares_its_end_of_document_id():
    data = DataConfig(paths=["a.npy", "b"], document_masking=True)
    data.validate_end_of_document(256)
    with pytest.raises(DataError) as info:
        data.validate_end_of_document(None)
    assert str(info.value) == (
        "data.document_masking=true needs documents that end at an end-of-document id, but "
        "data.paths a.npy, b declare none; prepare the data with moe-train prepare-data (it "
        "records the id) or set data.document_masking=false"
    )
    DataConfig(paths=["a.npy"]).validate_end_of_document(None)


def test_config_changes_compare_the_keys_both_configs_have():
    """Resume and verify compare saved configs with this one function: nested keys by their
    dotted names, in the new config's order; a key only one side has (added by a newer
    version) is not a change."""
    from moe_train.config import Change, config_changes, flatten_config

    saved = {"model": {"d_model": 64, "moe": {"top_k": 2}}, "train": {"seed": 0}, "data": {}}
    now = {
        "model": {"d_model": 64, "moe": {"top_k": 4, "new_key": 1}},
        "train": {"seed": 1},
        "data": {},
    }
    assert config_changes(saved, now) == [
        Change("model.moe.top_k", 2, 4),
        Change("train.seed", 0, 1),
    ]
    assert config_changes(saved, saved) == []
    assert flatten_config(now) == {
        "model.d_model": 64,
        "model.moe.top_k": 4,
        "model.moe.new_key": 1,
        "train.seed": 1,
        "data": {},
    }
