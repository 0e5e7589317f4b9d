"""The planner against the published operating points of configs/published-*.yaml: each
prediction within 25% of what was published, and docs/planner.md showing the same table."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_train.plan.calibration import (
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


def test_the_docs_show_the_table_the_planner_gives(rows):
    docs = (ROOT / "docs/planner.md").read_text()
    assert calibration_table(rows) in docs, "rerun scripts/plan_calibration.py into docs"


def test_published_figures_come_from_the_config_headers(tmp_path):
    (tmp_path / "published-a.yaml").write_text(
        "# Calibration: 16 x h100, 8826 tokens/s per GPU, 203 model TFLOP/s per GPU\nmodel: {}\n"
    )
    (tmp_path / "published-b.yaml").write_text(
        "# Calibration: 512 x b300, 858 model TFLOP/s per GPU\n"
    )
    a, b = published_points(tmp_path)
    assert (a.gpus, a.gpu, a.tokens_per_s, a.tflops) == (16, "h100", 8826.0, 203.0)
    assert (b.gpus, b.gpu, b.tokens_per_s, b.tflops) == (512, "b300", None, 858.0)
    (tmp_path / "published-c.yaml").write_text("# Calibration: 8 x b200\n")
    with pytest.raises(ValueError, match=r"published-c\.yaml"):
        published_points(tmp_path)
