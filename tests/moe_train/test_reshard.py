"""Checkpoints move between layouts: saved by 1 process, pp=2, ep=2 x dp=2 or pp=2 x ep=2,
they hold the same global tensors, and every other layout resumes from them with the losses of
the uninterrupted single-process run."""

from pathlib import Path

import torch
from safetensors import safe_open

from harness.ranks import run_distributed
from moe_plan.config import config_from_dict
from moe_train.train import train
from training import assert_losses_match, train_cases

STEPS = 8
SAVED_AT = 3


def _checkpoint(root: Path, name: str) -> Path:
    return root / name / "run" / "checkpoints" / f"step_{SAVED_AT:08d}"


def _global_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[key] = f.get_tensor(key)
    return tensors


def test_reshard_matrix(tmp_path, make_config):
    def config(name: str, resume_from: str | None = None, **parallel) -> dict:
        checkpoint = {"interval": SAVED_AT} if resume_from is None else {"resume": resume_from}
        return make_config(
            tmp_path / name,
            train={"max_steps": STEPS},
            data={"micro_batch_size": 2},
            checkpoint=checkpoint,
            parallel=parallel,
        ).to_dict()

    single = train(config_from_dict(config("single")))
    after = single.losses[SAVED_AT:]
    single_ckpt = str(_checkpoint(tmp_path, "single"))
    pp2_ckpt = str(_checkpoint(tmp_path, "pp2"))
    ep2 = {"ep": 2, "dispatcher": "all_to_all"}

    two = run_distributed(
        train_cases,
        world_size=2,
        args=(
            {
                "pp2": config("pp2", pp=2),
                "pp2_from_single": config("pp2_from_single", single_ckpt, pp=2),
                "ep2_from_pp2": config("ep2_from_pp2", pp2_ckpt, **ep2),
            },
        ),
    )
    four = run_distributed(
        train_cases,
        world_size=4,
        args=(
            {
                "ep2dp2": config("ep2dp2", **ep2),
                "pp2ep2": config("pp2ep2", pp=2, **ep2),
                "pp2ep2_from_pp2": config("pp2ep2_from_pp2", pp2_ckpt, pp=2, **ep2),
                "ep2dp2_from_single": config("ep2dp2_from_single", single_ckpt, **ep2),
            },
        ),
    )
    for losses in two:
        assert_losses_match("pp2", losses["pp2"], single.losses)
        assert_losses_match("pp2_from_single", losses["pp2_from_single"], after)
        assert_losses_match("ep2_from_pp2", losses["ep2_from_pp2"], after)
    for losses in four:
        for name in ("ep2dp2", "pp2ep2"):
            assert_losses_match(name, losses[name], single.losses)
        for name in ("pp2ep2_from_pp2", "ep2dp2_from_single"):
            assert_losses_match(name, losses[name], after)

    reference = _global_tensors(Path(single_ckpt))
    for saver in ("pp2", "ep2dp2", "pp2ep2"):
        saved = _global_tensors(_checkpoint(tmp_path, saver))
        assert saved.keys() == reference.keys(), saver
        for key, want in reference.items():
            torch.testing.assert_close(saved[key], want, rtol=1e-4, atol=1e-6, msg=f"{saver} {key}")
        resumed = train(
            config_from_dict(config(f"single_from_{saver}", str(_checkpoint(tmp_path, saver))))
        )
        assert_losses_match(f"single_from_{saver}", resumed.losses, after)
