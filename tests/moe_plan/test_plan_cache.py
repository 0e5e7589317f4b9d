"""The planner's shortcuts give the answers of the plain computation: memory pieces cached by
what they read, pipeline ranks of one shape computed once, and the checks of the sections
that no layout sets run once per config."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from moe_plan import DEVICES, held_per_micro_batch, predict_memory, rank_params
from moe_plan.config import load_config
from moe_plan.config.stage_plan import plan_stages
from moe_plan.errors import ConfigError
from moe_plan.layouts import candidate_layouts, fixed_sections_valid, start_error
from moe_plan.memory import _rank_memory, clear_caches
from moe_plan.stages import rank_groups, rank_layers

ROOT = Path(__file__).resolve().parents[2]
B200 = DEVICES["b200"]


def _tiny():
    return load_config(ROOT / "configs/tiny.yaml")


def _set(config, key: str, value):
    """`config` with the dotted `key` set to `value` (sections copied, never changed)."""
    head, _, rest = key.partition(".")
    if not rest:
        return replace(config, **{head: value})
    return replace(config, **{head: _set(getattr(config, head), rest, value)})


VARIED = [
    ("model.d_model", 256),
    ("model.n_heads", 8),
    ("model.n_kv_heads", 4),
    ("model.n_layers", 8),
    ("model.dense_layers", 3),
    ("model.dense_hidden", 512),
    ("model.vocab_size", 640),
    ("model.qk_norm", False),
    ("model.qkv_bias", True),
    ("model.mtp_depth", 1),
    ("model.moe.num_experts", 16),
    ("model.moe.top_k", 1),
    ("model.moe.expert_hidden", 128),
    ("model.moe.shared_experts", 1),
    ("model.moe.shared_expert_gate", True),
    ("model.moe.router", "sigmoid"),
    ("model.moe.capacity_factor", 1.5),
    ("model.moe.group_alignment", 16),
    ("data.seq_len", 256),
    ("data.micro_batch_size", 2),
    ("data.global_batch_size", 4),
    ("parallel.pp", 1),
    ("parallel.pp", 4),
    ("parallel.ep", 1),
    ("parallel.cp", 2),
    ("parallel.pp_schedule", "gpipe"),
    ("parallel.recompute", "selective"),
    ("parallel.recompute", "full"),
    ("parallel.distributed_optimizer", True),
    ("parallel.dispatcher", "all_to_all_dedup"),
    ("precision.param_dtype", "bfloat16"),
    ("precision.compute_dtype", "float32"),
    ("precision.expert_gemm", "mxfp8"),
    ("optim.name", "muon"),
]
"""Fields the memory reads, each changed alone from the base layout."""


def _base():
    config = _tiny()
    config = _set(config, "parallel", replace(config.parallel, pp=2, ep=2))
    return _set(config, "data.micro_batch_size", 1)


def test_cached_pieces_are_keyed_by_all_they_read():
    """With the caches filled by one layout, every other layout gets what it gets cold."""
    base = _base()
    same = []
    for key, value in VARIED:
        config = _set(base, key, value)
        if key == "model.moe.capacity_factor":
            config = _set(config, "parallel.dispatcher", "rowwise")
            config = _set(config, "parallel.rowwise_transport", "symmetric_memory")
        clear_caches()
        cold = predict_memory(config, 8)
        clear_caches()
        base_memory = predict_memory(base, 8)
        warm = predict_memory(config, 8)
        assert warm == cold, key
        if cold == base_memory:
            same.append(key)
    # The changes are seen (this is no test of equal answers), but three: a dense width
    # without dense layers, a dispatcher whose tensors kept are all_to_all's, and MXFP8
    # experts, which keep what bf16 keeps (test_plan: test_mxfp8_on_torchao_kernels_...).
    assert same == ["model.dense_hidden", "parallel.dispatcher", "precision.expert_gemm"]


@pytest.mark.parametrize(
    "changes",
    [
        {"model.n_layers": 7, "parallel.pp": 3},
        {"model.n_layers": 8, "model.dense_layers": 3, "parallel.pp": 4},
        {
            "model.n_layers": 8,
            "model.dense_layers": 1,
            "parallel.pp_schedule": "interleaved_1f1b",
            "parallel.virtual_stages": 2,
        },
        {"model.n_layers": 6, "parallel.pp": 3, "parallel.pp_schedule": "gpipe"},
        {"model.n_layers": 6, "model.mtp_depth": 1, "parallel.pp": 3},
        # Ranks 1 and 2 hold MoE layers alike, rank 1 more micro-batches: the busiest (rank
        # 0's narrow dense layers hold less).
        {
            "model.n_layers": 8,
            "model.dense_layers": 2,
            "model.dense_hidden": 16,
            "parallel.pp": 4,
            "data.global_batch_size": 32,
        },
        {"model.n_layers": 6, "optim.name": "muon", "parallel.distributed_optimizer": True},
    ],
)
def test_busiest_rank_is_the_plain_maximum(changes):
    """Ranks of one shape computed once give the first rank of the largest total, as the
    maximum over every rank's own prediction does."""
    config = _base()
    for key, value in changes.items():
        config = _set(config, key, value)
    world = 4 * config.parallel.pp
    ranks = [_rank_memory(config, world, r) for r in range(config.parallel.pp)]
    busiest = max(ranks, key=lambda m: m.total)
    assert predict_memory(config, world) == busiest
    if "data.global_batch_size" in changes:
        assert busiest.pp_rank == 1 and ranks[1].in_flight > ranks[2].in_flight


