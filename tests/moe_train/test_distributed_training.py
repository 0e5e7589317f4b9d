"""Data-parallel and expert-parallel training reproduce the single-process losses."""

import pytest

from distributed import run_distributed
from moe_train.config import config_from_dict
from moe_train.train import train

STEPS = 4


def _config_data(token_file, run_dir, **parallel) -> dict:
    return {
        "model": {
            "vocab_size": 256,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "bias_update_rate": 0.01},
        },
        "data": {
            "paths": [str(token_file)],
            "seq_len": 32,
            "global_batch_size": 8,
            "micro_batch_size": 2,
        },
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {
            "max_steps": STEPS,
            "run_dir": str(run_dir),
            "progress": False,
            "peak_flops": 1e11,
        },
        "precision": {"compute_dtype": "float32"},
        "parallel": parallel,
    }


def _train_rank(rank: int, world_size: int, data: dict) -> list[float]:
    return train(config_from_dict(data)).losses


@pytest.fixture
def reference_losses(token_file, tmp_path):
    return train(config_from_dict(_config_data(token_file, tmp_path / "single"))).losses


def _assert_losses_match(losses, reference):
    for step, (a, b) in enumerate(zip(losses, reference, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs single-process {b}"


def test_data_parallel_matches_single_process(token_file, tmp_path, reference_losses):
    data = _config_data(token_file, tmp_path / "dp2")
    per_rank = run_distributed(_train_rank, world_size=2, args=(data,))
    assert per_rank[0] == per_rank[1]
    _assert_losses_match(per_rank[0], reference_losses)
    assert (tmp_path / "dp2" / "metrics.jsonl").is_file()
