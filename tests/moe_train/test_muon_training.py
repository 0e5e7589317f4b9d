"""optim.name=muon trains: which parameters Muon updates, the same losses on every layout as
in one process (replicated and with the distributed optimizer), checkpoints that resume
bitwise and on another layout or optimizer sharding, and the optimizer switch on resume."""

import pytest
import torch

from harness.ranks import run_distributed
from moe_parallel import DistributedMuon, ReplicatedMuon
from moe_plan.config import config_from_dict
from moe_train.errors import ConfigError
from moe_train.model import Transformer
from moe_train.train import train
from moe_train.train.rank_build import is_hidden_matrix
from training import assert_losses_match, small_config_data, train_cases

STEPS = 20
SAVED_AT = 10


def _data(token_file, run_dir, optim=None, checkpoint=None, precision=None, **parallel) -> dict:
    """A dense first layer, then an MoE layer with a shared expert; Muon with its iteration
    in FP32 (bfloat16 rounding would tell the layouts' summation orders apart)."""
    return small_config_data(
        run_dir,
        token_file,
        model={"dense_layers": 1, "moe": {"shared_experts": 1}},
        data={"micro_batch_size": 2},
        optim={"name": "muon", "muon_ns_dtype": "float32", "lr": 0.02, **(optim or {})},
        train={"max_steps": STEPS},
        checkpoint=checkpoint or {},
        precision=precision or {},
        parallel=parallel,
    )


def _checkpoint(run_dir) -> str:
    return str(run_dir / "checkpoints" / f"step_{SAVED_AT:08d}")


def _resume(run_dir) -> dict:
    """checkpoint.* that resumes the run in `run_dir` from SAVED_AT."""
    return {"resume": _checkpoint(run_dir)}


@pytest.fixture(scope="module")
def reference(shared_token_file, tmp_path_factory):
    """The single-process Muon run, checkpointed at SAVED_AT."""
    run_dir = tmp_path_factory.mktemp("muon") / "single"
    data = _data(shared_token_file, run_dir, checkpoint={"interval": SAVED_AT})
    return run_dir, train(config_from_dict(data)).losses


def test_muon_updates_the_hidden_matrices_and_adamw_the_rest(shared_token_file, tmp_path):
    config = config_from_dict(_data(shared_token_file, tmp_path))
    names = {n for n, p in Transformer(config.model).named_parameters() if is_hidden_matrix(n, p)}
    # The q/k/v biases and a shared-expert gate (a score vector, as a router's) stay AdamW's.
    config.model.qkv_bias, config.model.moe.shared_expert_gate = True, True
    model = Transformer(config.model)
    assert "blocks.1.ffn.shared_gate.weight" in dict(model.named_parameters())
    assert {n for n, p in model.named_parameters() if is_hidden_matrix(n, p)} == names
    assert names == {
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.out.weight",
        "blocks.0.ffn.gate_up.weight",
        "blocks.0.ffn.down.weight",
        "blocks.1.attn.qkv.weight",
        "blocks.1.attn.out.weight",
        "blocks.1.ffn.experts.w_gate_up_EDO",
        "blocks.1.ffn.experts.w_down_EHD",
        "blocks.1.ffn.shared.gate_up.weight",
        "blocks.1.ffn.shared.down.weight",
    }


def test_muon_single_process_learns_and_resumes_bitwise(shared_token_file, tmp_path, reference):
    run_dir, losses = reference
    assert sum(losses[-3:]) < sum(losses[:3]) - 1.0, losses
    adamw = _data(shared_token_file, tmp_path / "adamw", optim={"name": "adamw"})
    assert train(config_from_dict(adamw)).losses[1:] != losses[1:], "Muon is in use"
    resumed = _data(shared_token_file, tmp_path / "resumed", checkpoint={"resume": ""})
    resumed["checkpoint"]["resume"] = _checkpoint(run_dir)
    result = train(config_from_dict(resumed))
    assert result.start_step == SAVED_AT
    assert result.losses == losses[SAVED_AT:], "same layout: bitwise"


