"""precision.expert_gemm=fp8_rowwise and precision.linear (rowwise FP8 on the emulated CPU
path): the choices reach the built model, bad combinations are refused naming the key, and
every layout trains like one process."""

import pytest
import torch

from harness.ranks import run_distributed
from moe_kernels import fp8_rowwise_grouped_mm
from moe_train.config import PrecisionConfig, config_from_dict
from moe_train.errors import ConfigError
from moe_train.model import resolve_expert_gemm
from moe_train.model.moe import Experts
from moe_train.train import train
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner
from training import assert_losses_match, train_cases

FP8 = {"compute_dtype": "bfloat16", "expert_gemm": "fp8_rowwise", "linear": "fp8_rowwise"}
STEPS = 6
LAYOUT_RTOL = 7e-5
"""Layouts against one process with FP8 on (measured: dp2 and pp2 0, ep2 3.5e-5 after 6
steps): tighter than the bf16 layout tolerance, which the gap between FP8 and plain bf16
training (1.6e-4 after 6 steps) would pass, so a layout that dropped FP8 fails here."""


@pytest.mark.slow  # importing torchao takes seconds
def test_fp8_choices_reach_the_built_model(make_config, tmp_path):
    """Experts run fp8_rowwise; attention and dense SwiGLU linears become torchao Float8Linear
    (emulated on the CPU); the router and head do not; the banner says what was applied."""
    from torchao.float8.float8_linear import Float8Linear

    config = make_config(tmp_path, precision=FP8)
    runtime = start_runtime(config)
    try:
        runner = StepRunner(config, runtime)
        model = runner.model
        assert {m.gemm for m in model.modules() if isinstance(m, Experts)} == {"fp8_rowwise"}
        converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
        assert converted and all(".attn." in n or ".ffn." in n for n in converted), converted
        assert not any(".router." in n or n == "head" for n in converted), converted
        assert all(m.config.emulate for m in model.modules() if isinstance(m, Float8Linear))
        assert runner.expert_gemm == "fp8_rowwise (as configured)"
    finally:
        runtime.close(clean=True)
    # The experts' GEMMs are the FP8 ones: their output is fp8_rowwise_grouped_mm's.
    experts = next(m for m in model.modules() if isinstance(m, Experts))
    x = torch.randn(12, config.model.d_model, dtype=torch.bfloat16)
    tokens_per_expert = torch.tensor([3, 0, 5, 4])[: experts.num_experts]
    offsets = torch.cumsum(tokens_per_expert, 0).int()
    w_gate_up, w_down = experts.w_gate_up_EDO.bfloat16(), experts.w_down_EHD.bfloat16()
    hidden = experts.activation(fp8_rowwise_grouped_mm(x, w_gate_up, offsets))
    expected = fp8_rowwise_grouped_mm(hidden, w_down, offsets)
    with torch.no_grad():
        assert torch.equal(experts(x, tokens_per_expert), expected)
    assert resolve_expert_gemm("auto", torch.bfloat16, torch.device("cpu"))[0] == "auto"
    assert resolve_expert_gemm("mxfp8", torch.bfloat16, torch.device("cpu"))[0] == "mxfp8"


@pytest.mark.parametrize("key", ["expert_gemm", "linear"])
def test_fp8_needs_bf16_compute(key):
    with pytest.raises(ConfigError, match=rf"^precision\.{key}=fp8_rowwise needs precision\."):
        PrecisionConfig(**{key: "fp8_rowwise"}, compute_dtype="float32").validate("precision")
    with pytest.raises(ConfigError, match=r"^precision\.linear='fp4' must be one of "):
        config_from_dict({"precision": {"linear": "fp4"}})


@pytest.mark.slow
def test_fp8_rowwise_trains_on_every_layout_like_one_process(make_config, tmp_path):
    """fp8_rowwise experts and linears: dp2, ep2 and pp2 (one 2-rank spawn) against the single
    process, within `LAYOUT_RTOL`. Each micro-batch quantizes its own rows, so
    layouts that keep micro-batches whole see the same scales."""

    def config(name: str, **parallel) -> dict:
        return make_config(
            tmp_path / name,
            train={"max_steps": STEPS},
            data={"micro_batch_size": 2},
            precision=FP8,
            parallel=parallel,
        ).to_dict()

    single = train(config_from_dict(config("single")))
    cases = {
        "dp2": config("dp2"),
        "ep2": config("ep2", ep=2, dispatcher="all_to_all"),
        "pp2": config("pp2", pp=2),
    }
    for losses in run_distributed(train_cases, world_size=2, args=(cases,)):
        for name in cases:
            assert_losses_match(name, losses[name], single.losses, rtol=LAYOUT_RTOL)
