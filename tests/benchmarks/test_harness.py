"""benchmarks/harness: the table, the JSON files, the interleaved timing loop, the runs in
fresh processes and the seed-by-seed comparisons that the benchmarks share."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

from harness.output import print_table, write_json, write_whole
from harness.processes import json_from_fresh_process, run_python
from harness.seeds import gap_cells, median_ratio, run_seeds, seed_comparison
from harness.timing import interleaved_medians, interleaved_samples, median_seconds


def test_table_columns_fit_their_widest_cell_text_left_numbers_right(capsys):
    print_table(
        ("name", "n", "kind", "ms"),
        [["a", 1, "long kind", "2.50"], ["longer name", 12345, "x", ""]],
        left=["kind"],
    )
    assert capsys.readouterr().out.splitlines() == [
        "name             n  kind         ms",
        "-----------  -----  ---------  ----",
        "a                1  long kind  2.50",
        "longer name  12345  x",
    ]


def test_table_rules_only_the_title_of_a_left_aligned_last_column(capsys):
    print_table(("check", "figure"), [["a", "a long figure"]], left=["figure"])
    assert capsys.readouterr().out.splitlines()[1] == "-----  ------"


def test_table_refuses_a_row_with_another_number_of_cells():
    with pytest.raises(ValueError, match="3 cells for 2 columns"):
        print_table(("a", "b"), [[1, 2, 3]])


def test_interleaved_rounds_call_every_measure_once_per_round_and_drop_the_warmup():
    calls: list[str] = []

    def measure(name: str):
        def run() -> float:
            calls.append(name)
            return float(len(calls))  # the call's position: which round it belonged to

        return run

    samples = interleaved_samples({"a": measure("a"), "b": measure("b")}, warmup=2, reps=3)
    assert calls == ["a", "b"] * 5
    assert samples == {"a": [5.0, 7.0, 9.0], "b": [6.0, 8.0, 10.0]}


def test_interleaved_medians_are_the_medians_of_the_timed_rounds():
    values = {"x": iter([100.0, 3.0, 1.0, 2.0]), "y": iter([100.0, 5.0, 4.0, 9.0])}
    measures = {key: (lambda it=it: next(it)) for key, it in values.items()}
    assert interleaved_medians(measures, warmup=1, reps=3) == {"x": 2.0, "y": 5.0}


def test_median_seconds_times_the_step_by_the_timer_given():
    ticks = iter([9.0, 1.0, 3.0, 2.0])
    calls = []
    seconds = median_seconds(
        lambda: calls.append(1), 1, 3, timer=lambda step: (step(), next(ticks))[1]
    )
    assert (seconds, len(calls)) == (2.0, 4)


def test_json_is_written_whole_and_says_where(tmp_path, capsys):
    path = tmp_path / "new" / "result.json"
    write_json(path, {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert capsys.readouterr().out == f"wrote {path}\n"


def test_a_write_that_fails_leaves_the_old_file_and_no_partial_one(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("old")

    def failing(f) -> None:
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_whole(path, failing)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_a_fresh_process_hands_back_the_json_it_wrote(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "out = args[args.index('--out') + 1]\n"
        "open(out, 'w').write(json.dumps({'args': args[:-2], 'pid': os.getpid()}))\n"
    )
    result = json_from_fresh_process(script, "--row", "tiny")
    assert result["args"] == ["--row", "tiny"]
    assert result["pid"] != os.getpid()


def test_a_fresh_process_that_fails_raises(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(subprocess.CalledProcessError, match="exit status 3"):
        json_from_fresh_process(script)


def _run(name: str, seed: int, loss: float, speed: float = 1.0) -> dict:
    return {"run": name, "seed": seed, "final_loss": loss, "tokens_per_s": speed}


def test_seed_gaps_compare_each_seed_with_the_baseline_of_the_same_seed():
    runs = [  # out of order, and the variant's losses ranked unlike the baseline's
        _run("fp8", 1, 3.3, speed=30.0),
        _run("bf16", 0, 2.0, speed=10.0),
        _run("fp8", 0, 1.9, speed=5.0),
        _run("bf16", 1, 3.0, speed=20.0),
        _run("fp8", 2, 4.0, speed=4.0),
        _run("bf16", 2, 4.0, speed=2.0),
    ]
    row, pairs = seed_comparison(runs, "fp8", "bf16")
    assert row["run"] == "fp8" and row["seeds"] == [0, 1, 2]
    assert row["relative_loss_gaps"] == pytest.approx([-0.05, 0.1, 0.0])
    assert row["relative_loss_gap_mean"] == pytest.approx(0.05 / 3)
    assert row["final_loss_mean"] == pytest.approx(3.0666666666666664)
    assert [(mine["seed"], base["run"], base["seed"]) for mine, base in pairs] == [
        (0, "bf16", 0),
        (1, "bf16", 1),
        (2, "bf16", 2),
    ]
    assert median_ratio(pairs, "tokens_per_s") == pytest.approx(1.5)  # of 0.5, 1.5 and 2
    assert gap_cells(row, "bf16") == ("+1.67%", "-5.00% +10.00% +0.00%")
    baseline, _ = seed_comparison(runs, "bf16", "bf16")
    assert baseline["relative_loss_gaps"] == [0.0, 0.0, 0.0]
    assert gap_cells(baseline, "bf16") == ("+0.00%", "")


def test_seeded_runs_go_seed_by_seed_and_print_each_line_as_the_run_ends(capsys):
    order = []

    def run_one(name: str, seed: int, root) -> dict:
        assert root.is_dir()
        order.append((name, seed))
        print(f"training {name} {seed}")
        return _run(name, seed, float(seed))

    runs = run_seeds(["base", "new"], [3, 5], run_one, lambda run: f"{run['run']}@{run['seed']}")
    assert order == [("base", 3), ("new", 3), ("base", 5), ("new", 5)]
    assert [run["seed"] for run in runs] == [3, 3, 5, 5]
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == ["training base 3", "base@3", "training new 3", "new@3"]


def test_seeded_runs_with_jobs_overlap_and_come_back_seed_by_seed(capsys):
    both_started = threading.Barrier(2, timeout=30)  # run one after the other: it breaks

    def run_one(name: str, seed: int, root) -> dict:
        assert root.is_dir()
        if seed == 3:
            both_started.wait()
            if name == "base":  # the first submitted ends last
                time.sleep(0.2)
        return _run(name, seed, float(seed))

    runs = run_seeds(
        ["base", "new"], [3, 5], run_one, lambda run: f"{run['run']}@{run['seed']}", jobs=2
    )
    assert [(run["run"], run["seed"]) for run in runs] == [
        ("base", 3),
        ("new", 3),
        ("base", 5),
        ("new", 5),
    ]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "new@3" and sorted(lines) == ["base@3", "base@5", "new@3", "new@5"]


def test_a_fresh_process_runs_with_the_torch_threads_asked_for(tmp_path):
    # The suite runs with one thread per process (conftest) and torch caps at the cores.
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores to tell two threads from the suite's one")
    out = tmp_path / "threads.txt"
    script = "import sys, torch; open(sys.argv[1], 'w').write(str(torch.get_num_threads()))"
    run_python("-c", script, str(out), threads=2)
    assert out.read_text() == "2"
