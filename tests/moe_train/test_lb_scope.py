"""model.moe.lb_scope in training: the global-batch balancing loss is the same in every layout
and micro-batch size; the micro-batch one is not; the scope is reported."""

import json

import pytest

from harness.ranks import run_distributed
from moe_plan.config import config_from_dict
from moe_train.train import read_metrics, train
from training import small_config_data, train_cases

STEPS = 4

# name: (lb_scope, micro_batch_size, parallel)
SINGLE_PROCESS_RUNS = {
    "global_mbs2": ("global_batch", 2, {}),
    "global_mbs4": ("global_batch", 4, {}),
    "micro_mbs2": ("micro_batch", 2, {}),
    "micro_mbs4": ("micro_batch", 4, {}),
    "sequence_mbs2": ("sequence", 2, {}),
}
TWO_RANK_RUNS = {
    "global_dp2": ("global_batch", 2, {}),
    "global_ep2": ("global_batch", 4, {"ep": 2}),
    "global_pp2": ("global_batch", 2, {"pp": 2}),
}


def _config_data(token_file, run_dir, lb_scope: str, micro_batch_size: int, parallel) -> dict:
    return small_config_data(
        run_dir,
        token_file,
        model={"moe": {"lb_scope": lb_scope, "lb_loss_weight": 0.1}},
        data={"micro_batch_size": micro_batch_size},
        train={"max_steps": STEPS},
        parallel=parallel,
    )


def _lb_losses(run_dir) -> list[float]:
    return [row["lb_loss"] for row in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_global_batch_lb_loss_is_the_same_in_every_layout_and_micro_batch_size(
    shared_token_file, tmp_path
):
    """1 process at micro-batch sizes 2 and 4, dp2, ep2 and pp2 (one 2-rank spawn): the
    logged global-batch lb_loss agrees within 1e-6 at every step; the micro-batch scope's
    differs between micro-batch sizes."""
    for name, (scope, mbs, parallel) in SINGLE_PROCESS_RUNS.items():
        train(
            config_from_dict(_config_data(shared_token_file, tmp_path / name, scope, mbs, parallel))
        )
    cases = {
        name: _config_data(shared_token_file, tmp_path / name, scope, mbs, parallel)
        for name, (scope, mbs, parallel) in TWO_RANK_RUNS.items()
    }
    run_distributed(train_cases, world_size=2, args=(cases,), timeout=600)

    reference = _lb_losses(tmp_path / "global_mbs2")
    assert len(reference) == STEPS and reference[0] == pytest.approx(1.0, abs=1e-6)
    assert max(abs(v - 1.0) for v in reference[1:]) > 1e-3, "later steps see real fractions"
    for name in ["global_mbs4", *TWO_RANK_RUNS]:
        losses = _lb_losses(tmp_path / name)
        worst = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        assert worst <= 1e-6, f"{name}: lb_loss {losses} vs single process {reference}"
    micro2, micro4 = _lb_losses(tmp_path / "micro_mbs2"), _lb_losses(tmp_path / "micro_mbs4")
    assert max(abs(a - b) for a, b in zip(micro2, micro4, strict=True)) > 1e-4

    for name, (scope, _, _) in {**SINGLE_PROCESS_RUNS, **TWO_RANK_RUNS}.items():
        rows = [json.loads(line) for line in (tmp_path / name / "expert_load.jsonl").open()]
        assert [row["lb_scope"] for row in rows] == [scope] * STEPS, name
