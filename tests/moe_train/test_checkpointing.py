"""Trainer checkpoints: exact resume, resume on another layout, bad checkpoints, inspect."""

import json
import os

import pytest

from harness.ranks import run_distributed
from moe_plan.config import config_from_dict
from moe_train.cli import main
from moe_train.errors import ConfigError, MoeTrainError
from moe_train.train import read_metrics, train
from training import save_config


def test_resume_continues_bitwise(tmp_path, make_config):
    uninterrupted = train(make_config(tmp_path / "a", train={"max_steps": 8})).losses
    first = train(make_config(tmp_path / "b", train={"max_steps": 8}, checkpoint={"interval": 4}))
    assert first.losses == uninterrupted
    step4 = first.run_dir / "checkpoints" / "step_00000004"
    assert (step4 / "COMMITTED").is_file()
    resumed = train(
        make_config(tmp_path / "c", train={"max_steps": 8}, checkpoint={"resume": str(step4)})
    )
    assert resumed.losses == uninterrupted[4:]
    # Resuming into the same run directory rewrites the metrics after the checkpoint, but
    # saving again over the later history is refused.
    same_dir = {"resume": str(step4), "interval": 4}
    with pytest.raises(ConfigError, match="already holds checkpoints after step 4"):
        train(make_config(tmp_path / "b", train={"max_steps": 8}, checkpoint=same_dir))
    no_saves = {"resume": str(step4), "interval": 0, "interval_minutes": 0}
    again = train(make_config(tmp_path / "b", train={"max_steps": 8}, checkpoint=no_saves))
    assert again.run_dir == first.run_dir
    assert again.losses == uninterrupted[4:]
    assert [r["loss"] for r in read_metrics(first.run_dir / "metrics.jsonl")] == uninterrupted


def test_auto_resume_keep_last_and_async(tmp_path, make_config):
    config = make_config(
        tmp_path,
        train={"max_steps": 6},
        checkpoint={"interval": 1, "keep_last": 2, "async_save": True},
    )
    result = train(config)
    names = sorted(p.name for p in (result.run_dir / "checkpoints").iterdir())
    assert names == ["step_00000005", "step_00000006"]
    # auto resume finds step 6 = max_steps: nothing left to run, nothing rewritten.
    config.checkpoint.resume = "auto"
    config.checkpoint.async_save = False
    assert train(config).losses == []
    assert len(read_metrics(result.run_dir / "metrics.jsonl")) == 6


