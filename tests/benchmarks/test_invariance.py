"""benchmarks/invariance.py: the tables name what the issue asks, the CI subset touches every
feature and layout, a planted difference fails and a small one passes, a refusal reads as
refused; and one real cell (plain on dp2) passes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import invariance
from harness.invariance_card import card, cell_mark, merged, write_card
from harness.invariance_cells import (
    CI_CELLS,
    FEATURES,
    FP32_RTOL,
    LAYOUTS,
    base_config,
    select_cells,
    with_keys,
)
from harness.invariance_compare import (
    compare_params,
    compare_rows,
    relative_difference,
    tensor_difference,
)
from harness.invariance_runs import RunEnd, run_end
from harness.invariance_spread import round_up, spread, tolerance_of
from moe_plan import ConfigError
from moe_plan.config import check_start, config_from_dict

ISSUE_FEATURES = {
    "plain",
    "aux_free",
    "lb_global",
    "z_loss",
    "shared_experts",
    "capacity",
    "mtp",
    "document_masking",
    "label_mask",
    "muon",
    "recompute_selective",
    "recompute_full",
    "node_limited",
    "bf16_distopt",
    "fp8_rowwise",
    "dispatch_rowwise",
    "dispatch_dedup",
    "fp8_dispatch",
    "ep_overlap",
}
"""The features issue 52 lists, by the names the tool gives them, and those added since
(FP8 dispatch, exchange overlap)."""
ISSUE_LAYOUTS = {
    "dp2": 2,
    "dp2_distopt": 2,
    "ep2": 2,
    "ep4": 4,
    "pp2": 2,
    "pp2_interleaved": 2,
    "cp2": 2,
    "dp2_ep2": 4,
    "pp2_ep2": 4,
    "cp2_ep2": 2,
    "cp2_pp2": 4,
    "pp2_dp2_ep2": 8,
}
"""The layouts issue 52 lists, and their ranks."""


def _rows(**changes: float) -> list[dict]:
    """Three steps of metrics rows; `changes` adds to step 2's values."""
    rows = []
    for step in (1, 2, 3):
        row = {"step": step, "loss": 5.0 - step / 10, "grad_norm": 1.2, "lb_loss": 1.01}
        row |= {"z_loss": 4.4, "eval_loss": 5.1, "dropped_token_frac": 0.0}
        row |= {"tokens_seen": 512 * step, "trained_tokens": 512, "tokens_per_source": {"d": 512}}
        if step == 2:
            row |= {key: row[key] + change for key, change in changes.items()}
        rows.append(row)
    return rows


def test_the_tables_name_every_feature_and_layout_of_the_issue():
    assert set(FEATURES) == ISSUE_FEATURES
    assert {name: layout.ranks for name, layout in LAYOUTS.items()} == ISSUE_LAYOUTS
    assert all(entry.doc for entry in [*FEATURES.values(), *LAYOUTS.values()])
    precision = {name for name, feature in FEATURES.items() if feature.precision}
    assert precision == {"bf16_distopt", "fp8_rowwise"}
    fp32 = [FEATURES[name] for name in ISSUE_FEATURES - precision]
    assert all(feature.rtol == feature.params_rtol == FP32_RTOL for feature in fp32)


def test_the_ci_subset_touches_every_feature_and_layout_once_or_more():
    assert {feature for feature, _ in CI_CELLS} == set(FEATURES)
    assert {layout for _, layout in CI_CELLS} == set(LAYOUTS)
    assert len(set(CI_CELLS)) == len(CI_CELLS) == len(FEATURES)
    assert select_cells(None, None) == list(CI_CELLS)
    assert len(select_cells(None, None, every=True)) == len(FEATURES) * len(LAYOUTS)
    assert select_cells(["muon"], ["ep2", "pp2"]) == [("muon", "ep2"), ("muon", "pp2")]
    with pytest.raises(ValueError, match="unknown layout 'ep3'"):
        select_cells(None, ["ep3"])


