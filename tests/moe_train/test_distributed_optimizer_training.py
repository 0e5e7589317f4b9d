"""The distributed optimizer reproduces single-process training, clipping and checkpoints."""

from harness.ranks import run_distributed
from moe_train.train import train
from training import assert_losses_match, train_cases


def test_distributed_optimizer_matches_single_process_and_resumes_across_optimizers(
    tmp_path, make_config
):
    steps = {"max_steps": 10}
    tiny_clip = {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 1e-3}
    single = train(make_config(tmp_path / "single", train=steps, checkpoint={"interval": 5}))
    single_clipped = train(make_config(tmp_path / "single_clip", train=steps, optim=tiny_clip))
    single_step5 = single.run_dir / "checkpoints" / "step_00000005"
    sharded = {"distributed_optimizer": True}
    cases = {
        "dp2": make_config(
            tmp_path / "dp2", train=steps, parallel=sharded, checkpoint={"interval": 5}
        ),
        "ep2": make_config(
            tmp_path / "ep2", train=steps, parallel={**sharded, "ep": 2, "dispatcher": "all_to_all"}
        ),
        "dp2_tiny_clip": make_config(
            tmp_path / "clip", train=steps, parallel=sharded, optim=tiny_clip
        ),
        "dp2_from_single": make_config(
            tmp_path / "from_single",
            train=steps,
            parallel=sharded,
            checkpoint={"resume": str(single_step5)},
        ),
    }
    per_rank = run_distributed(
        train_cases, world_size=2, args=({k: v.to_dict() for k, v in cases.items()},)
    )
    for rank_losses in per_rank:
        assert_losses_match("dp2", rank_losses["dp2"], single.losses)
        assert_losses_match("ep2", rank_losses["ep2"], single.losses)
        assert_losses_match("dp2_tiny_clip", rank_losses["dp2_tiny_clip"], single_clipped.losses)
        assert_losses_match("dp2_from_single", rank_losses["dp2_from_single"], single.losses[5:])
    # A checkpoint of sharded optimizer state resumes in one process with plain AdamW.
    sharded_step5 = tmp_path / "dp2" / "run" / "checkpoints" / "step_00000005"
    resumed = train(
        make_config(tmp_path / "resume", train=steps, checkpoint={"resume": str(sharded_step5)})
    )
    assert_losses_match("single_from_dp2", resumed.losses, single.losses[5:])
