"""Training choices applied to a built model: precision.expert_gemm (mxfp8, triton),
recompute and train.compile, in the trainer and the MoE layer."""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated: it must be set before the first use of
    # grouped_mm(backend="triton") imports moe_kernels.triton_grouped_mm.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_dispatch import make_dispatcher
from moe_plan.config import (
    ModelConfig,
    MoEConfig,
    PrecisionConfig,
    config_from_dict,
)
from moe_train.errors import ConfigError
from moe_train.model import Transformer, apply_compile, apply_expert_gemm, apply_recompute
from moe_train.model.attention import RMSNorm
from moe_train.model.fused import rms_norm, swiglu
from moe_train.model.moe import MoEFeedForward
from moe_train.train import train


def _mean_last(losses: list[float], n: int) -> float:
    return sum(losses[-n:]) / n


def test_mxfp8_training_tracks_bf16_loss(make_config, tmp_path):
    """50 steps with MXFP8 expert GEMMs end within 3% of the bf16 run with the same seed."""
    runs = {}
    for mxfp8 in (False, True):
        config = make_config(
            tmp_path / f"mxfp8-{mxfp8}",
            train={"max_steps": 50, "seed": 3},
            precision={"compute_dtype": "bfloat16", "expert_gemm": "mxfp8" if mxfp8 else "torch"},
        )
        runs[mxfp8] = train(config).losses
    bf16_loss, mxfp8_loss = _mean_last(runs[False], 5), _mean_last(runs[True], 5)
    assert runs[True] != runs[False], "precision.expert_gemm=mxfp8 gave the bf16 losses bit for bit"
    assert mxfp8_loss < 0.8 * runs[True][0], f"MXFP8 run did not learn: {runs[True]}"
    gap = abs(mxfp8_loss - bf16_loss) / bf16_loss
    assert gap <= 0.03, (
        f"final loss (mean of last 5 steps): mxfp8 {mxfp8_loss:.4f}, bf16 {bf16_loss:.4f}, "
        f"relative gap {gap:.2%} > 3%"
    )


def _moe_layer(seed: int, mxfp8: bool = False, **moe_overrides) -> MoEFeedForward:
    config = MoEConfig(num_experts=4, top_k=2, expert_hidden=64, **moe_overrides)
    dispatcher = make_dispatcher(
        "local", num_experts=config.num_experts, group_alignment=config.group_alignment
    )
    layer = MoEFeedForward(64, config, dispatcher)
    apply_expert_gemm(layer, "mxfp8" if mxfp8 else "torch")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return layer


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


