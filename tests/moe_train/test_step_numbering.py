"""Step N is the state after N optimizer steps in every file and line that names a step: the
console, metrics.jsonl, expert_load.jsonl, TensorBoard, the checkpoints and their evaluation."""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moe_data import TokenDataset
from moe_train.generate import load_checkpoint_model
from moe_train.train import read_metrics, train
from moe_train.train.tracking import TENSORBOARD_DIR

STEPS = 7  # not a multiple of the intervals: the last step is logged and saved anyway


def _tensorboard_losses(log_dir) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {e.step: e.value for e in accumulator.Scalars("loss")}


def _eval_loss_of(checkpoint, eval_path, batch_size: int) -> float:
    """The mean token loss of the checkpoint's model over the first eval batch, computed here."""
    model, config, _ = load_checkpoint_model(checkpoint, "cpu")
    dataset = TokenDataset([str(eval_path)], config.data.seq_len)
    rows = [dataset.sequence(i % dataset.num_sequences) for i in range(batch_size)]
    tokens = torch.from_numpy(np.stack(rows)).long()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).double()
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()


@pytest.mark.parametrize("log_interval", [3, 1])
def test_console_metrics_trackers_and_checkpoints_count_steps_alike(
    tmp_path, make_config, token_file, capsys, log_interval
):
    pytest.importorskip("tensorboard")
    config = make_config(
        tmp_path,
        train={"max_steps": STEPS, "log_interval": log_interval, "progress": True,
               "tensorboard": True},
        checkpoint={"interval": 3, "interval_minutes": 0, "keep_last": 10},
        eval={"paths": [str(token_file)], "interval": 2, "batches": 1},
    )  # fmt: skip
    capsys.readouterr()
    result = train(config)
    err = capsys.readouterr().err

    logged = {s for s in range(1, STEPS + 1) if s % log_interval == 0 or s == STEPS}
    evaluated = {2, 4, 6, STEPS}
    metrics = {r["step"]: r for r in read_metrics(result.run_dir / "metrics.jsonl")}
    assert sorted(metrics) == sorted(logged | evaluated)
    assert {s for s, r in metrics.items() if "eval_loss" in r} == evaluated
    for step, row in metrics.items():  # the loss of step N is the N-th loss the run computed
        assert row["loss"] == result.losses[step - 1], step
        assert row["tokens_seen"] == step * config.data.global_batch_size * config.data.seq_len

    console = {
        int(m[1]): float(m[2])
        for m in re.finditer(rf"^step (\d+)/{STEPS} \| loss (\S+)", err, re.M)
    }
    assert sorted(console) == sorted(metrics), err
    for step, loss in console.items():
        assert loss == round(metrics[step]["loss"], 4), step

    routing = read_metrics(result.run_dir / "expert_load.jsonl")
    assert [r["step"] for r in routing] == sorted(logged)

    tracked = _tensorboard_losses(result.run_dir / TENSORBOARD_DIR)
    assert sorted(tracked) == sorted(metrics)
    for step, loss in tracked.items():
        assert loss == pytest.approx(metrics[step]["loss"], rel=1e-6), step

    checkpoints = result.run_dir / "checkpoints"
    saved = sorted(int(p.name.removeprefix("step_")) for p in checkpoints.glob("step_*"))
    assert saved == [3, 6, STEPS]
    for step in set(saved) & evaluated:  # the saved state is the one the row evaluated
        got = _eval_loss_of(checkpoints / f"step_{step:08d}", token_file, 8)
        assert got == pytest.approx(metrics[step]["eval_loss"], rel=1e-5), step
    assert f"summary: {STEPS} steps" in err and f"step_{STEPS:08d}" in err