def test_bad_checkpoints_give_one_line_and_damage_nothing(tmp_path, make_config, capsys):
    result = train(
        make_config(tmp_path / "run", train={"max_steps": 2}, checkpoint={"interval": 2})
    )
    ckpt = result.run_dir / "checkpoints" / "step_00000002"
    model_file = next(ckpt.glob("model-*.safetensors"))
    with pytest.raises(ConfigError, match="is not a committed checkpoint"):
        train(make_config(tmp_path / "x", checkpoint={"resume": str(tmp_path / "nothing")}))

    with open(model_file, "r+b") as f:  # flip one byte of tensor data
        f.seek(os.path.getsize(model_file) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    capsys.readouterr()  # what training printed
    assert main(["inspect", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and model_file.name in err[0]

    os.truncate(model_file, os.path.getsize(model_file) - 100)
    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(MoeTrainError, match=model_file.name):
        train(make_config(tmp_path / "y", checkpoint={"resume": str(ckpt)}))
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert not (tmp_path / "y").exists()  # no run directory for a start that failed


def test_a_resume_that_fails_on_a_corrupt_checkpoint_says_so_once_and_writes_nothing(
    tmp_path, make_config, capsys
):
    saves = {"interval": 2, "resume": "auto"}
    first = train(make_config(tmp_path, train={"max_steps": 4}, checkpoint=saves))
    files = {p.name: p.read_bytes() for p in first.run_dir.iterdir() if p.is_file()}
    assert {"metrics.jsonl", "config.yaml", "manifest.json"} <= files.keys()
    model_file = next((first.run_dir / "checkpoints" / "step_00000004").glob("model-*"))
    with open(model_file, "r+b") as f:  # flip one byte of the last tensor's data
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    capsys.readouterr()
    relaunch = make_config(tmp_path, train={"max_steps": 6}, checkpoint=saves)
    config_path = save_config(tmp_path / "relaunch.yaml", relaunch)
    assert main(["train", str(config_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and model_file.name in err[0], err
    assert "checksum" in err[0] and "resumed" not in err[0]
    # The run it tried to resume is as it was (metrics, config, manifest), and no new one.
    assert {p.name: p.read_bytes() for p in first.run_dir.iterdir() if p.is_file()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["relaunch.yaml", "run", "tokens.npy"]
    # Elsewhere, from that checkpoint: no run directory is made.
    elsewhere = {"resume": str(model_file.parent)}
    other = save_config(
        tmp_path / "other.yaml", make_config(tmp_path / "new", checkpoint=elsewhere)
    )
    assert main(["train", str(other)]) == 2
    assert not (tmp_path / "new").exists()


def test_inspect_lists_tensors_and_topology(tmp_path, make_config, capsys):
    result = train(make_config(tmp_path, train={"max_steps": 1}, checkpoint={"interval": 1}))
    ckpt = result.run_dir / "checkpoints" / "step_00000001"
    assert main(["inspect", str(ckpt), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 1 and summary["verification"] == "ok"
    assert summary["saved_topology"]["world_size"] == 1
    experts = summary["tensors"]["blocks.0.ffn.experts.w_down_EHD"]
    assert experts["shape"] == [4, 32, 32] and experts["dtype"] == "F32"


def _save_at_layout(rank: int, world_size: int, data: dict) -> list[float]:
    return train(config_from_dict(data)).losses


def test_single_process_checkpoint_resumes_at_dp2_and_ep2(tmp_path, make_config):
    single = train(
        make_config(tmp_path / "single", train={"max_steps": 6}, checkpoint={"interval": 3})
    )
    step3 = str(single.run_dir / "checkpoints" / "step_00000003")
    for name, parallel in {"dp2": {}, "ep2": {"ep": 2, "dispatcher": "all_to_all"}}.items():
        data = make_config(
            tmp_path / name, train={"max_steps": 6}, checkpoint={"resume": step3}, parallel=parallel
        ).to_dict()
        per_rank = run_distributed(_save_at_layout, world_size=2, args=(data,))
        for a, b in zip(per_rank[0], single.losses[3:], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), name


@pytest.mark.parametrize(
    "parallel", [{}, {"ep": 2, "dispatcher": "all_to_all"}], ids=["dp2", "ep2"]
)
def test_checkpoint_saved_by_two_ranks_resumes_in_one_process(tmp_path, make_config, parallel):
    uninterrupted = train(make_config(tmp_path / "single", train={"max_steps": 6})).losses
    saved = make_config(
        tmp_path / "multi", train={"max_steps": 6}, checkpoint={"interval": 3}, parallel=parallel
    )
    data = saved.to_dict()
    run_distributed(_save_at_layout, world_size=2, args=(data,))
    step3 = tmp_path / "multi" / "run" / "checkpoints" / "step_00000003"
    resumed = train(
        make_config(tmp_path / "resume", train={"max_steps": 6}, checkpoint={"resume": str(step3)})
    )
    for a, b in zip(resumed.losses, uninterrupted[3:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


KILLER = """
import os, signal, sys
import moe_checkpoint.save as save
from moe_train.cli import main

phase_to_kill, saves = sys.argv[1], {"n": 0}

def hook(name):
    if name == "files_created":
        saves["n"] += 1
    if saves["n"] == 3 and name == phase_to_kill:
        os.kill(os.getpid(), signal.SIGKILL)

save._phase_hook = hook
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("phase", ["files_created", "writing", "written", "renamed"])
def test_killed_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, make_config, phase):
    """SIGKILL inside the third save (step 3): auto resume continues from step 2, exactly."""
    import subprocess
    import sys

    config = make_config(
        tmp_path, train={"max_steps": 5}, checkpoint={"interval": 1, "resume": "auto"}
    )
    uninterrupted = train(make_config(tmp_path / "reference", train={"max_steps": 5})).losses
    config_path = tmp_path / "config.yaml"
    save_config(config_path, config)
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, phase, "train", str(config_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    committed = sorted(p.name for p in checkpoints.iterdir() if (p / "COMMITTED").exists())
    assert committed[-1] == "step_00000002"
    resumed = train(config)
    assert resumed.losses == uninterrupted[2:]
    assert [r["loss"] for r in read_metrics(resumed.run_dir / "metrics.jsonl")] == uninterrupted
