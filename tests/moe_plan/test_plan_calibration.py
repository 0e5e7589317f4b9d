"""The planner against the published operating points of configs/published-*.yaml: each
prediction within 25% of what was published, and docs/planner.md showing the same table."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_plan.calibration import (
    calibrate,
    calibration_table,
    published_points,
)

ROOT = Path(__file__).resolve().parents[2]
BAND = (0.75, 1.25)


@pytest.fixture(scope="module")
def rows():
    return [calibrate(point) for point in published_points(ROOT / "configs")]


def test_every_published_point_is_predicted_within_a_quarter(rows):
    assert len(rows) == 6
    off = [
        f"{r.point.config.name}: predicted {r.predicted_tflops:.0f} TFLOP/s per GPU, "
        f"published {r.published_tflops:.0f}, ratio {r.ratio:.2f}"
        for r in rows
        if not BAND[0] <= r.ratio <= BAND[1]
    ]
    assert not off, "outside [0.75, 1.25]:\n" + "\n".join(off)


def test_a_point_without_a_published_layout_shows_the_planners_fastest(rows):
    (point,) = [r for r in rows if not r.point.layout_published]
    assert point.point.config.name == "published-1t-a58b.yaml"
    assert all(r.fastest is None for r in rows if r.point.layout_published)
    fastest = point.fastest
    assert fastest.own_rank is not None and 1 <= fastest.own_rank <= fastest.fitting
    # The config's layout is one of those that fit, so the fastest is at least as fast.
    assert fastest.tokens_per_s >= point.predicted_tokens_per_s
    assert (fastest.own_rank == 1) == (fastest.tokens_per_s == point.predicted_tokens_per_s)
    table = calibration_table([point])
    assert f"its layout #{fastest.own_rank} of the {fastest.fitting} that fit" in table
    assert f"the planner's fastest layout: {fastest.label} |" in table


def test_the_docs_show_the_table_the_planner_gives(rows):
    docs = (ROOT / "docs/planner.md").read_text()
    assert calibration_table(rows) in docs, "rerun scripts/plan_calibration.py into docs"


def test_published_figures_come_from_the_config_headers(tmp_path):
    (tmp_path / "published-a.yaml").write_text(
        "# Calibration: 16 x h100, 8826 tokens/s per GPU, 203 model TFLOP/s per GPU\nmodel: {}\n"
    )
    (tmp_path / "published-b.yaml").write_text(
        "# Calibration: 512 x b300, 858 model TFLOP/s per GPU, layout not published\n"
    )
    a, b = published_points(tmp_path)
    assert (a.gpus, a.gpu, a.tokens_per_s, a.tflops) == (16, "h100", 8826.0, 203.0)
    assert (b.gpus, b.gpu, b.tokens_per_s, b.tflops) == (512, "b300", None, 858.0)
    assert a.layout_published and not b.layout_published
    (tmp_path / "published-c.yaml").write_text("# Calibration: 8 x b200\n")
    with pytest.raises(ValueError, match=r"published-c\.yaml"):
        published_points(tmp_path)


def test_what_the_constants_act_on():
    from dataclasses import replace

    from moe_plan import DEVICES
    from moe_plan.config import load_config
    from moe_plan.roofline import busiest_rank_seconds, compute_seconds

    path = ROOT / "configs/published-qwen3-30b-a3b-h100.yaml"
    h100 = DEVICES["h100"]
    config = load_config(path)
    blocks, head = compute_seconds(config, h100)
    # The same expert FLOPs in twice the copies of half the width: slower (shorter
    # contractions, more routed bytes).
    narrow = load_config(path, ["--model.moe.expert_hidden=384", "--model.moe.top_k=16"])
    assert compute_seconds(narrow, h100)[0] > 1.05 * blocks
    # Pipeline stages hold equal blocks: the last, with the head, sets the pace.
    staged = load_config(path, ["--parallel.pp=4"])
    assert busiest_rank_seconds(staged, h100) == pytest.approx(blocks / 4 + head)
    # FP8 products are faster where FP8 runs, quantization included (if only by 4% on this
    # model, whose narrow experts leave much of the time to memory-bound kernels), and change
    # nothing where it does not.
    bf16 = load_config(path, ["--precision.linear=bf16", "--precision.expert_gemm=torch"])
    assert compute_seconds(bf16, h100)[0] > 1.03 * blocks
    no_fp8 = replace(h100, fp8_tflops=0.0)
    assert compute_seconds(bf16, no_fp8) == compute_seconds(config, no_fp8)