@pytest.mark.slow
def test_muon_layouts_match_single_process(shared_token_file, tmp_path, reference):
    """dp2, ep2 over each dispatcher and pp2 in one spawn, and dp2 with the distributed
    optimizer, which resumes its own checkpoint (bitwise) and the single-process one; then
    one process resumes the ep2 run's and the distributed run's checkpoints."""
    ep2 = {"ep": 2, "dispatcher": "all_to_all"}
    sharded = {"distributed_optimizer": True}
    every = {"interval": SAVED_AT}
    cases = {
        "dp2_distributed": _data(shared_token_file, tmp_path / "dist", checkpoint=every, **sharded),
        "dp2_distributed_resumed": _data(
            shared_token_file,
            tmp_path / "dist_resumed",
            checkpoint=_resume(tmp_path / "dist"),
            **sharded,
        ),
        "dp2_distributed_from_single": _data(
            shared_token_file,
            tmp_path / "dist_from_single",
            checkpoint=_resume(reference[0]),
            **sharded,
        ),
        "dp2": _data(shared_token_file, tmp_path / "dp2"),
        "ep2_all_to_all": _data(
            shared_token_file, tmp_path / "ep2", checkpoint={"interval": SAVED_AT}, **ep2
        ),
        "ep2_rowwise": _data(shared_token_file, tmp_path / "rowwise", ep=2, dispatcher="rowwise"),
        "pp2": _data(shared_token_file, tmp_path / "pp2", pp=2),
    }
    # Rowwise buffers: capacity 4 x the even share is more than any expert can receive.
    cases["ep2_rowwise"]["model"]["moe"]["capacity_factor"] = 4.0
    per_rank = run_distributed(train_cases, world_size=2, args=(cases,), timeout=600)
    _, losses = reference
    resumed = {"dp2_distributed_resumed", "dp2_distributed_from_single"}
    for name in cases.keys() - resumed:
        assert_losses_match(name, per_rank[0][name], losses)
    assert_losses_match(
        "1 -> dp2 distributed", per_rank[0]["dp2_distributed_from_single"], losses[SAVED_AT:]
    )
    dist_losses = per_rank[0]["dp2_distributed"]
    assert per_rank[0]["dp2_distributed_resumed"] == dist_losses[SAVED_AT:], "same layout: bitwise"
    for source in ("ep2", "dist"):
        single = _data(
            shared_token_file, tmp_path / f"from_{source}", checkpoint=_resume(tmp_path / source)
        )
        assert_losses_match(
            f"{source} -> 1", train(config_from_dict(single)).losses, losses[SAVED_AT:]
        )


@pytest.mark.slow
def test_muon_pp2_dp2_ep2_matches_single_process(shared_token_file, tmp_path, reference):
    """Replicated and with the distributed optimizer (dense matrices owned over dp2, each
    expert's on the rank that holds it)."""
    cases = {
        "pp2_dp2_ep2": _data(shared_token_file, tmp_path / "pp2dp2ep2", pp=2, ep=2),
        "pp2_dp2_ep2_distributed": _data(
            shared_token_file, tmp_path / "distributed", pp=2, ep=2, distributed_optimizer=True
        ),
    }
    per_rank = run_distributed(train_cases, world_size=4, args=(cases,), timeout=600)
    for name in cases:
        assert_losses_match(name, per_rank[0][name], reference[1])


def test_switching_optimizer_on_resume(shared_token_file, tmp_path, reference, capsys):
    run_dir, _ = reference
    data = _data(shared_token_file, tmp_path / "switch", optim={"name": "adamw"})
    data["checkpoint"] = {"resume": _checkpoint(run_dir)}
    with pytest.raises(ConfigError) as refused:
        train(config_from_dict(data))
    message = str(refused.value)
    assert message.startswith("optim.name=adamw differs from muon in "), message
    assert "checkpoint.allow_config_change=true" in message and "\n" not in message
    data["checkpoint"]["allow_config_change"] = True
    data["train"]["progress"] = True
    capsys.readouterr()
    result = train(config_from_dict(data))
    assert result.start_step == SAVED_AT and len(result.losses) == STEPS - SAVED_AT
    captured = capsys.readouterr()
    banner = (captured.out + captured.err).splitlines()
    resumed = [line for line in banner if line.startswith("run ") and "resumed" in line]
    changed = [line for line in banner if line.startswith("changed ")]
    assert len(resumed) == 1 and len(changed) == 1, banner
    assert "optim.name 'muon' -> 'adamw'" in changed[0], changed
    assert "adamw starts with fresh optimizer state" in changed[0], changed


