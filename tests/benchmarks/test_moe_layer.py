"""benchmarks/moe_layer.py runs end to end at tiny sizes: each stage of the MoE layer timed
alone (the unpermute stage rebuilds the dispatch handle around a leaf weight) and the
expert-scaling table, written to its JSON."""

from __future__ import annotations

import json
import sys

import pytest

import moe_layer


def test_the_layer_stages_and_the_scaling_table_run_and_are_written(tmp_path, monkeypatch):
    out = tmp_path / "moe_layer.json"
    tiny = ["--tokens", "64", "--d-model", "16", "--experts", "4", "--expert-hidden", "16"]
    scaling = ["--scaling-experts", "4", "8", "--scaling-expert-hidden", "8"]
    runs = ["--dtypes", "float32", "--scaling-dtype", "float32", "--reps", "1", "--warmup", "0"]
    monkeypatch.setattr(sys, "argv", ["moe_layer.py", *tiny, *scaling, *runs, "--out", str(out)])
    moe_layer.main()
    document = json.loads(out.read_text())
    (layer,) = document["layer"]
    assert set(layer["stages_ms"]) == {"router", "permute", "grouped GEMMs", "unpermute"}
    assert all(ms > 0 for ms in layer["stages_ms"].values())
    assert [row["experts"] for row in document["scaling"]] == [4, 8]
    for row in document["scaling"]:
        assert row["router_gemm_ms"] > 0
        outside = row["router_scores_ms"] + row["permutation_ms"]
        assert row["outside_gemms_ms"] == pytest.approx(outside)
    assert document["scaling"][0]["outside_gemms_vs_first"] == 1.0
