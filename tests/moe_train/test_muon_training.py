"""optim.name=muon trains: which parameters Muon updates, the same losses on every replicated
layout as in one process, checkpoints that resume bitwise and on another layout, and the
optimizer switch on resume."""

import pytest
import torch

from harness.ranks import run_distributed
from moe_parallel import ReplicatedMuon
from moe_train.config import config_from_dict
from moe_train.errors import ConfigError
from moe_train.model import Transformer
from moe_train.train import train
from moe_train.train.step import is_hidden_matrix
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
def test_muon_replicated_layouts_match_single_process(shared_token_file, tmp_path, reference):
    """dp2, ep2 over each dispatcher and pp2 in one spawn; then one process resumes the ep2
    run's checkpoint."""
    ep2 = {"ep": 2, "dispatcher": "all_to_all"}
    cases = {
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
    for name in cases:
        assert_losses_match(name, per_rank[0][name], losses)
    single = _data(shared_token_file, tmp_path / "from_ep2", checkpoint={"resume": ""})
    single["checkpoint"]["resume"] = _checkpoint(tmp_path / "ep2")
    assert_losses_match("ep2 -> 1", train(config_from_dict(single)).losses, losses[SAVED_AT:])


@pytest.mark.slow
def test_muon_pp2_dp2_ep2_matches_single_process(shared_token_file, tmp_path, reference):
    cases = {"pp2_dp2_ep2": _data(shared_token_file, tmp_path / "pp2dp2ep2", pp=2, ep=2)}
    per_rank = run_distributed(train_cases, world_size=4, args=(cases,), timeout=600)
    assert_losses_match("pp2_dp2_ep2", per_rank[0]["pp2_dp2_ep2"], reference[1])


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


def test_muon_with_the_distributed_optimizer_is_a_config_error(shared_token_file, tmp_path):
    data = _data(shared_token_file, tmp_path, distributed_optimizer=True)
    with pytest.raises(ConfigError, match=r"optim\.name=muon does not work with parallel\.distrib"):
        config_from_dict(data)


def test_muon_config_values_are_checked(shared_token_file, tmp_path):
    for optim, message in [
        ({"name": "sgd"}, "optim.name='sgd' must be one of 'adamw', 'muon'"),
        ({"muon_ns_dtype": "float16"}, "optim.muon_ns_dtype='float16' must be one of"),
        ({"muon_momentum": 1.0}, r"optim.muon_momentum=1.0 must be in \[0, 1\)"),
        ({"adamw_lr_ratio": 0}, "optim.adamw_lr_ratio=0.0 must be positive"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict(_data(shared_token_file, tmp_path, optim=optim))


def test_build_optimizer_gives_replicated_muon(shared_token_file, tmp_path):
    from moe_parallel import single_process_layout
    from moe_train.train.step import build_optimizer

    config = config_from_dict(_data(shared_token_file, tmp_path, optim={"adamw_lr_ratio": 0.5}))
    model = Transformer(config.model)
    optimizer = build_optimizer(model, config, single_process_layout())
    assert isinstance(optimizer, ReplicatedMuon)
    assert optimizer.ns_dtype == torch.float32 and optimizer.adamw_lr_ratio == 0.5
    hidden = sum(p.numel() for n, p in model.named_parameters() if is_hidden_matrix(n, p))
    assert optimizer.state_bytes() == 4 * hidden, "one FP32 buffer per Muon element, once built"


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_planner_counts_muon_state_as_the_optimizer_holds_it(
    shared_token_file, tmp_path, param_dtype
):
    from moe_parallel import single_process_layout
    from moe_train.model import apply_param_dtype
    from moe_train.plan.memory import _rank_memory
    from moe_train.train.step import DTYPES, build_optimizer

    precision = {"param_dtype": param_dtype, "compute_dtype": param_dtype}
    data = _data(shared_token_file, tmp_path, precision=precision)
    config = config_from_dict(data)
    model = Transformer(config.model)
    apply_param_dtype(model, DTYPES[param_dtype])
    optimizer = build_optimizer(model, config, single_process_layout())
    optimizer.load_state(0, lambda requests: [torch.zeros(r.numel) for r in requests])
    assert _rank_memory(config, 1, 0).optimizer == optimizer.state_bytes()
    adamw = config_from_dict({**data, "optim": {**data["optim"], "name": "adamw"}})
    hidden = sum(p.numel() for n, p in model.named_parameters() if is_hidden_matrix(n, p))
    assert _rank_memory(adamw, 1, 0).optimizer - _rank_memory(config, 1, 0).optimizer == 4 * hidden


def test_planner_times_the_newton_schulz_iterations(shared_token_file, tmp_path):
    from moe_train.plan.hardware import DEVICES
    from moe_train.plan.roofline import newton_schulz_flops, step_time
    from moe_train.plan.traffic import Traffic

    config = config_from_dict(_data(shared_token_file, tmp_path))
    expected = 0
    for name, p in Transformer(config.model).named_parameters():
        if is_hidden_matrix(name, p):
            matrices = p.reshape(-1, *p.shape[-2:])
            m, n = sorted(p.shape[-2:])
            expected += matrices.shape[0] * 5 * (4 * m * m * n + 2 * m**3)
    assert newton_schulz_flops(config) == expected
    adamw = config_from_dict(_data(shared_token_file, tmp_path, optim={"name": "adamw"}))
    assert newton_schulz_flops(adamw) == 0
    device, traffic = next(iter(DEVICES.values())), Traffic(wire={})
    muon_time, adamw_time = (
        step_time(config, 1, device, traffic),
        step_time(adamw, 1, device, traffic),
    )
    assert muon_time.optimizer_s > 0 and adamw_time.optimizer_s == 0
    assert muon_time.total_s == pytest.approx(adamw_time.total_s + muon_time.optimizer_s)
