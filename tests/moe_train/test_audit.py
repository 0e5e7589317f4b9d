"""How a model was made: the run manifest, checkpoints that carry it, the model card, and
`moe-train verify` on genuine and tampered checkpoint pairs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from launch import run_cli, run_torchrun
from moe_checkpoint import read_trainer_state
from moe_plan.config import config_from_dict
from moe_train.errors import ConfigError, DataError, MoeTrainError
from moe_train.train import train
from moe_train.train.manifest import PACKAGES, environment
from moe_train.verify import verify
from training import ROOT, save_byte_tokens, small_config_data


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(
    tmp_path: Path, token_file: Path, name: str, stop_at: int | None = None, **sections
) -> Path:
    """Train a run of 6 steps (checkpoints every 3) into tmp_path/name, or only its steps
    before `stop_at`; its checkpoints root."""
    data = small_config_data(
        tmp_path / name,
        token_file,
        checkpoint={"interval": 3, "keep_last": 5, **sections.pop("checkpoint", {})},
        **sections,
    )
    train(config_from_dict(data), stop_at_step=stop_at)
    return tmp_path / name / "checkpoints"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def test_the_manifest_records_config_data_code_and_each_launch(tmp_path, token_file):
    root = _run(tmp_path, token_file, "run", train={"max_steps": 3})
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config"]["optim"]["lr"] == 3e-3
    assert manifest["seeds"] == {"train.seed": 0}
    [source] = manifest["data"]
    assert source["files"] == [{"file": str(token_file), "sha256": _sha256(token_file)}]
    [segment] = manifest["segments"]
    assert (segment["start_step"], segment["end_step"]) == (0, 3)
    assert segment["completed"] is not None
    assert segment["environment"]["packages"]["torch"] == torch.__version__
    assert segment["kernels"] == {
        "expert_gemm": "torch (as configured)",
        "linear": "in the compute dtype",
    }
    assert segment["dispatch"] == {
        "dispatcher": "local",
        "transport": None,
        "why": "one rank holds every expert: tokens are only permuted",
        "overlap": False,
    }
    assert segment["source"]["commit"] == _git("rev-parse", "HEAD")
    assert segment["source"]["dirty"] == bool(_git("status", "--porcelain", "--untracked-files=no"))
    # Every checkpoint carries the manifest as of its step.
    state = read_trainer_state(root / "step_00000003")
    assert state["manifest"]["segments"][-1]["end_step"] == 3
    assert state["manifest"]["data"] == manifest["data"]

    # A resume adds a segment; the earlier one stays as the checkpoint recorded it.
    data = small_config_data(
        tmp_path / "run", token_file, train={"max_steps": 6}, checkpoint={"resume": "auto"}
    )
    train(config_from_dict(data))
    resumed = json.loads((tmp_path / "run" / "manifest.json").read_text())
    first, second = resumed["segments"]
    assert first == state["manifest"]["segments"][-1]
    assert {k: v for k, v in first.items() if k != "completed"} == {
        k: v for k, v in segment.items() if k != "completed"
    }
    assert (second["start_step"], second["end_step"]) == (3, 6)
    assert second["completed"] is not None and resumed["config"]["train"]["max_steps"] == 6


def test_the_manifest_records_every_package_of_the_workspace():
    """Each package under packages/ is among the distributions whose versions a manifest
    records, and a run's environment names them (all installed here)."""
    names = {
        tomllib.loads(path.read_text())["project"]["name"]
        for path in (ROOT / "packages").glob("*/pyproject.toml")
    }
    assert "moestack-plan" in names and names <= set(PACKAGES), sorted(names - set(PACKAGES))
    assert names <= set(environment(torch.device("cpu"))["packages"])


def test_verify_passes_a_genuine_pair_bitwise(tmp_path, token_file):
    root = _run(tmp_path, token_file, "run")
    verdict, _, _ = verify(root / "step_00000003", root / "step_00000006")
    assert verdict.ok and verdict.same_layout and not verdict.diffs
    assert verdict.tensors > 10


def test_verify_finds_a_checkpoint_trained_on_changed_data(tmp_path, token_file):
    # 8 windows of 32 tokens: every step reads all of them, the changed one included.
    token_file = tmp_path / "small.npy"
    save_byte_tokens(token_file, "one document. another document. " * 9, limit=8 * 32 + 1)
    root = _run(tmp_path, token_file, "run", stop_at=3)
    original = token_file.read_bytes()
    # Resume from step 3 on data with one document changed, then put the data back.
    ids = np.load(token_file)
    ids[:14] = (ids[:14] + 7) % 256  # "one document."
    np.save(token_file, ids)
    data = small_config_data(
        tmp_path / "run",
        token_file,
        checkpoint={"interval": 3, "keep_last": 5, "resume": "auto"},
    )
    train(config_from_dict(data))
    with pytest.raises(DataError, match=r"no longer matches .*changed since the run"):
        verify(root / "step_00000003", root / "step_00000006")
    token_file.write_bytes(original)
    verdict, _, _ = verify(root / "step_00000003", root / "step_00000006")
    assert not verdict.ok
    assert verdict.failures and all(d.max_abs > 0 for d in verdict.failures)


def test_verify_refuses_pairs_of_different_runs_in_one_line(tmp_path, token_file):
    root = _run(tmp_path, token_file, "run", stop_at=3)
    other_lr = _run(tmp_path, token_file, "lr", optim={"lr": 1e-3})
    other_seed = _run(tmp_path, token_file, "seed", train={"seed": 1})
    a = root / "step_00000003"
    with pytest.raises(MoeTrainError, match=r"another config .*optim\.lr is 0\.001 in B"):
        verify(a, other_lr / "step_00000006")
    with pytest.raises(MoeTrainError, match=r"train\.seed is 1 in B, 0 in A"):
        verify(a, other_seed / "step_00000006")
    with pytest.raises(MoeTrainError, match="give the earlier checkpoint first"):
        verify(other_lr / "step_00000006", a)


