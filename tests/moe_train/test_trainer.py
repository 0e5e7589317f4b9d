"""The single-process training loop: metrics contract, determinism, learning, run dirs."""

import math
import re
import time

import pytest

from moe_train.errors import ConfigError
from moe_train.train import read_metrics, train

REQUIRED_METRICS = {
    "step",
    "loss",
    "lb_loss",
    "z_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "expert_load_max_over_mean",
    "hidden_imbalance_layers",
    "dropped_token_frac",
    "peak_mem_bytes",
    "skipped_steps",
    "tokens_seen",
    "time",
}


def test_metrics_file_and_resolved_config(tmp_path, make_config):
    config = make_config(tmp_path)
    result = train(config)
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))  # step N: after N updates
    for record in records:
        assert record.keys() >= REQUIRED_METRICS
        assert all(math.isfinite(record[k]) for k in REQUIRED_METRICS)
        # Copies at the busiest expert over the mean copies per expert, in the busiest layer.
        # The busiest expert holds a whole number of copies, at least the mean and at most
        # one per token of the step (a token's top-k experts are distinct): 8 x 32 tokens,
        # top 2 of 4 experts give a mean of 128, so the ratio is some k / 128, 128 <= k <= 256.
        moe = config.model.moe
        step_tokens = config.data.global_batch_size * config.data.seq_len
        mean_copies = step_tokens * moe.top_k / moe.num_experts
        busiest = record["expert_load_max_over_mean"] * mean_copies
        assert abs(busiest - round(busiest)) < 1e-6 and mean_copies <= busiest <= step_tokens, (
            f"step {record['step']}: expert_load_max_over_mean="
            f"{record['expert_load_max_over_mean']} means {busiest} copies at the busiest expert; "
            f"expected a whole number from {mean_copies} to {step_tokens}"
        )
        assert record["dropped_token_frac"] == 0.0
        assert record["mfu"] > 0
        assert record["dispatch_bytes"] == record["exchange_bytes"] == 0  # nothing to send
    # The same figure from the per-expert counts of expert_load.jsonl, computed here.
    routing = read_metrics(result.run_dir / "expert_load.jsonl")
    assert [r["step"] for r in routing] == list(range(1, 7))
    for record, row in zip(records, routing, strict=True):
        worst = max(max(load) * len(load) / sum(load) for load in row["load"])
        assert record["expert_load_max_over_mean"] == pytest.approx(worst, rel=1e-12)
        assert record["hidden_imbalance_layers"] == 0  # one process: one EP rank
    assert [r["loss"] for r in records] == result.losses
    tokens_per_step = config.data.global_batch_size * config.data.seq_len
    assert [r["tokens_seen"] for r in records] == [s * tokens_per_step for s in range(1, 7)]
    times = [r["time"] for r in records]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 600
    assert (result.run_dir / "config.yaml").is_file()


def test_same_seed_gives_bitwise_identical_losses(tmp_path, make_config):
    """Three bf16 runs that differ in train.seed alone: the same seed repeats every loss
    bit for bit; another seed draws other weights, so even the first loss differs."""
    bf16 = {"compute_dtype": "bfloat16"}
    first, second, other = (
        train(make_config(tmp_path / name, precision=bf16, train={"seed": seed}))
        for name, seed in (("a", 0), ("b", 0), ("c", 1))
    )
    assert first.losses == second.losses
    assert all(a != b for a, b in zip(first.losses, other.losses, strict=True)), (
        f"seed 0: {first.losses}\nseed 1: {other.losses}"
    )


def test_taken_run_dir_gets_a_suffix_and_is_not_touched(tmp_path, make_config):
    first = train(make_config(tmp_path, train={"max_steps": 1}))
    before = (first.run_dir / "metrics.jsonl").read_bytes()
    second = train(make_config(tmp_path, train={"max_steps": 1}))
    assert second.run_dir == first.run_dir.with_name("run.1")
    assert (first.run_dir / "metrics.jsonl").read_bytes() == before


def test_capacity_drops_are_reported(tmp_path, make_config):
    config = make_config(tmp_path, model={"moe": {"capacity_factor": 0.5}}, train={"max_steps": 2})
    records = read_metrics(train(config).run_dir / "metrics.jsonl")
    assert all(r["dropped_token_frac"] > 0.2 for r in records)


def _imbalance(run_dir) -> list[float]:
    """Per logged step, the busiest expert's routed copies over the mean, worst MoE layer,
    from the counts in expert_load.jsonl."""
    rows = read_metrics(run_dir / "expert_load.jsonl")
    return [max(max(load) * len(load) / sum(load) for load in row["load"]) for row in rows]


@pytest.mark.slow
def test_balancing_bias_evens_the_real_load(tmp_path, make_config):
    """Auxiliary-loss-free balancing (sigmoid scores, no balancing loss) on data whose routing
    drifts towards a few experts: without the bias the busiest expert's share grows, with
    model.moe.bias_update_rate > 0 it falls, and the model still learns."""
    moe = {"router": "sigmoid", "lb_loss_weight": 0.0, "shared_experts": 1}
    runs = {}
    for rate in (0.0, 0.003):
        config = make_config(
            tmp_path / str(rate),
            model={"moe": {**moe, "bias_update_rate": rate}},
            train={"max_steps": 30},
        )
        runs[rate] = train(config)
    early = {rate: sum(_imbalance(r.run_dir)[:5]) / 5 for rate, r in runs.items()}
    late = {rate: sum(_imbalance(r.run_dir)[-10:]) / 10 for rate, r in runs.items()}
    assert late[0.0] >= early[0.0], f"without the bias: {early[0.0]:.2f} -> {late[0.0]:.2f}"
    assert late[0.003] <= 0.8 * early[0.003], f"with it: {early[0.003]:.2f} -> {late[0.003]:.2f}"
    assert late[0.003] <= 0.8 * late[0.0], f"with {late[0.003]:.2f}, without {late[0.0]:.2f}"
    biased = runs[0.003]
    assert sum(biased.losses[-5:]) / 5 < 0.8 * sum(biased.losses[:5]) / 5
    assert all(router.expert_bias.abs().sum() == 0 for router in _routers(runs[0.0]))


def _routers(result):
    return [layer.router for layer in result.model.moe_layers().values()]


def test_vocab_smaller_than_data_is_refused(tmp_path, make_config):
    from moe_train.errors import DataError

    config = make_config(tmp_path, model={"vocab_size": 64})
    with pytest.raises(DataError, match=r"set model.vocab_size >= \d+"):
        train(config)
    assert not (tmp_path / "run").exists()


def test_pipeline_stages_need_processes(tmp_path, make_config):
    config = make_config(tmp_path, parallel={"pp": 2})
    with pytest.raises(ConfigError, match=r"parallel\.pp=2 must divide the world size 1"):
        train(config)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("parallel", "moe", "message"),
    [
        (
            {"ep": 2, "dispatcher": "all_to_all"},
            {},
            "parallel.ep=2 must divide the data-parallel size 1",
        ),
        (
            {"ep": 3, "dispatcher": "all_to_all"},
            {},
            "parallel.ep=3 must divide the data-parallel size 1",
        ),
        (
            {"dispatcher": "rowwise"},
            {},
            "parallel.dispatcher=rowwise needs model.moe.capacity_factor",
        ),
    ],
)
def test_layouts_the_world_cannot_use_are_refused(tmp_path, make_config, parallel, moe, message):
    config = make_config(tmp_path, parallel=parallel, model={"moe": moe})
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(config)
    assert not (tmp_path / "run").exists()