def test_the_start_check_passes_every_cell(tmp_path):
    base = base_config(tmp_path / "data", steps=4)
    refused = {}
    for feature_name, feature in FEATURES.items():
        for layout_name, layout in LAYOUTS.items():
            try:
                config = config_from_dict(with_keys(base, feature.keys, layout.keys))
                check_start(config, layout.ranks)
            except ConfigError as e:
                refused[feature_name, layout_name] = str(e)
    assert refused == {}
    assert base["precision"] == {"param_dtype": "float32", "compute_dtype": "float32"}


def test_list_prints_the_features_then_the_layouts(capsys):
    assert invariance.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"feature {f}" for f in FEATURES] + [f"layout {lay}" for lay in LAYOUTS]


def test_a_planted_difference_above_the_tolerance_fails_and_one_below_passes():
    reference = _rows()
    below = compare_rows(_rows(loss=4.8 * 5e-6), reference)
    assert below.failures(FP32_RTOL) == [] and below.metrics["loss"] == pytest.approx(5e-6)
    above = compare_rows(_rows(grad_norm=1.2 * 3e-5), reference)
    assert above.failures(FP32_RTOL) == ["grad_norm differs by 3.00e-05 (tolerance 1e-05)"]
    assert above.metrics["mtp_loss"] is None  # logged by neither run


def test_a_missing_step_or_metric_fails():
    reference = _rows()
    assert compare_rows(reference[::2], reference).failures(FP32_RTOL) == ["step 2 is missing"]
    rows = _rows()
    del rows[2]["eval_loss"]
    rows[0]["mtp_loss"] = 1.0
    assert compare_rows(rows, reference).failures(FP32_RTOL) == [
        "step 1: mtp_loss is missing in the reference",
        "step 3: eval_loss is missing in the cell",
    ]
    extra = compare_rows([*reference, {**reference[-1], "step": 4}], reference)
    assert extra.failures(FP32_RTOL) == ["step 4 is not in the reference"]


def test_differences_near_zero_are_measured_against_the_floor():
    assert relative_difference(1e-9, 0.0) == pytest.approx(1e-6)
    assert relative_difference(None, None) == 0.0
    assert relative_difference(None, 1.0) == math.inf
    assert relative_difference({"a": 1}, {"b": 1}) == math.inf
    assert relative_difference({"a": 1.5}, {"a": 1.0}) == 0.5


def test_parameters_compare_tensor_by_tensor_by_norm():
    rng = np.random.default_rng(0)
    reference = {"w": rng.standard_normal((8, 4)).astype(np.float32), "b": np.zeros(3, np.float32)}
    close = {name: tensor.copy() for name, tensor in reference.items()}
    close["w"][2, 1] += 5e-6 * np.linalg.norm(reference["w"])
    comparison = compare_rows(_rows(), _rows())
    compare_params(close, reference, comparison)
    assert comparison.failures(FP32_RTOL) == [] and comparison.worst_tensor == "w"
    far = {**close, "w": reference["w"] * (1 + 1e-4)}
    compare_params(far, reference, comparison)
    assert comparison.failures(FP32_RTOL)[0].startswith("parameter w differs by 1.00e-04")
    assert comparison.failures(FP32_RTOL, params_rtol=2e-4) == []
    lost = compare_rows(_rows(), _rows())
    compare_params({"w": reference["w"]}, reference, lost)
    assert lost.failures(FP32_RTOL) == ["parameter b is missing in the cell"]
    assert tensor_difference(np.ones(4), np.zeros(4)) == pytest.approx(2e6)  # zeros: the floor
    assert tensor_difference(np.zeros(0), np.zeros(0)) == 0.0


def test_a_refused_launch_reads_as_refused_and_a_crash_as_failed():
    refused = run_end(2, "error: parallel.ep=3 must divide the data-parallel size 2\n")
    assert (refused.status, refused.reason) == (
        "refused",
        "parallel.ep=3 must divide the data-parallel size 2",
    )
    crash = run_end(1, "Traceback ...\nRuntimeError: gloo lost a peer\n  during step 3\n")
    assert (crash.status, crash.reason) == ("fail", "exit 1: RuntimeError: gloo lost a peer")
    ranks = (
        "[rank1]: Traceback (most recent call last):\n"
        "[rank1]: AttributeError: 'tuple' object has no attribute 'contiguous'\n"
        "error: another rank was lost: Connection closed by peer\n"
        "error: rank 1 exited with code 1; see its output above\n"
    )
    assert (
        run_end(1, ranks).reason
        == "exit 1: AttributeError: 'tuple' object has no attribute 'contiguous'"
    )
    assert run_end(2, "something else\n").status == "fail"
    assert run_end(0, "warnings\n").status == "ok"


