"""precision.expert_gemm=fp8_rowwise and precision.linear (rowwise FP8 on the emulated CPU
path): the choices reach the built model, bad combinations are refused naming the key, and
every layout trains like one process."""

import pytest
import torch

from harness.ranks import run_distributed
from moe_kernels import fp8_rowwise_grouped_mm
from moe_plan.config import PrecisionConfig, config_from_dict
from moe_train.errors import ConfigError
from moe_train.model import resolve_expert_gemm
from moe_train.model.moe import Experts
from moe_train.train import train
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner
from training import (
    FP8_LAYOUT_RTOL,
    FP8_PRECISION,
    assert_fp8_ran,
    assert_losses_match,
    train_cases_with_gemms,
    train_fp8_single,
)

FP8 = FP8_PRECISION
STEPS = 6


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
        assert runner.kernels == {
            "expert_gemm": "fp8_rowwise (emulated: the device is a CPU)",
            "linear": "fp8_rowwise (emulated: the device is a CPU)",
        }
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


TWO_RANK_LAYOUTS: dict[str, dict] = {
    "dp2": {},
    "dp2_sharded": {"distributed_optimizer": True},
    "ep2": {"ep": 2, "dispatcher": "all_to_all"},
    "ep2_sharded": {"ep": 2, "dispatcher": "all_to_all", "distributed_optimizer": True},
    "ep2_rowwise": {"ep": 2, "dispatcher": "rowwise"},
    "ep2_rowwise_shared_memory": {
        "ep": 2,
        "dispatcher": "rowwise",
        "rowwise_transport": "symmetric_memory",
    },
    "pp2": {"pp": 2},
    "cp2": {"cp": 2},
    "ep2_dedup": {"ep": 2, "dispatcher": "all_to_all_dedup"},
}
"""Every layout of two ranks: data parallel with the replicated and the distributed
optimizer, expert parallel over each dispatcher (and sharded), pipeline and context parallel."""

BF16_PARAM_LAYOUTS: dict[str, dict] = {
    "dp2_bf16_params": {"distributed_optimizer": True},
    "ep2_bf16_params": {"ep": 2, "dispatcher": "all_to_all"},
}
"""Layouts with bf16 parameters (and FP8), against one process with bf16 parameters and FP8."""


@pytest.mark.slow
def test_fp8_rowwise_trains_on_every_layout_like_one_process(make_config, tmp_path):
    """fp8_rowwise experts and linears on every two-rank layout (`TWO_RANK_LAYOUTS`), and with
    bf16 parameters (`BF16_PARAM_LAYOUTS`), in one spawn, against the single process within
    `FP8_LAYOUT_RTOL`; every rank reports that its experts and linears ran FP8, and plain bf16
    training is further from the FP8 process than that tolerance. Each micro-batch quantizes
    its own rows, so layouts that keep micro-batches whole see the same scales."""

    def config(name: str, param_dtype: str = "float32", precision=FP8, **parallel) -> dict:
        data = make_config(
            tmp_path / name,
            train={"max_steps": STEPS},
            data={"micro_batch_size": 2},
            precision={**precision, "param_dtype": param_dtype},
            parallel=parallel,
        ).to_dict()
        if parallel.get("dispatcher") == "rowwise":  # more than any expert can receive
            data["model"]["moe"]["capacity_factor"] = 4.0
        return data

    single = train_fp8_single(config("single"))
    single_bf16_params = train_fp8_single(config("single_bf16_params", "bfloat16"))
    bf16 = train(config_from_dict(config("bf16", precision={"compute_dtype": "bfloat16"})))
    gap = max(abs(a - b) / abs(b) for a, b in zip(bf16.losses, single, strict=True))
    assert gap > FP8_LAYOUT_RTOL, f"bf16 is {gap:.1e} from FP8: the tolerance cannot tell them"
    cases = {name: config(name, **parallel) for name, parallel in TWO_RANK_LAYOUTS.items()}
    for name, parallel in BF16_PARAM_LAYOUTS.items():
        cases[name] = config(name, "bfloat16", **parallel)
    losses_per_rank, gemms_per_rank = zip(
        *run_distributed(train_cases_with_gemms, world_size=2, args=(cases,), timeout=600),
        strict=True,
    )
    assert_fp8_ran(gemms_per_rank, list(cases))
    for losses in losses_per_rank:
        for name in cases:
            reference = single_bf16_params if name in BF16_PARAM_LAYOUTS else single
            assert_losses_match(name, losses[name], reference, rtol=FP8_LAYOUT_RTOL)
