"""Print the planner's calibration table: each published operating point of
configs/published-*.yaml (the figures in its `# Calibration:` header line) against the
planner's prediction of its layout. docs/planner.md holds its output."""

from pathlib import Path

from moe_plan.calibration import calibrate, calibration_table, published_points

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

if __name__ == "__main__":
    print(calibration_table([calibrate(point) for point in published_points(CONFIGS)]))