def test_muon_config_values_are_checked(shared_token_file, tmp_path):
    for optim, message in [
        ({"name": "sgd"}, "optim.name='sgd' must be one of 'adamw', 'muon'"),
        ({"muon_ns_dtype": "float16"}, "optim.muon_ns_dtype='float16' must be one of"),
        ({"muon_momentum": 1.0}, r"optim.muon_momentum=1.0 must be in \[0, 1\)"),
        ({"adamw_lr_ratio": 0}, "optim.adamw_lr_ratio=0.0 must be positive"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict(_data(shared_token_file, tmp_path, optim=optim))


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "distributed"])
def test_build_optimizer_gives_muon(shared_token_file, tmp_path, sharded):
    from moe_parallel import single_process_layout
    from moe_train.train.rank_build import build_optimizer

    data = _data(
        shared_token_file, tmp_path, optim={"adamw_lr_ratio": 0.5}, distributed_optimizer=sharded
    )
    config = config_from_dict(data)
    model = Transformer(config.model)
    optimizer = build_optimizer(model, config, single_process_layout())
    assert isinstance(optimizer, DistributedMuon if sharded else ReplicatedMuon)
    assert optimizer.ns_dtype == torch.float32 and optimizer.adamw_lr_ratio == 0.5
    hidden = sum(p.numel() for n, p in model.named_parameters() if is_hidden_matrix(n, p))
    rest = sum(p.numel() for n, p in model.named_parameters() if not is_hidden_matrix(n, p))
    adamw = 8 * rest if sharded else 0  # the distributed one allocates AdamW's moments at once
    assert optimizer.state_bytes() == 4 * hidden + adamw, "one FP32 buffer per Muon element"


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "distributed"])
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_planner_counts_muon_state_as_the_optimizer_holds_it(
    shared_token_file, tmp_path, param_dtype, sharded
):
    from moe_parallel import single_process_layout
    from moe_plan.memory import _rank_memory
    from moe_train.model import apply_param_dtype
    from moe_train.train.rank_build import DTYPES, build_optimizer

    precision = {"param_dtype": param_dtype, "compute_dtype": param_dtype}
    data = _data(shared_token_file, tmp_path, precision=precision, distributed_optimizer=sharded)
    config = config_from_dict(data)
    model = Transformer(config.model)
    apply_param_dtype(model, DTYPES[param_dtype])
    optimizer = build_optimizer(model, config, single_process_layout())
    optimizer.load_state(0, lambda requests: [torch.zeros(r.numel) for r in requests])
    assert _rank_memory(config, 1, 0).optimizer == optimizer.state_bytes()
    adamw = config_from_dict({**data, "optim": {**data["optim"], "name": "adamw"}})
    hidden = sum(p.numel() for n, p in model.named_parameters() if is_hidden_matrix(n, p))
    assert _rank_memory(adamw, 1, 0).optimizer - _rank_memory(config, 1, 0).optimizer == 4 * hidden


def test_planner_balances_distributed_muon_matrices_over_the_group(shared_token_file, tmp_path):
    """On dp ranks a rank holds the most loaded owner's matrices: at most 1/dp of them plus
    the largest (per reduction group), and with the AdamW shards at most 1/dp of the
    replicated state plus the largest matrix of each group."""
    from moe_plan.memory import _rank_memory, hidden_matrix_sizes, most_owned

    data = _data(shared_token_file, tmp_path, distributed_optimizer=True)
    data["model"]["n_layers"] = 4
    config = config_from_dict(data)
    replicated = config_from_dict({**data, "parallel": {"distributed_optimizer": False}})
    dense, expert = hidden_matrix_sizes(config, 0)
    hidden = sum(
        p.numel() for n, p in Transformer(config.model).named_parameters() if is_hidden_matrix(n, p)
    )
    assert sum(dense) + sum(expert) == hidden
    for dp in (2, 4):
        owned = most_owned(dense, dp)
        assert sum(dense) / dp <= owned <= sum(dense) / dp + max(dense), dp
        held = _rank_memory(config, dp, 0).optimizer
        bound = _rank_memory(replicated, dp, 0).optimizer / dp + 4 * (max(dense) + max(expert))
        assert held <= bound, (dp, held, bound)


def test_planner_times_the_newton_schulz_iterations(shared_token_file, tmp_path):
    from moe_plan.hardware import DEVICES
    from moe_plan.roofline import newton_schulz_flops, step_time
    from moe_plan.traffic import Traffic

    config = config_from_dict(_data(shared_token_file, tmp_path))
    expected = 0
    for name, p in Transformer(config.model).named_parameters():
        if is_hidden_matrix(name, p):
            matrices = p.reshape(-1, *p.shape[-2:])
            m, n = sorted(p.shape[-2:])
            expected += matrices.shape[0] * 5 * (4 * m * m * n + 2 * m**3)
    assert newton_schulz_flops(config) == expected
    sharded = config_from_dict(_data(shared_token_file, tmp_path, distributed_optimizer=True))
    assert newton_schulz_flops(sharded, 2) == expected / 2, "dp2: a rank iterates half of them"
    assert newton_schulz_flops(config, 2) == expected, "replicated: every rank iterates all"
    adamw = config_from_dict(_data(shared_token_file, tmp_path, optim={"name": "adamw"}))
    assert newton_schulz_flops(adamw) == 0
    device, traffic = next(iter(DEVICES.values())), Traffic(wire={})
    muon_time, adamw_time = (
        step_time(config, 1, device, traffic),
        step_time(adamw, 1, device, traffic),
    )
    assert muon_time.optimizer_s > 0 and adamw_time.optimizer_s == 0
    assert muon_time.total_s == pytest.approx(adamw_time.total_s + muon_time.optimizer_s)
