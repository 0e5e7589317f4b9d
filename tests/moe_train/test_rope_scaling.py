"""model.rope_scaling: YaRN's frequencies, its config checks, and a model continued at a
longer context from its checkpoint. (Agreement with transformers' YaRN: test_hf_export.)"""

import math

import pytest
import torch

from moe_plan.config import RopeScalingConfig, config_from_dict
from moe_train.errors import ConfigError
from moe_train.model.attention import rope_tables
from moe_train.train import train
from training import small_config_data


def _yarn(**fields) -> RopeScalingConfig:
    return RopeScalingConfig(type="yarn", original_max_position_embeddings=16, **fields)


def test_yarn_keeps_fast_pairs_divides_slow_ones_and_scales_by_its_factor():
    """Head size 64, theta 10000, original context 16: pair i turns
    t_i = 16 / (2 pi 10000^(i/32)) times over it (t_0 = 2.55). The pair that turns
    beta_fast = 2 times is i = 0.84, rounded down to 0 (kept); the one that turns
    beta_slow = 0.05 times is i = 13.65, rounded up to 14 (from there on divided by the
    factor); the ratio ramps linearly in between."""
    plain_cos, plain_sin = rope_tables(64, 40, 10000.0)
    angles_plain = torch.atan2(plain_sin, plain_cos)
    cos, sin = rope_tables(64, 40, 10000.0, _yarn(factor=4.0, beta_fast=2.0, beta_slow=0.05))
    scale = 0.1 * math.log(4.0) + 1
    assert torch.allclose(cos.square() + sin.square(), torch.full_like(cos, scale**2))
    angles = torch.atan2(sin, cos)
    assert torch.allclose(angles[:, :1], angles_plain[:, :1], atol=1e-6)  # kept
    position = torch.arange(40, dtype=torch.float64)[:, None]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(14, 32, dtype=torch.float64) * 2 / 64)
    divided = torch.atan2(torch.sin(position * inv_freq / 4), torch.cos(position * inv_freq / 4))
    assert torch.allclose(angles[:, 14:].double(), divided, atol=1e-6)
    # Pair i of 1-13 turns at (1 - i/14) + (i/14) / 4 of its plain frequency (position 1).
    ramp = torch.arange(1, 14, dtype=torch.float64) / 14
    expected = (1 - ramp) + ramp / 4
    assert torch.allclose((angles[1, 1:14] / angles_plain[1, 1:14]).double(), expected, atol=1e-5)
    # A factor of 1 is plain RoPE; an attention factor scales cos and sin.
    assert torch.equal(rope_tables(64, 40, 10000.0, _yarn(factor=1.0))[0], plain_cos)
    given = rope_tables(
        64, 40, 10000.0, _yarn(factor=4.0, beta_fast=2.0, beta_slow=0.05, attention_factor=2.0)
    )[0]
    assert torch.allclose(given / 2.0, cos / scale)


@pytest.mark.parametrize(
    ("theta", "head_dim", "yarn"),
    [
        (10000.0, 16, None),
        (500000.0, 128, None),
        (1000.0, 8, {"factor": 4.0}),
        (10000.0, 64, {"factor": 4.0, "beta_fast": 2.0, "beta_slow": 0.05}),
        (500000.0, 128, {"factor": 8.0, "attention_factor": 2.0}),
    ],
)
def test_tables_are_transformers_tables_bitwise(theta, head_dim, yarn):
    """The fp32 tables transformers computes (plain and YaRN): an ulp of difference moves an
    imported model's logits by ~1e-6 relative."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": theta}
    scaling = None
    if yarn is not None:
        scaling = _yarn(**yarn)
        rope |= {"rope_type": "yarn", "original_max_position_embeddings": 16} | yarn
    config = transformers.Qwen3Config(hidden_size=4 * head_dim, num_attention_heads=4,
                                      head_dim=head_dim, rope_parameters=rope)  # fmt: skip
    want_cos, want_sin = Qwen3RotaryEmbedding(config)(torch.zeros(1), torch.arange(300)[None])
    cos, sin = rope_tables(head_dim, 300, theta, scaling)
    assert torch.equal(torch.cat((cos, cos), -1), want_cos[0])
    assert torch.equal(torch.cat((sin, sin), -1), want_sin[0])


@pytest.mark.parametrize(
    ("rope_scaling", "message"),
    [
        ({"factor": 2.0}, r"model\.rope_scaling\.factor=2\.0 has no effect with "),
        ({"type": "yarn", "factor": 2.0}, r"needs model\.rope_scaling\.original_max_position"),
        ({"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 8}, r"factor=0\.5"),
        (
            {"type": "yarn", "original_max_position_embeddings": 8, "beta_fast": 1.0},
            r"beta_fast=1\.0 must be greater than model\.rope_scaling\.beta_slow=1\.0",
        ),
        ({"type": "ntk"}, r"model\.rope_scaling\.type"),
    ],
)
def test_a_rope_scaling_that_cannot_apply_names_its_key(
    rope_scaling, message, token_file, tmp_path
):
    data = small_config_data(tmp_path, token_file, model={"rope_scaling": rope_scaling})
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_a_model_continues_at_a_longer_context_from_its_checkpoint(token_file, tmp_path, capsys):
    """Trained at 16 positions, continued at 32 with YaRN (factor 2 over the original 16) by
    checkpoint.init_from: the position encoding may change without allow_config_change, a
    weight's shape may not."""
    short = small_config_data(tmp_path / "short", token_file, train={"max_steps": 2},
                              data={"seq_len": 16})  # fmt: skip
    first = train(config_from_dict(short))
    longer = small_config_data(
        tmp_path / "long",
        token_file,
        train={"max_steps": 2},
        data={"seq_len": 32},
        model={"rope_scaling": {"type": "yarn", "factor": 2.0,
                                "original_max_position_embeddings": 16}},
        checkpoint={"init_from": str(first.checkpoint)},
    )  # fmt: skip
    continued = train(config_from_dict(longer))
    assert continued.start_step == 0 and len(continued.losses) == 2
    assert all(math.isfinite(loss) for loss in continued.losses)
    # Loaded, not trained from scratch: the first loss is the trained model's, lower than a
    # fresh model's at the same context.
    fresh = small_config_data(tmp_path / "fresh", token_file, train={"max_steps": 1},
                              data={"seq_len": 32}, model=longer["model"])  # fmt: skip
    assert continued.losses[0] < train(config_from_dict(fresh)).losses[0]
    longer["model"]["n_kv_heads"] = 1
    longer["train"]["run_dir"] = str(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"^model\.n_kv_heads=1 differs from"):
        train(config_from_dict(longer))
