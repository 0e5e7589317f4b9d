"""precision.param_dtype=bfloat16: bf16 weights in the compute, FP32 gradients, masters and
moments in the optimizer; every layout against the single process, and checkpoints that hold
the FP32 masters and resume on any layout."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from harness.ranks import run_distributed
from moe_plan.config import config_from_dict
from moe_train.train import train
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner
from training import assert_losses_match, train_cases

STEPS = 6
SAVED_AT = 3
BF16 = {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"}
LR = 3e-3
"""optim.lr of the small test config."""
LAYOUT_RTOL = 2e-3
"""Layouts sum the FP32 gradients in another order: the masters differ in their last bits,
which can move a bf16 weight by one step (2^-8 relative) now and then."""


def _checkpoint(run_dir: Path, step: int = SAVED_AT) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(ckpt.glob("model*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[key] = f.get_tensor(key)
    return tensors


def _assert_masters_close(saved: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Masters of another layout after SAVED_AT steps: most elements within float32-level
    noise; Adam turns a tiny gradient difference on an element whose gradient is near zero
    into an update difference of up to lr per step, so a few may differ by that much."""
    diff = (saved - want).abs()
    assert diff.median() <= 1e-5, f"{name}: median difference {diff.median():.2e}"
    off = (diff > 1e-4).float().mean()
    assert off <= 0.1, f"{name}: {off:.1%} of the elements differ by more than 1e-4"
    assert diff.max() <= SAVED_AT * LR, f"{name}: largest difference {diff.max():.2e}"


def test_the_model_computes_with_bf16_parameters_and_the_optimizer_keeps_fp32_masters(
    make_config, tmp_path
):
    config = make_config(tmp_path, precision=BF16)
    runtime = start_runtime(config)
    try:
        runner = StepRunner(config, runtime)
        assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
        pieces = runner.optimizer.state_pieces()
        assert pieces and {piece.param.dtype for piece in pieces} == {torch.float32}
        # The masters start from the FP32 initialisation, not from its bf16 rounding.
        masters = torch.cat([piece.param.flatten() for piece in pieces])
        assert not torch.equal(masters, masters.bfloat16().float())
        assert torch.bfloat16 not in {b.dtype for b in runner.model.buffers()}  # rope, stats
    finally:
        runtime.close(clean=True)


def test_bf16_parameters_train_on_every_layout_like_one_process(make_config, tmp_path):
    def config(name: str, resume: str | None = None, **parallel) -> dict:
        checkpoint = {"interval": SAVED_AT} if resume is None else {"resume": resume}
        return make_config(
            tmp_path / name,
            train={"max_steps": STEPS},
            data={"micro_batch_size": 2},
            precision=BF16,
            checkpoint=checkpoint,
            parallel=parallel,
        ).to_dict()

    single = train(config_from_dict(config("single")))
    fp32_params = train(
        config_from_dict({**config("fp32"), "precision": {"compute_dtype": "bfloat16"}})
    )
    assert single.losses != fp32_params.losses, "param_dtype=bfloat16 changed nothing"
    assert_losses_match("fp32 params", fp32_params.losses, single.losses, rtol=2e-2)
    # Resumed in the same layout: bit for bit.
    resumed = train(config_from_dict(config("resumed", str(_checkpoint(single.run_dir)))))
    assert resumed.losses == single.losses[SAVED_AT:]

    sharded = {"distributed_optimizer": True}
    ep2 = {"ep": 2, "dispatcher": "all_to_all"}
    single_ckpt = str(_checkpoint(single.run_dir))
    two = run_distributed(
        train_cases,
        world_size=2,
        args=(
            {
                "dp2": config("dp2"),
                "dp2_sharded": config("dp2_sharded", **sharded),
                "ep2_sharded": config("ep2_sharded", **ep2, **sharded),
                "pp2": config("pp2", pp=2),
                "ep2_from_single": config("ep2_from_single", single_ckpt, **ep2, **sharded),
            },
        ),
    )
    for losses in two:
        for name in ("dp2", "dp2_sharded", "ep2_sharded", "pp2"):
            assert_losses_match(name, losses[name], single.losses, rtol=LAYOUT_RTOL)
        after = single.losses[SAVED_AT:]
        assert_losses_match("ep2_from_single", losses["ep2_from_single"], after, LAYOUT_RTOL)

    # Checkpoints hold the FP32 masters, the same global tensors whoever saved them.
    reference = _tensors(_checkpoint(single.run_dir))
    weights = torch.cat([t.flatten() for key, t in reference.items() if "norm" not in key])
    assert not torch.equal(weights, weights.bfloat16().float()), "saved bf16-rounded weights"
    for saver in ("dp2_sharded", "ep2_sharded", "pp2"):
        saved = _tensors(_checkpoint(tmp_path / saver / "run"))
        assert saved.keys() == reference.keys(), saver
        for key, want in reference.items():
            assert saved[key].dtype == torch.float32, f"{saver} {key}"
            _assert_masters_close(saved[key], want, f"{saver} {key}")
    # A sharded bf16 checkpoint resumes in one process with the replicated optimizer.
    from_sharded = train(
        config_from_dict(config("from_sharded", str(_checkpoint(tmp_path / "ep2_sharded" / "run"))))
    )
    assert_losses_match(
        "single_from_ep2", from_sharded.losses, single.losses[SAVED_AT:], LAYOUT_RTOL
    )


def test_bf16_parameters_need_bf16_compute(make_config, tmp_path):
    from moe_train.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        make_config(tmp_path, precision={"param_dtype": "bfloat16", "compute_dtype": "float32"})
    assert str(error.value).startswith(
        "precision.param_dtype=bfloat16 needs precision.compute_dtype=bfloat16"
    )
