"""Pipeline parallelism reproduces the single-process losses; bad pipeline settings fail clearly."""

import re

import pytest

from harness.ranks import run_distributed
from moe_plan.config import config_from_dict
from moe_plan.config.stage_plan import plan_stages
from moe_plan.config.start_check import check_start
from moe_train.errors import ConfigError
from moe_train.train import train
from training import (
    FP8_LAYOUT_RTOL,
    FP8_PRECISION,
    assert_fp8_ran,
    assert_losses_match,
    small_config_data,
    train_cases_with_gemms,
    train_fp8_single,
)

STEPS = 10
FP8_STEPS = 6


def _config_data(token_file, run_dir, **parallel) -> dict:
    """Four layers (the first dense), so two pipeline stages of two layers each."""
    return small_config_data(
        run_dir,
        token_file,
        model={
            "n_layers": 4,
            "qk_norm": False,
            "dense_layers": 1,
            "dense_hidden": 64,
            "moe": {"bias_update_rate": 0.01},
        },
        data={"micro_batch_size": 2},
        optim={"grad_clip": 1.0},
        train={"max_steps": STEPS},
        parallel=parallel,
    )


def _fp8_config_data(token_file, run_dir, **parallel) -> dict:
    """`_config_data` with rowwise FP8 experts and linears, 6 steps."""
    data = _config_data(token_file, run_dir, **parallel)
    data["precision"] = dict(FP8_PRECISION)
    data["train"]["max_steps"] = FP8_STEPS
    return data


def test_stage_plan_places_stages_in_a_loop():
    plan = plan_stages(8, pp=2, pp_rank=1, virtual_stages=2)
    assert plan.stages == (1, 3)
    assert plan.layers == [2, 3, 6, 7]
    assert not plan.has_first and plan.has_last
    plan = plan_stages(4, pp=2, pp_rank=0)
    assert plan.layers == [0, 1] and plan.has_first and not plan.has_last


def test_pipeline_schedules_match_single_process(token_file, tmp_path):
    """Each schedule at pp2 against one process, in one spawn; each also with rowwise FP8
    (experts and linears: each rank converts its own layer chunks) against one process with
    FP8, within `FP8_LAYOUT_RTOL`, every rank running FP8."""
    single = train(config_from_dict(_config_data(token_file, tmp_path / "single"))).losses
    interleaved = {"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2}
    schedules = {
        "1f1b": {"pp": 2},
        "gpipe": {"pp": 2, "pp_schedule": "gpipe"},
        "interleaved": interleaved,
        "1f1b_recompute": {"pp": 2, "recompute": "selective"},
    }
    cases = {name: _config_data(token_file, tmp_path / name, **p) for name, p in schedules.items()}
    fp8_cases = {
        f"{name}_fp8": _fp8_config_data(token_file, tmp_path / f"{name}_fp8", **schedules[name])
        for name in ("gpipe", "interleaved", "1f1b_recompute")
    }
    per_rank, gemms_per_rank = zip(
        *run_distributed(train_cases_with_gemms, world_size=2, args=({**cases, **fp8_cases},)),
        strict=True,
    )
    single_fp8 = train_fp8_single(_fp8_config_data(token_file, tmp_path / "single_fp8"))
    assert_fp8_ran(gemms_per_rank, list(fp8_cases))
    for name in [*cases, *fp8_cases]:
        assert per_rank[0][name] == per_rank[1][name], f"{name}: ranks disagree: {per_rank}"
        if name in fp8_cases:
            assert_losses_match(name, per_rank[0][name], single_fp8, rtol=FP8_LAYOUT_RTOL)
        else:
            assert_losses_match(name, per_rank[0][name], single)


def test_pipeline_with_expert_and_data_parallel_matches_single_process(token_file, tmp_path):
    """pp2 x ep2 x dp2 in fp32 with each dispatcher and the distributed optimizer, and with
    rowwise FP8 (experts and linears) against the single process with FP8, every rank running
    FP8, in one spawn."""
    single = train(config_from_dict(_config_data(token_file, tmp_path / "single"))).losses
    single_fp8 = train_fp8_single(_fp8_config_data(token_file, tmp_path / "single_fp8"))
    ep2 = {"ep": 2, "dispatcher": "all_to_all"}
    cases = {
        "pp2_ep2_dp2": _config_data(token_file, tmp_path / "pp2ep2", pp=2, **ep2),
        "pp2_ep2_dp2_sharded_optimizer": _config_data(
            token_file, tmp_path / "pp2ep2do", pp=2, distributed_optimizer=True, **ep2
        ),
        "pp2_ep2_dp2_rowwise_shared_memory": _config_data(
            token_file,
            tmp_path / "pp2ep2shm",
            pp=2,
            ep=2,
            dispatcher="rowwise",
            rowwise_transport="symmetric_memory",
        ),
    }
    # Rowwise buffers: capacity 4 x the even share is more than any expert can receive.
    cases["pp2_ep2_dp2_rowwise_shared_memory"]["model"]["moe"]["capacity_factor"] = 4.0
    fp8_layout = {"pp": 2, "distributed_optimizer": True, **ep2}
    cases["fp8"] = _fp8_config_data(token_file, tmp_path / "pp2ep2fp8", **fp8_layout)
    per_rank, gemms_per_rank = zip(
        *run_distributed(train_cases_with_gemms, world_size=4, args=(cases,), timeout=600),
        strict=True,
    )
    assert_fp8_ran(gemms_per_rank, ["fp8"])
    for losses in per_rank:
        for name in cases:
            if name == "fp8":
                assert_losses_match(name, losses[name], single_fp8, rtol=FP8_LAYOUT_RTOL)
            else:
                assert_losses_match(name, losses[name], single)


@pytest.mark.parametrize(
    ("parallel", "data", "message"),
    [
        ({"pp": 3}, {}, "model.n_layers=4 must be a multiple of the number of pipeline stages"),
        (
            {"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 3},
            {},
            "model.n_layers=4 must be a multiple",
        ),
        ({"pp": 2, "pp_schedule": "interleaved_1f1b"}, {}, "needs parallel.virtual_stages >= 2"),
        ({"pp": 2, "virtual_stages": 2}, {}, "needs parallel.pp_schedule=interleaved_1f1b"),
        (
            {"pp": 4},
            {"global_batch_size": 6, "micro_batch_size": 2},
            "needs micro-batches per pipeline",
        ),
    ],
)
def test_bad_pipeline_settings_are_one_clear_error(token_file, tmp_path, parallel, data, message):
    config_data = _config_data(token_file, tmp_path, **parallel)
    config_data["data"].update(data)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_start(config_from_dict(config_data), parallel["pp"])  # one batch rank


def test_unknown_schedule_is_rejected_by_the_config(token_file, tmp_path):
    with pytest.raises(ConfigError, match=r"parallel\.pp_schedule"):
        config_from_dict(_config_data(token_file, tmp_path, pp=2, pp_schedule="zigzag"))
