"""Held-out evaluation: the right number, on every layout, without touching training."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from harness.ranks import run_distributed
from moe_data import TokenDataset
from moe_plan.config import config_from_dict, load_config
from moe_train.errors import ConfigError
from moe_train.train import read_metrics, train
from training import small_config_data

STEPS = 4


@pytest.fixture
def eval_file(tmp_path):
    """Held-out tokens: other text than the training file."""
    text = ("for i in range(10):\n    print(i * i)\n" * 400).encode()
    path = tmp_path / "heldout.npy"
    np.save(path, np.frombuffer(text, dtype=np.uint8).astype(np.uint16)[:6000])
    return path


def _data(token_file, eval_file, run_dir, *, batches=2, interval=2, moe=None, **sections) -> dict:
    return small_config_data(
        run_dir,
        token_file,
        model={"moe": {"bias_update_rate": 0.01, **(moe or {})}},
        data={"micro_batch_size": 2},
        train={"max_steps": STEPS},
        eval={"paths": [str(eval_file)], "interval": interval, "batches": batches},
        checkpoint={"interval": 0, "interval_minutes": 0},
        **sections,
    )


def _eval_losses(run_dir) -> dict[int, float]:
    return {
        r["step"]: r["eval_loss"]
        for r in read_metrics(run_dir / "metrics.jsonl")
        if "eval_loss" in r
    }


def test_eval_loss_is_the_mean_token_loss_of_the_eval_batches(tmp_path, token_file, eval_file):
    config = config_from_dict(_data(token_file, eval_file, tmp_path / "run", batches=3))
    result = train(config)
    evaluated = _eval_losses(result.run_dir)
    assert sorted(evaluated) == [2, 4]  # every 2 steps, and the last
    # Independently: every eval sequence of the 3 batches at once, one cross-entropy.
    dataset = TokenDataset([str(eval_file)], config.data.seq_len)
    size = config.data.global_batch_size
    rows = [dataset.sequence(i % dataset.num_sequences) for i in range(3 * size)]
    tokens = torch.from_numpy(np.stack(rows))
    model = result.model.eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).double()
    expected = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert abs(evaluated[4] - expected) <= 1e-6 * expected, (evaluated[4], expected)
    assert evaluated[2] != evaluated[4]


@pytest.mark.parametrize("moe", [{}, {"random_routing": True}], ids=["learned", "random_routing"])
def test_evaluation_never_changes_training(tmp_path, token_file, eval_file, moe):
    with_eval = train(config_from_dict(_data(token_file, eval_file, tmp_path / "a", moe=moe)))
    without = train(
        config_from_dict(_data(token_file, eval_file, tmp_path / "b", interval=0, moe=moe))
    )
    assert with_eval.losses == without.losses
    biases = [
        torch.equal(a.router.expert_bias, b.router.expert_bias)
        for a, b in zip(
            with_eval.model.moe_layers().values(), without.model.moe_layers().values(), strict=True
        )
    ]
    assert all(biases)
    assert _eval_losses(with_eval.run_dir) and not _eval_losses(without.run_dir)


def _eval_cases(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, dict[int, float]]:
    results = {}
    for name, data in cases.items():
        result = train(config_from_dict(data))
        results[name] = _eval_losses(result.run_dir) if result.is_main else {}
    return results


LAYOUTS = {
    "dp2": {},
    "ep2 all_to_all": {"ep": 2, "dispatcher": "all_to_all"},
    "ep2 rowwise": {"ep": 2, "dispatcher": "rowwise"},
    "pp2": {"pp": 2},
}


def test_eval_loss_is_the_same_on_every_layout(tmp_path, token_file, eval_file):
    # A capacity factor for the rowwise dispatcher, everywhere: the same drops on every layout.
    moe = {"capacity_factor": 2.0}
    reference = train(config_from_dict(_data(token_file, eval_file, tmp_path / "one", moe=moe)))
    expected = _eval_losses(reference.run_dir)
    cases = {
        name: _data(token_file, eval_file, tmp_path / name.replace(" ", "_"), moe=moe, parallel=p)
        for name, p in LAYOUTS.items()
    }
    per_rank = run_distributed(_eval_cases, world_size=2, args=(cases,), timeout=300)
    for name in LAYOUTS:
        got = per_rank[0][name]
        assert sorted(got) == sorted(expected), name
        for step, value in expected.items():
            assert abs(got[step] - value) <= 1e-5 * value, (
                f"{name} step {step}: {got[step]} vs {value}"
            )


def test_eval_interval_needs_paths(tmp_path, token_file):
    """An interval given with neither eval.paths nor eval.tasks (a saved config with nothing
    to evaluate loads: its evaluation is off)."""
    data = small_config_data(tmp_path / "run", token_file, eval={"interval": 10})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"eval\.interval=10 needs eval\.paths"):
        load_config(path)
    assert not config_from_dict(data).eval.enabled
