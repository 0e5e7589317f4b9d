"""Config loading, overrides and validation errors that name the key and the constraint."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from moe_plan.config import (
    Config,
    DataConfig,
    DispatchChoice,
    check_start,
    choose_dispatcher,
    config_from_dict,
    dispatcher_reason,
    dump_config,
    load_config,
    parse_overrides,
    transport_candidates,
)
from moe_plan.errors import ConfigError, DataError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", sorted(path.stem for path in CONFIGS.glob("*.yaml")))
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
            "parallel.rowwise_transport='nvlink' must be one of 'auto', 'all_to_all', 'symmetric_memory'",
        ),
        ({"optim": {"betas": [0.9]}}, "optim.betas=[0.9] must be two numbers in [0, 1)"),
        ({"train": {"max_steps": 0}}, "train.max_steps=0 must be positive"),
        (
            {"train": {"max_steps": 5, "profile": [2, 6]}},
            "train.profile=[2, 6]: steps to trace must be whole numbers from 1 to "
            "train.max_steps=5; 6 is not",
        ),
        ({"train": {"profile": [0]}}, "0 is not"),
        ({"train": {"profile": ["x"]}}, "train.profile"),
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
    from moe_plan.config import Change, config_changes, flatten_config

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


# ---- keys of an alternative not chosen ----------------------------------------------------

OPTION_SETTINGS = {
    ("optim.name",): (["--optim.name=adamw"], ["--optim.name=muon"]),
    ("optim.schedule",): (["--optim.schedule=constant"], ["--optim.schedule=linear"]),
    ("parallel.dispatcher", "model.moe.capacity_factor"): (
        ["--parallel.dispatcher=all_to_all", "--model.moe.capacity_factor=1.25"],
        ["--parallel.dispatcher=auto", "--model.moe.capacity_factor=1.25"],
    ),
    ("model.mtp_depth",): (["--model.mtp_depth=0"], ["--model.mtp_depth=1"]),
    ("train.routing_check.max_rank_imbalance",): (
        ["--train.routing_check.max_rank_imbalance=null"],
        ["--train.routing_check.max_rank_imbalance=1.5"],
    ),
    ("train.routing_check.max_rank_imbalance", "train.routing_check.max_expert_share"): (
        [
            "--train.routing_check.max_rank_imbalance=null",
            "--train.routing_check.max_expert_share=null",
        ],
        [
            "--train.routing_check.max_rank_imbalance=null",
            "--train.routing_check.max_expert_share=0.8",
        ],
    ),
    ("checkpoint.interval", "checkpoint.interval_minutes"): (
        ["--checkpoint.interval=0", "--checkpoint.interval_minutes=0"],
        ["--checkpoint.interval=0", "--checkpoint.interval_minutes=5"],
    ),
    ("checkpoint.resume", "checkpoint.init_from"): (
        ["--checkpoint.resume=never", "--checkpoint.init_from=null"],
        ["--checkpoint.resume=never", "--checkpoint.init_from=ckpt"],
    ),
    ("eval.paths",): (["--eval.paths=[]"], ["--eval.paths=[held_out.npy]"]),
}
"""For each entry's options of ALTERNATIVES: overrides under which its keys are unused, and
overrides under which they are used."""

UNUSED_VALUES = {
    "optim.muon_momentum": 0.9,
    "optim.muon_ns_dtype": "float32",
    "optim.adamw_lr_ratio": 0.5,
    "optim.min_lr_ratio": 0.05,
    "parallel.rowwise_transport": "symmetric_memory",
    "model.mtp_loss_weight": 0.5,
    "train.routing_check.balanced_lb_loss": 1.2,
    "train.routing_check.logged_steps": 3,
    "checkpoint.keep_last": 7,
    "checkpoint.async_save": True,
    "checkpoint.allow_config_change": True,
    "eval.batches": 4,
}
"""A value other than its default for every key of ALTERNATIVES."""


def _alternative_cases():
    from moe_plan.config.alternatives import ALTERNATIVES

    return [pytest.param(entry, key, id=key) for entry in ALTERNATIVES for key in entry.keys]


def test_the_alternatives_table_is_covered():
    """Every entry and key of the table has settings here, so the cases below test it."""
    from moe_plan.config.alternatives import ALTERNATIVES

    assert {entry.options for entry in ALTERNATIVES} == set(OPTION_SETTINGS)
    assert {key for entry in ALTERNATIVES for key in entry.keys} == set(UNUSED_VALUES)


def _write_overrides(path, overrides: list[str]):
    """A config file that sets what `overrides` set."""
    path.write_text(yaml.safe_dump(parse_overrides(overrides)))
    return path


@pytest.mark.parametrize(("entry", "key"), _alternative_cases())
def test_a_key_of_an_unchosen_alternative_is_refused(entry, key, tmp_path):
    """Set on the command line or in the file under the other choice: one error naming the
    key, where it was set, the options' values and the choice that would use it."""
    unchosen, _ = OPTION_SETTINGS[entry.options]
    flag = f"--{key}={str(UNUSED_VALUES[key]).lower()}"
    with pytest.raises(ConfigError) as info:
        load_config(None, [*unchosen, flag])
    message = str(info.value)
    assert message.startswith(f"{key} is set on the command line but {entry.options[0]}=")
    assert message.endswith(f"; it is used only with {entry.used_with}") and "\n" not in message
    path = _write_overrides(tmp_path / "unchosen.yaml", [*unchosen, flag])
    with pytest.raises(ConfigError, match="^" + re.escape(f"{key} is set in {path} but ")):
        load_config(path)
    # The file's choice left as it is, the key given on the command line: refused too.
    with pytest.raises(ConfigError, match="^" + re.escape(f"{key} is set on the command line")):
        load_config(_write_overrides(tmp_path / "option.yaml", unchosen), [flag])