def _output_and_expert_grads(
    layer: MoEFeedForward, x_BSD: torch.Tensor, grad_BSD: torch.Tensor, autocast: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y_BSD = layer(x_BSD)
    y_BSD.backward(grad_BSD)
    experts = layer.experts
    return y_BSD.detach(), experts.w_gate_up_EDO.grad, experts.w_down_EHD.grad


def test_mxfp8_moe_layer_is_close_to_float64_and_grads_reach_both_expert_weights():
    """Output and expert weight gradients of the MXFP8 layer against a float64 reference.

    e4m3 keeps 3 mantissa bits, so each quantized operand is within 2^-4 relative of its
    value (normal range) and a product of two within ~2^-3; summed over a GEMM, the normwise
    relative error stays below that. bf16 (2^-8 per operand) must be far closer, which also
    shows that the MXFP8 path really quantizes.
    """
    torch.manual_seed(0)
    x_BSD = torch.randn(2, 40, 64)
    grad_BSD = torch.randn(2, 40, 64)
    reference = copy.deepcopy(_moe_layer(seed=1)).double()
    y64, gate_up64, down64 = _output_and_expert_grads(
        reference, x_BSD.double(), grad_BSD.double(), autocast=False
    )
    errors = {}
    for mxfp8 in (False, True):
        layer = _moe_layer(seed=1, mxfp8=mxfp8)
        y, gate_up_grad, down_grad = _output_and_expert_grads(layer, x_BSD, grad_BSD, True)
        assert layer.experts.w_gate_up_EDO.dtype == torch.float32  # FP32 master weights
        for name, grad in (("w_gate_up_EDO", gate_up_grad), ("w_down_EHD", down_grad)):
            assert grad is not None and grad.dtype == torch.float32, name
            assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        errors[mxfp8] = {
            "output": _relative_error(y, y64),
            "w_gate_up_EDO.grad": _relative_error(gate_up_grad, gate_up64),
            "w_down_EHD.grad": _relative_error(down_grad, down64),
        }
    for name, mxfp8_error in errors[True].items():
        bf16_error = errors[False][name]
        assert mxfp8_error <= 2**-3, f"{name}: MXFP8 relative error {mxfp8_error:.4f} > 2^-3"
        assert bf16_error <= 2**-6, f"{name}: bf16 relative error {bf16_error:.4f} > 2^-6"
        assert mxfp8_error > 2 * bf16_error, (
            f"{name}: MXFP8 error {mxfp8_error:.2e} is not above bf16's {bf16_error:.2e}: "
            "is the MXFP8 path quantizing?"
        )


def test_triton_expert_gemm_gives_the_torch_moe_layer():
    """expert_gemm=triton (interpreted on CPU) matches torch, forward and backward."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        from moe_kernels import triton_grouped_mm

        if not triton_grouped_mm.INTERPRETED:
            pytest.skip("triton kernels were built before TRITON_INTERPRET=1 was set")
    torch.manual_seed(0)
    # 24 tokens x top 2 = 48 rows (no group padding), d_model 32: a few interpreter tiles.
    x_BSD = torch.randn(2, 12, 32, device=device)
    grad_BSD = torch.randn(2, 12, 32, device=device)
    results = {}
    for backend in ("torch", "triton"):
        config = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, group_alignment=1)
        dispatcher = make_dispatcher("local", num_experts=4, group_alignment=1)
        layer = MoEFeedForward(32, config, dispatcher).to(device)
        apply_expert_gemm(layer, backend)
        assert layer.experts.gemm == backend
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in layer.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        x = x_BSD.clone().requires_grad_()
        y = layer(x)
        y.backward(grad_BSD)
        results[backend] = {
            "output": y.detach(),
            "input grad": x.grad,
            "w_gate_up_EDO.grad": layer.experts.w_gate_up_EDO.grad,
            "w_down_EHD.grad": layer.experts.w_down_EHD.grad,
        }
    for name, expected in results["torch"].items():
        torch.testing.assert_close(
            results["triton"][name], expected, rtol=1e-4, atol=1e-5, msg=name
        )


def _config_data(**precision) -> dict:
    return {"precision": precision}


def test_mxfp8_needs_bfloat16_compute_dtype():
    with pytest.raises(ConfigError) as error:
        config_from_dict(_config_data(expert_gemm="mxfp8", compute_dtype="float32"))
    assert str(error.value) == (
        "precision.expert_gemm=mxfp8 needs precision.compute_dtype=bfloat16 (MXFP8 is a bf16 "
        "training recipe), got precision.compute_dtype=float32"
    )
    assert config_from_dict(_config_data(expert_gemm="mxfp8")).precision.expert_gemm == "mxfp8"
    PrecisionConfig(expert_gemm="mxfp8", compute_dtype="bfloat16").validate("precision")


def test_expert_gemm_is_validated():
    assert config_from_dict(_config_data(expert_gemm="auto")).precision.expert_gemm == "auto"
    assert config_from_dict({}).precision.expert_gemm == "torch"
    with pytest.raises(ConfigError, match=r"^precision\.expert_gemm='cuda' must be one of "):
        config_from_dict(_config_data(expert_gemm="cuda"))


def test_training_choices_are_set_on_the_built_model():
    """apply_recompute and apply_expert_gemm reach every block and expert module, and refuse
    a name they do not know."""
    config = ModelConfig(
        vocab_size=32,
        d_model=32,
        n_layers=3,
        n_heads=2,
        n_kv_heads=2,
        dense_layers=1,
        dense_hidden=32,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16),
    )
    model = Transformer(config)
    assert {b.recompute for b in model.blocks.values()} == {"none"}
    apply_recompute(model, "full")
    assert {b.recompute for b in model.blocks.values()} == {"full"}
    apply_expert_gemm(model, "mxfp8")
    assert [layer.experts.gemm for layer in model.moe_layers().values()] == ["mxfp8", "mxfp8"]
    with pytest.raises(ValueError, match="expert GEMM 'fp4' is not one of torch, triton"):
        apply_expert_gemm(model, "fp4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="recompute mode 'some' is not one of none"):
        apply_recompute(model, "some")  # type: ignore[arg-type]


def test_compiled_elementwise_parts_train_like_eager(make_config, tmp_path):
    """train.compile=true swaps compiled RMSNorm and SwiGLU into every module and gives the
    eager losses (to fp32 rounding: the compiled kernels sum in another order)."""
    model = Transformer(
        ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2,
                    dense_layers=1, dense_hidden=32, qk_norm=True,
                    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16)),
    )  # fmt: skip
    apply_compile(model)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel is not rms_norm for m in norms)
    assert all(layer.experts.activation is not swiglu for layer in model.moe_layers().values())
    assert all(block.attn.qk_kernel is not None for block in model.blocks.values())
    losses = {}
    for compile_ in (False, True):
        config = make_config(tmp_path / str(compile_), train={"max_steps": 3, "compile": compile_})
        losses[compile_] = train(config).losses
    for eager, compiled in zip(losses[False], losses[True], strict=True):
        assert compiled == pytest.approx(eager, rel=1e-5)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_compiled_model_gives_the_eager_logits_and_gradients(qk_norm):
    """Every compiled part (norms, SwiGLU, the per-head norm and rotation of queries and
    keys) computes what the eager model does, forward and backward, in fp32."""
    torch.manual_seed(0)
    eager = Transformer(
        ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    dense_layers=1, dense_hidden=48, qk_norm=qk_norm,
                    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16)),
    )  # fmt: skip
    compiled = copy.deepcopy(eager)
    apply_compile(compiled)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    outputs = []
    for model in (eager, compiled):
        logits = model(tokens)
        logits.square().mean().backward()
        outputs.append(logits)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    for (name, want), got in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("capability", "torchao", "applied"),
    [
        ((10, 0), True, "mxfp8 (auto: torchao, torchao's MXFP8 kernels on sm_100)"),
        (
            (10, 0),
            False,
            "auto (auto: measured, no native FP8 grouped GEMM: the GPU is sm_100; scaled_mm "
            "needs sm_90)",
        ),
        ((9, 0), True, "fp8_rowwise (auto: scaled_mm, torch._scaled_grouped_mm on sm_90)"),
        (
            (8, 0),
            True,
            "auto (auto: measured, no native FP8 grouped GEMM: the GPU is sm_80; scaled_mm "
            "needs sm_90)",
        ),
    ],
    ids=["sm100", "sm100_without_torchao", "sm90", "sm80"],
)
def test_auto_expert_gemm_picks_per_gpu_and_says_which(monkeypatch, capability, torchao, applied):
    """precision.expert_gemm=auto with bf16 compute: MXFP8 on SM100 (with torchao's kernels),
    rowwise FP8 on SM90 only (torch builds its rowwise FP8 grouped GEMM for Hopper),
    bf16 elsewhere, as moe-devices' rule applied by moe-kernels says; what
    apply_training_choices returns is the banner's `expert GEMMs` text. fp32 compute keeps
    the fp32 grouped GEMM on any GPU."""
    from moe_devices import Software
    from moe_kernels import device_paths
    from moe_plan.config import config_from_dict
    from moe_train.model import resolve_expert_gemm
    from moe_train.train.rank_build import apply_training_choices

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(device_paths, "installed_software", lambda: Software(torchao=torchao))
    monkeypatch.setattr(device_paths, "_torchao_has_mxfp8_kernels", lambda: True)
    cuda = torch.device("cuda")
    config = config_from_dict(_config_data(compute_dtype="bfloat16", expert_gemm="auto"))
    model = Transformer(config.model)
    kernels = apply_training_choices(model, config, cuda)
    assert kernels["expert_gemm"] == applied
    gemm = applied.split()[0]
    assert {layer.experts.gemm for layer in model.moe_layers().values()} == {gemm}
    assert resolve_expert_gemm("auto", torch.float32, cuda) == (
        "auto",
        "auto: measured, float32 compute; the FP8 GEMMs take bfloat16",
    )
    assert resolve_expert_gemm("mxfp8", torch.bfloat16, cuda)[1].startswith(
        "torchao: " if gemm == "mxfp8" else "emulated: "
    )
