"""What a run writes (run directory, checkpoints, an exported model) has the permissions the
user's umask gives, as `cp` and `mkdir` would: files 0666 and directories 0777, less the
umask; so a colleague the umask lets in can read them on a shared file system."""

import os
import stat
from pathlib import Path

import pytest

from moe_data import current_umask
from moe_train.train import train

pytest.importorskip("transformers")


@pytest.fixture
def umask(request):
    """Run the test under the umask it is parametrized with; the old one is set back."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _wrong_modes(root: Path, mask: int) -> list[str]:
    """Every file or directory under `root` (and `root`) whose mode is not the umask's."""
    wrong = []
    for path in [root, *sorted(root.rglob("*"))]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        expected = (0o777 if path.is_dir() else 0o666) & ~mask
        if mode != expected:
            wrong.append(f"{path.relative_to(root.parent)}: {mode:o}, expected {expected:o}")
    return wrong


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], indirect=True, ids=oct)
def test_run_dir_checkpoints_and_export_have_the_umask_modes(umask, make_config, tmp_path):
    from moe_train.hf import export_checkpoint

    assert current_umask() == umask
    config = make_config(tmp_path, train={"max_steps": 2}, checkpoint={"interval": 1})
    result = train(config)
    run_dir = Path(config.train.run_dir)
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [p.name for p in checkpoints] == ["step_00000001", "step_00000002"]
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "manifest.json").is_file()
    assert any(p.suffix == ".safetensors" for p in checkpoints[-1].iterdir())

    out = tmp_path / "exported"
    export_checkpoint(result.checkpoint, out, max_shard_bytes=20_000)
    assert len(list(out.glob("*.safetensors"))) > 1

    assert _wrong_modes(run_dir, umask) == []
    assert _wrong_modes(out, umask) == []