def test_the_card_shows_each_cell_ran_and_why_one_did_not_pass(tmp_path):
    ok = {"feature": "plain", "layout": "dp2", "status": "ok", "metrics": {"loss": 2e-8}}
    refused = {"feature": "muon", "layout": "cp2", "status": "refused", "reason": "no muon here"}
    document = {"commit": "abc", "dirty": True, "steps": 4, "backend": "gloo"}
    document["cells"] = [{**ok, "params": 3e-6}, {**refused, "metrics": {}, "params": None}]
    text = card(document, ["plain", "muon"], ["dp2", "cp2"])
    assert "Ran on commit `abc` with uncommitted changes: 2 of 4 cells" in text
    assert "| plain | ok 3e-06 | · |" in text and "| muon | · | refused |" in text
    assert "- muon on cp2 (refused): no muon here" in text
    low = {"feature": "bf16_distopt", "layout": "dp2", "status": "ok", "params": 1e-2}
    low |= {"metrics": {"loss": 3e-4, "grad_norm": 5e-4}, "rtol": 2e-3, "params_rtol": 5e-2}
    fp32 = {**ok, "layout": "ep2", "metrics": {"loss": 5e-8, "grad_norm": 1e-7}, "params": 2e-6}
    fp32 |= {"rtol": 1e-5, "params_rtol": 1e-5}
    table = card({**document, "cells": [*document["cells"], low, fp32]}, ["plain"], ["dp2"])
    assert "| fp32 features | 2 | 5.0e-08 | 1.0e-07 | 3.0e-06 | 1e-05 / 1e-05 |" in table
    assert "| bf16_distopt | 1 | 3.0e-04 | 5.0e-04 | 1.0e-02 | 2e-03 / 5e-02 |" in table
    assert (
        cell_mark({"status": "fail", "metrics": {"loss": 1.0}, "params": None}) == "**FAIL** 1e+00"
    )
    later = {**document, "dirty": False, "cells": [{**ok, "metrics": {}, "params": 1e-7}]}
    both = merged([document, later])
    assert both["dirty"] and [c["params"] for c in both["cells"]] == [1e-7, None]
    with pytest.raises(ValueError, match="other commits, steps, backends or seeds: abc"):
        merged([document, {**later, "commit": "def"}])
    with pytest.raises(ValueError, match=r"abc \(4 steps, gloo, seed 1\)"):
        merged([document, {**later, "seed": 1}])
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nText.\n")
    write_card(page, "first")
    write_card(page, "second")
    assert page.read_text().count("second") == 1 and "first" not in page.read_text()
    assert page.read_text().startswith("# Title\n\nText.\n")


def _seed_document(seed: int, worst: dict[str, tuple[float, float]]) -> dict:
    """A --json document of one seed: for each layout, a bf16 cell's worst metric (on
    grad_norm) and parameter difference; an fp32 cell and a refused bf16 cell besides."""
    cells = [
        {"feature": "bf16_distopt", "layout": layout, "status": "ok", "params": params}
        | {"metrics": {"loss": metric / 10, "grad_norm": metric, "mtp_loss": None}}
        for layout, (metric, params) in worst.items()
    ]
    cells.append({"feature": "plain", "layout": "dp2", "status": "ok", "metrics": {"loss": 1.0}})
    refused = {"feature": "bf16_distopt", "layout": "cp2", "status": "refused", "params": None}
    cells.append(refused | {"metrics": {}})
    return {"commit": "abc", "steps": 4, "backend": "gloo", "seed": seed, "cells": cells}


