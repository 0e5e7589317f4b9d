"""`moe-train inspect` on checkpoints the trainer wrote: what it reports (text and JSON), the
optimizer tensors it leaves out without --all, a checkpoints root, and its checks."""

import json
import re
import time
from datetime import UTC, datetime

import pytest
import torch

from moe_checkpoint import OwnedSlice, save_checkpoint
from moe_train.cli import main
from moe_train.train import train


@pytest.fixture
def trained(tmp_path, make_config):
    """A 4-step run saving at steps 2 and 4; (config, checkpoints root, start, end time)."""
    config = make_config(tmp_path, train={"max_steps": 4}, checkpoint={"interval": 2})
    started = time.time()
    result = train(config)
    return config, result.run_dir / "checkpoints", started, time.time()


def _index(ckpt) -> dict:
    return json.loads((ckpt / "index.json").read_text())


def _inspect_json(capsys, *args) -> dict:
    assert main(["inspect", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_report_holds_state_layout_sizes_and_config(trained, capsys):
    config, root, started, finished = trained
    ckpt = root / "step_00000002"
    report = _inspect_json(capsys, ckpt)
    assert report["path"] == str(ckpt) and report["chosen_from"] is None
    assert report["step"] == 2 and report["verification"] == "ok"
    assert started <= report["saved_at"] <= finished
    stamp = datetime.fromtimestamp(report["saved_at"], tz=UTC)
    assert report["saved_at_utc"] == stamp.strftime("%Y-%m-%d %H:%M:%S UTC")
    assert report["saved_topology"] == {"world_size": 1, "pp": 1, "dp": 1, "ep": 1}
    batch = config.data.global_batch_size
    assert report["data"]["samples_consumed"] == 2 * batch
    assert report["model_config"] == config.to_dict()["model"]

    index = _index(ckpt)["tensors"]
    optim = {name for name in index if name.startswith("optim.")}
    assert optim and len(optim) < len(index)
    assert set(report["tensors"]) == set(index) - optim
    assert report["tensors_left_out"] == len(optim)
    for category in ("model", "optim"):
        mine = [t for t in index.values() if t["category"] == category]
        nbytes = sum(t["byte_range"][1] - t["byte_range"][0] for t in mine)
        assert report["bytes_by_category"][category] == nbytes, category
        assert report["tensors_by_category"][category] == len(mine), category
    expert = report["tensors"]["blocks.0.ffn.experts.w_down_EHD"]
    assert expert["shape"] == [4, 32, 32] and expert["dtype"] == "F32"

    everything = _inspect_json(capsys, ckpt, "--all")
    assert set(everything["tensors"]) == set(index) and everything["tensors_left_out"] == 0


def test_text_report_of_a_checkpoints_root_shows_the_newest(trained, capsys):
    config, root, _, _ = trained
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    newest = root / "step_00000004"
    assert out.startswith(f"checkpoint   {newest}\n")
    assert f"(the newest committed checkpoint in {root})" in out
    assert re.search(r"^step +4$", out, re.M)
    assert re.search(r"^saved at +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$", out, re.M)
    assert re.search(r"^saved by +world_size=1 pp=1 dp=1 ep=1$", out, re.M)
    samples = 4 * config.data.global_batch_size
    assert re.search(rf"^data +samples_consumed={samples} epoch=0 ", out, re.M)
    optim = sum(name.startswith("optim.") for name in _index(newest)["tensors"])
    model = len(_index(newest)["tensors"]) - optim
    sizes = rf"^sizes +model [\d.]+ KiB \({model} tensors\), optim [\d.]+ KiB \({optim} tensors\)"
    assert re.search(sizes, out, re.M)
    assert re.search(r"^checksums +ok \(crc32 of every 1\.0 MiB chunk", out, re.M)
    assert re.search(r"^  moe\.num_experts +4$", out, re.M)
    assert re.search(r"^blocks\.0\.ffn\.experts\.w_down_EHD +4x32x32 +F32 ", out, re.M)
    assert not re.search(r"^optim\.", out, re.M)
    assert f"({optim} optimizer tensors not listed; --all lists them)" in out

    assert main(["inspect", str(root), "--all"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^optim\.", out, re.M)) == optim
    assert "not listed" not in out


def test_damage_fails_verification_but_not_the_quick_listing(trained, capsys):
    _, root, _, _ = trained
    ckpt = root / "step_00000004"
    record = _index(ckpt)["tensors"]["embed.weight"]
    path = ckpt / record["file"]
    data = bytearray(path.read_bytes())
    data[record["byte_range"][0] + 100] ^= 0x04
    path.write_bytes(bytes(data))

    assert main(["inspect", str(ckpt)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {path}: tensor 'embed.weight': checksum mismatch in chunk 0")
    assert re.search(r"^checksums +FAILED: ", captured.out, re.M)

    assert main(["inspect", str(ckpt), "--json"]) == 2
    captured = capsys.readouterr()
    assert "tensor 'embed.weight'" in json.loads(captured.out)["verification"]

    report = _inspect_json(capsys, ckpt, "--no-verify")
    assert report["verification"] is None and report["step"] == 4
    assert main(["inspect", str(ckpt), "--no-verify"]) == 0
    assert re.search(r"^checksums +not verified \(--no-verify\)$", capsys.readouterr().out, re.M)


def test_paths_without_a_committed_checkpoint_give_one_line(trained, tmp_path, capsys):
    _, root, _, _ = trained
    empty = tmp_path / "empty"
    empty.mkdir()
    uncommitted = root / "step_00000004"
    (uncommitted / "COMMITTED").unlink()
    for path, message in [
        (tmp_path / "missing", f"error: checkpoint {tmp_path / 'missing'} does not exist"),
        (empty, f"error: {empty} is neither a committed checkpoint (no COMMITTED marker) nor a"),
        (uncommitted, f"error: checkpoint {uncommitted} is not committed"),
    ]:
        assert main(["inspect", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), err
    # The root's newest committed checkpoint is now step 2.
    assert _inspect_json(capsys, root)["path"] == str(root / "step_00000002")


def test_missing_trainer_state_keys_are_reported_unknown(tmp_path, capsys):
    """trainer_state.json holds whatever the trainer passed: here nothing but the step."""
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    slices = [OwnedSlice.whole("w", w), OwnedSlice.whole("optim.w", torch.zeros(2, 3))]
    categories = {"w": "model", "optim.w": "optim"}
    ckpt = save_checkpoint(tmp_path, 7, slices, categories, {"step": 7}).wait()
    report = _inspect_json(capsys, ckpt)
    for key in ("saved_at", "saved_at_utc", "saved_topology", "data", "model_config"):
        assert report[key] is None, key
    assert report["tensors_left_out"] == 1 and list(report["tensors"]) == ["w"]
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    for label in ("saved at", "saved by", "data"):
        assert re.search(rf"^{label} +unknown$", out, re.M), label
    assert "model config unknown" in out