@pytest.mark.parametrize(("entry", "key"), _alternative_cases())
def test_a_key_of_the_chosen_alternative_is_accepted(entry, key, tmp_path):
    """Under the choice that uses it, from either place; and a file's setting for a choice
    that the command line switches away from is unused, not wrong."""
    unchosen, chosen = OPTION_SETTINGS[entry.options]
    flag = f"--{key}={str(UNUSED_VALUES[key]).lower()}"
    expected = UNUSED_VALUES[key]
    assert _value(load_config(None, [*chosen, flag]), key) == expected
    path = _write_overrides(tmp_path / "chosen.yaml", [*chosen, flag])
    assert _value(load_config(path), key) == expected
    assert _value(load_config(path, unchosen), key) == expected


def _value(config, key: str):
    from moe_plan.config.alternatives import config_value

    return config_value(config, key)


def test_a_rowwise_key_in_a_file_under_another_dispatcher_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("parallel:\n  dispatcher: auto\n  rowwise_transport: nvshmem\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"parallel.rowwise_transport is set in {path} but parallel.dispatcher=auto, "
        "model.moe.capacity_factor=null; it is used only with parallel.dispatcher=rowwise, or "
        "auto with a model.moe.capacity_factor"
    )
    # At its default in the file: nothing to refuse (a hand-written file may list defaults).
    path.write_text("parallel:\n  dispatcher: auto\n  rowwise_transport: auto\n")
    assert load_config(path).parallel.rowwise_transport == "auto"
    # auto with a capacity runs rowwise, which reads the transport.
    path.write_text(
        "model:\n  moe:\n    capacity_factor: 1.25\n"
        "parallel:\n  dispatcher: auto\n  rowwise_transport: nvshmem\n"
    )
    assert load_config(path).parallel.rowwise_transport == "nvshmem"


def test_saved_configs_with_unused_values_still_load(tmp_path):
    """A run's resolved config.yaml (every key) and a checkpoint's config dictionary hold
    their values as the run had them: resume, verify and a relaunch from the file load them,
    unused keys and all."""
    data = parse_overrides(
        [f"--{key}={str(value).lower()}" for key, value in UNUSED_VALUES.items()]
    )
    data["eval"]["interval"] = 50  # with nothing to evaluate: off
    saved = config_from_dict(data)
    assert config_from_dict(saved.to_dict()) == saved
    dump_config(saved, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == saved
    resumed = load_config(tmp_path / "config.yaml", ["--checkpoint.resume=auto"])
    assert resumed.optim.muon_momentum == 0.9
    with pytest.raises(ConfigError, match=r"^optim\.muon_momentum is set on the command line"):
        load_config(tmp_path / "config.yaml", ["--optim.muon_momentum=0.8"])


def test_fp8_dispatch_over_deepep_is_refused_at_the_start_check():
    config = config_from_dict(
        {"model": {"moe": {"dispatch_dtype": "fp8"}}, "parallel": {"ep": 2, "dispatcher": "deepep"}}
    )
    with pytest.raises(ConfigError) as info:
        check_start(config, 2)
    assert str(info.value) == (
        "model.moe.dispatch_dtype=fp8 is not carried by parallel.dispatcher=deepep; use "
        "all_to_all, all_to_all_dedup or rowwise, or dispatch_dtype=compute"
    )
    config.parallel.dispatcher = "all_to_all"
    check_start(config, 2)
    config.parallel.dispatcher, config.parallel.ep = "deepep", 1  # no exchange: local rounds
    check_start(config, 2)


def test_ep_overlap_with_recompute_is_refused_at_the_start_check():
    config = config_from_dict({"parallel": {"ep": 2, "ep_overlap": True, "recompute": "full"}})
    with pytest.raises(ConfigError, match=r"^parallel\.ep_overlap=true does not work with "):
        check_start(config, 2)
    config.parallel.recompute = "none"
    check_start(config, 2)
    config.parallel.ep, config.parallel.recompute = 1, "full"  # nothing to overlap at ep 1
    check_start(config, 2)


def test_auto_dispatch_is_rowwise_with_a_capacity_and_all_to_all_without():
    assert choose_dispatcher("rowwise", 1, 1.0) == "local"
    assert choose_dispatcher("auto", 2, None) == "all_to_all"
    assert choose_dispatcher("auto", 2, 1.25) == "rowwise"
    assert choose_dispatcher("local", 4, 1.25) == "all_to_all"
    assert choose_dispatcher("all_to_all_dedup", 4, 1.25) == "all_to_all_dedup"
    # auto prefers nvshmem, then torch symmetric memory, of what the machine has.
    assert transport_candidates("auto", ("symmetric_memory", "nvshmem")) == (
        "nvshmem",
        "symmetric_memory",
    )
    assert transport_candidates("auto", ()) == ()
    assert transport_candidates("all_to_all", ("nvshmem",)) == ("all_to_all",)

    def reason(ep: int, capacity: float | None, **parallel) -> str:
        config = config_from_dict({"parallel": {"ep": ep, **parallel}})
        return dispatcher_reason(config.parallel, capacity, ep)

    assert reason(1, None).startswith("one rank holds every expert")
    assert "a model.moe.capacity_factor would make dispatch sync-free" in reason(2, None)
    assert "model.moe.capacity_factor=1.25: static per-expert buffers" in reason(2, 1.25)
    assert reason(2, 1.25, dispatcher="all_to_all") == "parallel.dispatcher=all_to_all"
    choice = DispatchChoice("rowwise", "symmetric_memory", "why")
    assert choice.describe() == "rowwise over symmetric_memory (why)"
