"""The planner's dispatch with FP8 rows: bytes and buffers of what the trainer sends."""

from __future__ import annotations

import pytest

from moe_plan import predict_memory, predict_traffic
from moe_plan.config import config_from_dict


def _config(dispatch_dtype: str, recompute: str = "none"):
    return config_from_dict(
        {
            "model": {
                "d_model": 256,
                "moe": {"capacity_factor": 1.25, "dispatch_dtype": dispatch_dtype},
            },
            "parallel": {"ep": 2, "dispatcher": "rowwise", "recompute": recompute},
        }
    )


@pytest.mark.parametrize(("recompute", "forwards"), [("none", 1 / 2), ("full", 2 / 3)])
def test_fp8_rows_shrink_the_forward_dispatches_alone(recompute, forwards):
    """The forward dispatches (rerun by recompute) carry d_model e4m3 bytes and a 4-byte scale
    per row instead of d_model bf16 values; the combine and every gradient are unchanged."""
    bf16 = predict_traffic(_config("compute", recompute), 2)
    fp8 = predict_traffic(_config("fp8", recompute), 2)
    share = (256 + 4) / (256 * 2)
    expected = bf16.payload["ep dispatch"] * (forwards * share + 1 - forwards)
    assert fp8.payload["ep dispatch"] == pytest.approx(expected, rel=1e-12)
    assert fp8.payload["ep combine"] == bf16.payload["ep combine"]
    assert fp8.calls == bf16.calls


def test_fp8_dispatch_has_its_own_byte_buffers():
    bf16 = predict_memory(_config("compute"), 2).dispatch_buffers
    fp8 = predict_memory(_config("fp8"), 2).dispatch_buffers
    assert fp8 == pytest.approx(bf16 * (1 + (256 + 4) / (256 * 2)), rel=1e-12)