def test_the_tolerance_of_a_low_precision_feature_is_a_margin_over_its_worst_seed(tmp_path, capsys):
    assert [round_up(v) for v in (0.9e-4, 1e-4, 1.01e-4, 3e-4, 7e-3)] == [
        1e-4,
        1e-4,
        2e-4,
        5e-4,
        1e-2,
    ]
    assert tolerance_of(1.8e-4) == 5e-4 and tolerance_of(2.4e-3) == 5e-3
    seed0 = _seed_document(0, {"dp2": (1e-4, 1e-2), "ep2": (3e-4, 2e-2)})
    seed1 = _seed_document(1, {"dp2": (6e-4, 4e-3), "ep2": (2e-4, 3e-2)})
    (row,) = spread([seed1, seed0], ["bf16_distopt", "fp8_rowwise"])
    assert row["seeds"] == {
        0: {"metrics": 3e-4, "params": 2e-2, "cells": 2},
        1: {"metrics": 6e-4, "params": 3e-2, "cells": 2},
    }
    assert (row["rtol"], row["params_rtol"]) == (2e-3, 1e-1)
    with pytest.raises(ValueError, match="two --json files ran seed 0"):
        spread([seed0, seed0], ["bf16_distopt"])
    with pytest.raises(ValueError, match="other commits"):
        spread([seed0, {**seed1, "steps": 2}], ["bf16_distopt"])
    files = [tmp_path / "s0.json", tmp_path / "s1.json"]
    for file, document in zip(files, (seed0, seed1), strict=True):
        file.write_text(json.dumps(document))
    out = tmp_path / "spread.json"
    assert invariance.main(["--spread", *map(str, files), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["feature", "cells", "seed", "0", "seed", "1", "worst", "tolerance"]
    metrics_row = ["bf16_distopt", "metrics", "2", "3.0e-04", "6.0e-04", "6.0e-04", "2e-03"]
    assert lines[2].split() == metrics_row
    assert json.loads(out.read_text())["features"][0]["params_rtol"] == 1e-1
    files[1].write_text("{}")
    assert invariance.main(["--spread", *map(str, files)]) == 2
    assert capsys.readouterr().err.startswith("error: --spread: ")


def test_a_cell_fails_unless_exactly_one_rank_reports_the_end(tmp_path):
    for run in ("cell", "single"):
        (tmp_path / run).mkdir()
        lines = [json.dumps(row) for row in _rows()]
        (tmp_path / run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    reference = RunEnd("ok", reports=1)
    feature = FEATURES["plain"]

    def result(reports: int) -> dict:
        end = RunEnd("ok", reports=reports)
        return invariance.cell_result(
            end, tmp_path / "cell", reference, tmp_path / "single", feature
        )

    assert result(1)["status"] == "ok" and result(1)["metrics"]["loss"] == 0.0
    assert (result(2)["status"], result(2)["reason"]) == (
        "fail",
        "2 ranks reported the end of the run (one should)",
    )
    assert result(0)["status"] == "fail"
    crashed = invariance.cell_result(
        RunEnd("ok", reports=1),
        tmp_path / "cell",
        RunEnd("fail", "exit 1: boom"),
        tmp_path,
        feature,
    )
    assert (crashed["status"], crashed["reason"]) == ("fail", "the single process: exit 1: boom")


@pytest.mark.slow
def test_the_ci_subset_passes_with_the_real_trainer(tmp_path, capsys):
    """`benchmarks/invariance.py` without options: every cell of `CI_CELLS` (every feature and
    every layout at least once) trains with `moe-train train --nproc-per-node N` and equals
    its single process within its tolerance at every step and in its final parameters."""
    out = tmp_path / "matrix.json"
    code = invariance.main(["--json", str(out)])
    cells = json.loads(out.read_text())["cells"]
    assert [(c["feature"], c["layout"]) for c in cells] == list(CI_CELLS)
    not_ok = [(c["feature"], c["layout"], c["reason"]) for c in cells if c["status"] != "ok"]
    assert (code, not_ok) == (0, [])
    assert all(c["metrics"]["eval_loss"] is not None and c["params"] is not None for c in cells)
    assert any(c["metrics"]["mtp_loss"] is not None for c in cells)
    table_rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["plain", "dp2", "2", "ok"] in [row[:4] for row in table_rows]