def test_validate_keeps_its_order():
    """An error in a layout section before one in a fixed section is still the one named."""
    config = _set(_tiny(), "data.micro_batch_size", 3)
    config = _set(config, "optim.lr", -1.0)
    with pytest.raises(ConfigError, match=r"data\.global_batch_size"):
        config.validate()
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        config.validate_fixed()


def test_layout_checks_are_kept_per_section_object():
    """Configs sharing a memo of their layout sections' checks each get their own answer."""
    good = _tiny()
    bad = _set(good, "data.micro_batch_size", 3)
    checked: dict = {}
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"data\.micro_batch_size=3 must divide"):
            bad.validate_layout(checked)
        good.validate_layout(checked)
    # Two data sections; the parallel and precision sections they share, checked once.
    assert len(checked) == 4


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"model.tie_embeddings": True},
        {"model.mtp_depth": 1, "data.seq_len": 4096},
        {"optim.lr": -1.0},
        {"data.micro_batch_size": 3},
    ],
)
def test_candidates_checked_once_for_fixed_sections(changes):
    """Each candidate layout's start error is the same with the fixed sections checked once
    (when they pass) as with every check run on it."""
    config = _tiny()
    for key, value in changes.items():
        config = _set(config, key, value)
    fixed_valid = fixed_sections_valid(config)
    assert fixed_valid == ("optim.lr" not in changes)
    errors, checked = set(), {}
    for candidate in candidate_layouts(config, 8, B200):
        error = start_error(candidate, 8)
        assert start_error(candidate, 8, fixed_valid=fixed_valid) == error
        # Each layout section object's own checks run once for the layouts sharing it.
        assert start_error(candidate, 8, fixed_valid=fixed_valid, checked=checked) == error
        errors.add(error)
    assert len(errors) > 1 or "optim.lr" in changes  # some start, some do not


@pytest.mark.parametrize("schedule", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_ranks_of_one_shape_hold_the_same(schedule):
    """The ranks `rank_groups` puts together hold the same parameters and activations."""
    config = _set(_base(), "model.n_layers", 16)
    config = _set(config, "model.dense_layers", 3)
    config = _set(config, "parallel.pp", 4)
    config = _set(config, "parallel.pp_schedule", schedule[0])
    config = _set(config, "parallel.virtual_stages", schedule[1])
    groups = rank_groups(16, 4, schedule[1], 3)
    assert sorted(r for _, ranks in groups for r in ranks) == [0, 1, 2, 3]
    assert len(groups) < 4 if schedule[1] == 1 else len(groups) == 4
    for _, ranks in groups:
        held = {
            held_per_micro_batch(config, rank_layers(16, 4, r, schedule[1]), *_ends(r, schedule))
            for r in ranks
        }
        assert len(held) == 1
        assert len({rank_params(config, r) for r in ranks}) == 1


def _ends(pp_rank: int, schedule) -> tuple[bool, bool]:
    stages = plan_stages(16, 4, pp_rank, schedule[1])
    return stages.has_first, stages.has_last
