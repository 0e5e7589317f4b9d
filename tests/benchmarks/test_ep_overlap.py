"""benchmarks/ep_overlap.py runs end to end at tiny sizes on 4 gloo ranks: every dispatcher's
layer in the three modes, with the waits the exchange thread counted, written to its JSON."""

from __future__ import annotations

import json

import ep_overlap


def test_every_dispatcher_is_timed_in_each_mode_and_written(tmp_path):
    out = tmp_path / "ep_overlap.json"
    assert (
        ep_overlap.main(["--tokens", "64", "--d-model", "16", "--reps", "1", "--json", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())
    assert [(r["dispatcher"], r["transport"]) for r in rows] == [
        ("all_to_all", None),
        ("all_to_all_dedup", None),
        ("rowwise", "symmetric_memory"),
        ("rowwise", "all_to_all"),
    ]
    for row in rows:
        assert set(row["layer_ms"]) == set(row["wait_ms"]) == {"plain", "exposed", "overlapped"}
        assert row["wait_ms"]["plain"] == 0  # no exchange thread: nothing counted
        assert row["wait_ms"]["exposed"] > 0 and row["wait_ms"]["overlapped"] > 0
        assert row["wait_ratio"] == row["wait_ms"]["overlapped"] / row["wait_ms"]["exposed"]