def _resumed_at_micro_batch_2(tmp_path: Path, token_file: Path, name: str, lb_scope: str) -> Path:
    """A run of micro-batches of 4 to step 3, resumed at micro-batches of 2 to step 6 (a
    resume takes the change); its checkpoints root."""
    moe = {"model": {"moe": {"lb_scope": lb_scope}}}
    root = _run(tmp_path, token_file, name, stop_at=3, **moe)
    resumed = small_config_data(
        tmp_path / name,
        token_file,
        data={"micro_batch_size": 2},
        checkpoint={"interval": 3, "keep_last": 5, "resume": "auto"},
        **moe,
    )
    train(config_from_dict(resumed))
    return root


def test_verify_takes_a_micro_batch_size_where_the_numbers_do_not_depend_on_it(
    tmp_path, token_file
):
    """Under lb_scope=global_batch B may have another micro-batch size than A, and so may the
    replay: within the tolerance of another layout, bitwise at B's; under micro_batch both are
    refused in one line that says why."""
    root = _resumed_at_micro_batch_2(tmp_path, token_file, "global", "global_batch")
    a, b = root / "step_00000003", root / "step_00000006"
    verdict, _, _ = verify(a, b)  # A's micro-batches of 4 against B's of 2
    assert verdict.ok and not verdict.same_layout and verdict.diffs
    verdict, _, _ = verify(a, b, layout=["--data.micro_batch_size=2"])
    assert verdict.ok and verdict.same_layout and not verdict.diffs

    why = "model.moe.lb_scope=micro_batch balances the experts over each micro-batch"
    root = _resumed_at_micro_batch_2(tmp_path, token_file, "micro", "micro_batch")
    a, b = root / "step_00000003", root / "step_00000006"
    with pytest.raises(MoeTrainError) as refused:
        verify(a, b)
    assert str(refused.value).endswith(f"data.micro_batch_size is 2 in B, 4 in A ({why})")
    root = _run(tmp_path, token_file, "micro_whole")
    with pytest.raises(ConfigError) as refused:
        verify(root / "step_00000003", root / "step_00000006", layout=["--data.micro_batch_size=2"])
    assert str(refused.value) == (
        "--data.micro_batch_size=2: verify replays A's config and takes only the layout "
        "(--parallel.key=value, and --data.micro_batch_size where the numbers do not depend "
        f"on it): {why}"
    )


@pytest.mark.slow
def test_verify_command_on_another_layout_and_the_model_card(tmp_path, token_file):
    root = _run(tmp_path, token_file, "run")
    a, b = root / "step_00000003", root / "step_00000006"
    layout = ["--parallel.ep=2", "--parallel.dispatcher=all_to_all"]
    done = run_torchrun(2, "verify", str(a), str(b), *layout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "another layout than B" in done.stdout and "verified: B follows from A" in done.stdout

    out = tmp_path / "export"
    done = run_cli("export", str(b), "--out", str(out))
    assert done.returncode == 0, done.stderr
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlicense:")
    listing = f"{_sha256(token_file)}  {token_file.name}\n"  # as sha256sum prints it
    assert f"| {token_file.name} |" in card and str(tmp_path) not in card
    assert hashlib.sha256(listing.encode()).hexdigest() in card
    assert "| steps | 6 of 6 |" in card and "Qwen3MoeForCausalLM" in card
    assert _git("rev-parse", "HEAD") in card


def test_checkpoints_count_the_tokens_seen_per_source_across_a_resume(tmp_path):
    # Two sources whose ids do not overlap: a window's ids say which source it came from.
    low, high = tmp_path / "low.npy", tmp_path / "high.npy"
    rng = np.random.default_rng(0)
    np.save(low, rng.integers(0, 100, 3000).astype(np.uint16))
    np.save(high, rng.integers(100, 200, 9000).astype(np.uint16))
    data = small_config_data(tmp_path / "run", low, checkpoint={"interval": 3, "keep_last": 5})
    data["data"]["paths"] = [str(low), str(high)]
    train(config_from_dict(data), stop_at_step=3)
    train(config_from_dict({**data, "checkpoint": {**data["checkpoint"], "resume": "auto"}}))
    state = read_trainer_state(tmp_path / "run" / "checkpoints" / "step_00000006")

    from moe_data import TokenDataset

    config = config_from_dict(data)
    dataset = TokenDataset(config.data.paths, config.data.seq_len)
    from_low = 0
    for step in range(6):
        batch = dataset.batch(step, config.data.global_batch_size, config.train.seed)
        from_low += int((batch[:, 0] < 100).sum()) * config.data.seq_len
    total = 6 * config.data.global_batch_size * config.data.seq_len
    assert state["tokens_per_source"] == {str(low): from_low, str(high): total - from_low}
    assert 0 < from_low < total


def test_token_file_hashes_are_remembered_until_the_file_changes(tmp_path):
    from moe_train.train.manifest import known_sha256

    path, cache = tmp_path / "tokens.bin", tmp_path / "cache"
    path.write_bytes(b"\x01\x00" * 1000)
    assert known_sha256(path, cache) == _sha256(path)
    assert len(list((cache / "sha256").iterdir())) == 1
    path.write_bytes(b"\x02\x00" * 1001)  # another size (and time): hashed again
    assert known_sha256(path, cache) == _sha256(path)
