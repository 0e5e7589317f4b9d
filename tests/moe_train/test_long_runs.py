"""Long runs in one process: safe checkpoint defaults, resume that means it, bad steps."""

import math
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from harness.ranks import run_distributed
from moe_plan.config import Config, config_from_dict
from moe_train.cli import main
from moe_train.errors import ConfigError, MoeTrainError, TrainingDiverged
from moe_train.train import read_metrics, train
from moe_train.train.step import StepRunner
from training import save_config

NO_SAVES = {"interval": 0, "interval_minutes": 0}


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read with plain safetensors."""
    tensors = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name).clone()
    return tensors


def committed_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        int(p.name.removeprefix("step_")) for p in root.iterdir() if (p / "COMMITTED").is_file()
    )


def test_checkpoints_are_on_by_default_and_also_by_time(tmp_path, make_config):
    assert Config().checkpoint.interval > 0 and Config().checkpoint.interval_minutes > 0
    default = train(make_config(tmp_path / "default", train={"max_steps": 3}))
    assert committed_steps(default.run_dir) == [3]  # the save after the last step
    assert default.checkpoint == default.run_dir / "checkpoints" / "step_00000003"

    # Time-based only: a tiny interval saves after every step.
    timed = train(
        make_config(
            tmp_path / "timed",
            train={"max_steps": 3},
            checkpoint={"interval": 0, "interval_minutes": 1e-6, "keep_last": 10},
        )
    )
    assert committed_steps(timed.run_dir) == [1, 2, 3]
    off = train(make_config(tmp_path / "off", train={"max_steps": 3}, checkpoint=NO_SAVES))
    assert committed_steps(off.run_dir) == [] and off.checkpoint is None


def _signal_self_in_step(monkeypatch, step: int, signum: int) -> None:
    """Send this process `signum` during step `step` (0-based), as a cluster would."""
    original = StepRunner.train_on
    calls = {"n": 0}

    def signalled(self: StepRunner, micro_batches: torch.Tensor, lr: float):
        if calls["n"] == step:
            os.kill(os.getpid(), signum)
        calls["n"] += 1
        return original(self, micro_batches, lr)

    monkeypatch.setattr(StepRunner, "train_on", signalled)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_a_signal_saves_and_stops_and_auto_resume_continues_in_the_same_run_dir(
    tmp_path, make_config, capsys, monkeypatch, signum
):
    uninterrupted = train(make_config(tmp_path / "ref", train={"max_steps": 6})).losses
    auto = {"resume": "auto", "interval": 100}
    handler_before = signal.getsignal(signum)
    with monkeypatch.context() as patch:
        _signal_self_in_step(patch, 2, signum)
        first = train(make_config(tmp_path, train={"max_steps": 6}, checkpoint=auto))
    assert first.stopped_by == signal.Signals(signum).name and first.end_step == 3
    assert first.checkpoint == first.run_dir / "checkpoints" / "step_00000003"
    assert committed_steps(first.run_dir) == [3]
    assert signal.getsignal(signum) == handler_before
    # Relaunched with another micro-batch size: allowed, reported, same samples.
    second = train(
        make_config(
            tmp_path,
            train={"max_steps": 6},
            checkpoint=auto,
            data={"micro_batch_size": 2},
        )
    )
    assert second.run_dir == first.run_dir and second.start_step == 3
    assert second.stopped_by is None and second.end_step == 6
    err = capsys.readouterr().err
    assert "resumed from" in err and "data.micro_batch_size 4 -> 2" in err, err
    assert first.losses == uninterrupted[:3]
    for a, b in zip(second.losses, uninterrupted[3:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    logged = [r["step"] for r in read_metrics(first.run_dir / "metrics.jsonl")]
    assert logged == list(range(1, 7))
    assert not first.run_dir.with_name("run.1").exists()
    # More steps later: allowed and reported.
    third = train(make_config(tmp_path, train={"max_steps": 7}, checkpoint=auto))
    assert third.start_step == 6 and len(third.losses) == 1
    assert "train.max_steps 6 -> 7" in capsys.readouterr().err


def test_a_run_dir_that_cannot_be_made_is_refused_before_anything_is_written(tmp_path, make_config):
    (tmp_path / "taken").write_text("a file, not a directory")
    for run_dir, problem in [
        (tmp_path / "taken", f"{tmp_path / 'taken'} is not a directory"),
        (tmp_path / "taken" / "run", f"{tmp_path / 'taken'} is not a directory"),
    ]:
        config = make_config(tmp_path, train={"max_steps": 2, "run_dir": str(run_dir)})
        with pytest.raises(ConfigError) as refused:
            train(config)
        assert str(refused.value) == f"train.run_dir={run_dir} cannot be created: {problem}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken", "tokens.npy"]


def test_relaunch_of_a_finished_run_says_so_and_exits_0(tmp_path, make_config, capsys):
    config = make_config(tmp_path, train={"max_steps": 2}, checkpoint={"resume": "auto"})
    config_path = tmp_path / "config.yaml"
    save_config(config_path, config)
    assert main(["train", str(config_path)]) == 0
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["train", str(config_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "already finished" in out[0] and "step_00000002" in out[0], out
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics
    assert not (tmp_path / "run.1").exists()


def test_job_stopped_before_its_first_save_continues_in_its_run_dir(tmp_path, make_config):
    # The first attempt saved nothing (it was stopped before its first checkpoint).
    first = train(make_config(tmp_path, train={"max_steps": 2}, checkpoint=NO_SAVES))
    auto_no_saves = {"resume": "auto", **NO_SAVES}
    again = train(make_config(tmp_path, train={"max_steps": 2}, checkpoint=auto_no_saves))
    assert again.run_dir == first.run_dir and again.start_step == 0
    assert again.losses == first.losses
    assert [r["step"] for r in read_metrics(again.run_dir / "metrics.jsonl")] == [1, 2]
    # Another model in that directory is not this job's: refused, nothing touched.
    before = (first.run_dir / "metrics.jsonl").read_bytes()
    other = make_config(tmp_path, model={"d_model": 64}, checkpoint={"resume": "auto"})
    with pytest.raises(ConfigError, match=r"model\.d_model=64 differs from 32 in .*config\.yaml"):
        train(other)
    assert (first.run_dir / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize(
    ("section", "change", "key", "saved", "now"),
    [
        ("data", {"global_batch_size": 16}, "data.global_batch_size", "8", "16"),
        ("data", {"seq_len": 16}, "data.seq_len", "32", "16"),
        ("train", {"seed": 3}, "train.seed", "0", "3"),
        ("model", {"moe": {"top_k": 1}}, "model.moe.top_k", "2", "1"),
    ],
)
def test_resume_refuses_changes_to_the_model_or_the_samples(
    tmp_path, make_config, section, change, key, saved, now
):
    auto = {"resume": "auto"}
    train(make_config(tmp_path, train={"max_steps": 2}, checkpoint=auto))
    sections = {"train": {"max_steps": 4}, "checkpoint": auto}
    sections[section] = {**sections.get(section, {}), **change}
    with pytest.raises(ConfigError) as refused:
        train(make_config(tmp_path, **sections))
    message = str(refused.value)
    assert f"{key}={now} differs from {saved} in " in message, message
    assert "checkpoint.allow_config_change=true" in message and "\n" not in message
    sections["checkpoint"] = {**auto, "allow_config_change": True}
    assert train(make_config(tmp_path, **sections)).start_step == 2


def test_data_paths_change_is_refused(tmp_path, make_config, token_file):
    auto = {"resume": "auto"}
    train(make_config(tmp_path, train={"max_steps": 2}, checkpoint=auto))
    copy = tmp_path / "copy.npy"
    copy.write_bytes(token_file.read_bytes())
    with pytest.raises(ConfigError, match=r"data\.paths=.*copy\.npy.* differs from"):
        train(
            make_config(
                tmp_path, train={"max_steps": 4}, checkpoint=auto, data={"paths": [str(copy)]}
            )
        )


def _poison_gradients_at(monkeypatch, steps: set[int], rank: int | None = None) -> None:
    """Make the gradient of the first parameter NaN in the given steps (0-based; only on
    `rank` if given) while the loss stays finite: a hook on the gradient in backward."""
    original = StepRunner.forward_backward
    calls = {"n": 0}

    def poisoned(self: StepRunner, micro_batches: torch.Tensor, *args) -> torch.Tensor:
        step, calls["n"] = calls["n"], calls["n"] + 1
        if step not in steps or (rank is not None and self.runtime.layout.rank != rank):
            return original(self, micro_batches, *args)
        param = next(self.model.parameters())
        hook = param.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        try:
            return original(self, micro_batches, *args)
        finally:
            hook.remove()

    monkeypatch.setattr(StepRunner, "forward_backward", poisoned)


def test_a_bad_step_is_skipped_without_changing_any_state(tmp_path, make_config, monkeypatch):
    _poison_gradients_at(monkeypatch, {3})
    config = make_config(
        tmp_path, train={"max_steps": 6}, checkpoint={"interval": 1, "keep_last": 9}
    )
    result = train(config)
    ckpts = result.run_dir / "checkpoints"
    before, after = (checkpoint_tensors(ckpts / f"step_{s:08d}") for s in (3, 4))
    assert before.keys() == after.keys()
    for name in before:  # weights, moments, step counts and balancing biases
        assert torch.equal(before[name], after[name]), name
    changed = checkpoint_tensors(ckpts / "step_00000005")
    assert not torch.equal(changed["embed.weight"], after["embed.weight"])
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["skipped_steps"] for r in records] == [0, 0, 0, 1, 1, 1]
    assert records[3]["grad_norm"] is None and math.isfinite(records[3]["loss"])
    state = yaml.safe_load((ckpts / "step_00000004" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["data"]["samples_consumed"] == 4 * 8
    assert state["skipped_steps"] == 1


def test_too_many_bad_steps_stop_with_the_last_good_checkpoint_intact(
    tmp_path, make_config, monkeypatch, capsys
):
    _poison_gradients_at(monkeypatch, set(range(2, 100)))
    config = make_config(
        tmp_path,
        train={"max_steps": 10, "max_skipped_steps": 2},
        checkpoint={"interval": 2, "keep_last": 9},
    )
    config_path = tmp_path / "config.yaml"
    save_config(config_path, config)
    assert main(["train", str(config_path)]) == TrainingDiverged.exit_code
    lines = capsys.readouterr().err.strip().splitlines()
    err = [line for line in lines if line.startswith("error: ")]
    assert len(err) == 1 and "3 steps in a row" in err[0] and "step_00000004" in err[0], lines
    assert "train.max_skipped_steps=2" in err[0] and lines[-1] == err[0]
    assert sum("skipped: loss" in line for line in lines) == 3, lines  # one line per skip
    # Steps 2 and 3 were skipped (checkpoint 4 holds the state after step 1, as 2 does), and
    # the third bad step in a row stopped the run.
    assert committed_steps(tmp_path / "run") == [2, 4]
    assert main(["inspect", str(tmp_path / "run" / "checkpoints" / "step_00000002")]) == 0


def test_a_checkpoint_is_never_written_with_non_finite_values(tmp_path, make_config, monkeypatch):
    original = StepRunner.apply

    def overflow(self: StepRunner, lr: float, stats) -> None:
        original(self, lr, stats)
        if self.optimizer.step_count == 2:
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("inf")

    monkeypatch.setattr(StepRunner, "apply", overflow)
    config = make_config(tmp_path, train={"max_steps": 4}, checkpoint={"interval": 1})
    with pytest.raises(TrainingDiverged, match=r"tensor \S+ holds non-finite values after step 2"):
        train(config)
    assert committed_steps(tmp_path / "run") == [1]


def _skip_on_one_rank(rank: int, world_size: int, data: dict) -> tuple[list, list]:
    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as patch:
        _poison_gradients_at(patch, {1}, rank=1)
        result = train(config_from_dict(data))
    records = read_metrics(result.run_dir / "metrics.jsonl") if rank == 0 else []
    return result.losses, [r["skipped_steps"] for r in records]


def test_a_bad_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path, make_config):
    data = make_config(
        tmp_path / "dp2", train={"max_steps": 3}, parallel={"distributed_optimizer": True}
    ).to_dict()
    (losses0, skipped), (losses1, _) = run_distributed(_skip_on_one_rank, 2, args=(data,))
    assert skipped == [0, 1, 1]
    assert losses0 == losses1


def _resume_with_rank_1_unable_to_read(rank: int, world_size: int, data: dict) -> str | None:
    from moe_checkpoint import CheckpointError
    from moe_train.errors import MoeTrainError
    from moe_train.train import state_slices

    def unreadable(ckpt, requests):
        raise CheckpointError(f"{ckpt}/optim-00001-of-00001.safetensors: planted checksum error")

    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            patch.setattr(state_slices, "load_slices", unreadable)
        try:
            train(config_from_dict(data))
        except MoeTrainError as e:
            return str(e)
    return None


def test_a_read_failing_on_one_rank_stops_every_rank_with_its_line(tmp_path, make_config):
    """The distributed optimizer's load is collective: a rank whose reads fail still meets
    the others there, then every rank raises the failing rank's error (no rank waits)."""
    saved = train(make_config(tmp_path / "single", train={"max_steps": 2}))
    data = make_config(
        tmp_path / "dp2",
        train={"max_steps": 4},
        checkpoint={"resume": str(saved.checkpoint)},
        parallel={"distributed_optimizer": True},
    ).to_dict()
    messages = run_distributed(_resume_with_rank_1_unable_to_read, 2, args=(data,), timeout=90)
    assert messages[0] == messages[1] and "planted checksum error" in messages[0], messages


def test_a_flipped_byte_stops_the_resume_with_one_line_naming_file_and_tensor(
    tmp_path, make_config
):
    saved = train(make_config(tmp_path / "saved", train={"max_steps": 2}))
    largest = max(saved.checkpoint.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    size = largest.stat().st_size
    with open(largest, "r+b") as f:  # one byte in the middle of the tensor data
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    resume = make_config(tmp_path / "resumed", checkpoint={"resume": str(saved.checkpoint)})
    with pytest.raises(MoeTrainError) as failed:
        train(resume)
    message = str(failed.value)
    assert largest.name in message and "tensor" in message and "\n" not in message, message
