"""Trackers: metrics rows to TensorBoard and W&B, read back with their own readers; the
one-line errors for a missing extra or a bad project name; W&B resume by a stored run id."""

import json
import random
import struct
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from moe_train.cli import main
from moe_train.errors import ConfigError, MoeTrainError
from moe_train.train import read_metrics, train
from moe_train.train.tracking import (
    TENSORBOARD_DIR,
    WANDB_RUN_ID_FILE,
    Trackers,
    check_tracking_available,
    scalars,
)

CONFIG = {"model": {"d_model": 64, "moe": {"num_experts": 4}}, "optim": {"lr": 3e-4}}


def random_rows(steps, rng: random.Random) -> list[dict]:
    """Metrics-like rows with fresh values, some null, plus values that are not scalars."""
    rows = []
    for step in steps:
        rows.append(
            {
                "step": step,
                "time": 1.8e9 + step,
                "loss": rng.uniform(1, 10),
                "lr": rng.uniform(1e-5, 1e-3),
                "grad_norm": None if step % 3 == 1 else rng.uniform(0, 5),
                "skipped_steps": rng.randrange(10),
                "load": [[1, 2], [3, 4]],
                "note": "text",
            }
        )
    return rows


def expected_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """By key, the (step, value) pairs a tracker should hold: numbers only, "step" excluded."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, int | float):
                series.setdefault(key, []).append((row["step"], value))
    return series


def test_scalars_keep_numbers_only():
    row = {
        "step": 7,
        "time": 1.8e9,
        "loss": 2.5,
        "skipped_steps": 3,
        "mfu": np.float32(0.25),
        "tokens_seen": np.int64(1 << 40),
        "grad_norm": None,
        "stopped": True,
        "note": "x",
        "load": [1, 2],
        "nested": {"a": 1.0},
    }
    values = scalars(row)
    assert values == {"loss": 2.5, "skipped_steps": 3, "mfu": 0.25, "tokens_seen": 1 << 40}
    assert type(values["mfu"]) is float and type(values["tokens_seen"]) is int


# ---- TensorBoard ------------------------------------------------------------------------


def read_tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in log_dir, read by TensorBoard's own reader."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def as_float32(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard stores scalars as float32."""
    return {k: [(s, float(np.float32(v))) for s, v in pairs] for k, pairs in series.items()}


def test_tensorboard_holds_every_row_by_step(tmp_path):
    pytest.importorskip("tensorboard")
    rows = random_rows(range(1, 7), random.Random(1))
    trackers = Trackers.open(tmp_path, CONFIG, tensorboard=True, wandb_project=None)
    for row in rows:
        trackers.log(row)
    trackers.close()
    trackers.close()  # a second close does nothing

    got = read_tensorboard(tmp_path / TENSORBOARD_DIR)
    want = as_float32(expected_series(rows))
    assert set(got) == {"loss", "lr", "grad_norm", "skipped_steps"}
    assert got == want
    assert [step for step, _ in got["grad_norm"]] == [2, 3, 5, 6]  # null values left out


def test_tensorboard_resume_replaces_the_steps_it_rewrites(tmp_path):
    pytest.importorskip("tensorboard")
    rng = random.Random(2)
    # Steps 1-6 written, then a resume from step 3 writes steps 4-8 again.
    first_rows, second_rows = random_rows(range(1, 7), rng), random_rows(range(4, 9), rng)
    trackers = Trackers.open(tmp_path, CONFIG, tensorboard=True, wandb_project=None)
    for row in first_rows:
        trackers.log(row)
    trackers.close()
    # Event files are read in name order, and the name starts with the second it was made in.
    time.sleep(1.05 - time.time() % 1)
    resumed = Trackers.open(
        tmp_path, CONFIG, tensorboard=True, wandb_project=None, resumed_from_step=3
    )
    for row in second_rows:
        resumed.log(row)
    resumed.close()

    got = read_tensorboard(tmp_path / TENSORBOARD_DIR)
    assert got == as_float32(expected_series(first_rows[:3] + second_rows))


def test_missing_tensorboard_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # makes any import of it fail
    expected = "train.tensorboard=true needs the tensorboard package: pip install 'moestack-train[tensorboard]'"
    with pytest.raises(ConfigError) as e:
        check_tracking_available(tensorboard=True, wandb_project=None)
    assert str(e.value) == expected
    with pytest.raises(ConfigError, match=r"^train\.tensorboard=true needs the tensorboard"):
        Trackers.open(tmp_path, CONFIG, tensorboard=True, wandb_project=None)
    assert not any(tmp_path.iterdir())
    check_tracking_available(tensorboard=False, wandb_project=None)  # not asked for: no error


# ---- W&B ----------------------------------------------------------------------------------


def test_missing_wandb_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError) as e:
        check_tracking_available(tensorboard=False, wandb_project="moe")
    assert str(e.value) == (
        "train.wandb_project=moe needs the wandb package: pip install 'moestack-train[wandb]'"
    )
    with pytest.raises(ConfigError, match=r"^train\.wandb_project=moe needs the wandb package"):
        Trackers.open(tmp_path, CONFIG, tensorboard=False, wandb_project="moe")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        (" ", "is empty"),
        ("team/moe", "holds /"),
        ("a:b#", "holds # :"),
        ("x" * 129, "has 129 characters"),
    ],
)
def test_bad_wandb_project_name_is_refused_at_start_up(name, problem, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # the name is checked first
    with pytest.raises(ConfigError) as e:
        check_tracking_available(tensorboard=False, wandb_project=name)
    message = str(e.value)
    assert message.startswith(f"train.wandb_project={name!r} {problem}: a W&B project name")
    assert "\n" not in message


class FakeRunConfig(dict):
    def update(self, values: dict, *, allow_val_change: bool) -> None:
        assert allow_val_change
        super().update(values)


class FakeRun:
    def __init__(self, starting_step: int) -> None:
        self.starting_step = starting_step
        self.resumed = starting_step > 0
        self.config = FakeRunConfig()
        self.logged: list[tuple[dict, int]] = []
        self.exit_code: int | None = None

    def log(self, values: dict, *, step: int) -> None:
        self.logged.append((values, step))

    def finish(self, *, exit_code: int) -> None:
        self.exit_code = exit_code


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in wandb module that records each init's arguments and returns FakeRuns; its
    `starting_step` is what W&B reports for a resumed run (the step after its last)."""
    module = types.ModuleType("wandb")
    module.inits, module.runs, module.starting_step = [], [], 0
    module.errors = types.SimpleNamespace(Error=type("Error", (Exception,), {}))

    def init(**kwargs):
        module.inits.append(kwargs)
        module.runs.append(FakeRun(module.starting_step))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_run_gets_config_name_dir_and_every_row_at_its_step(tmp_path, fake_wandb):
    run_dir = tmp_path / "run.2"
    run_dir.mkdir()
    rows = random_rows(range(1, 5), random.Random(3))
    trackers = Trackers.open(run_dir, CONFIG, tensorboard=False, wandb_project="moe")
    for row in rows:
        trackers.log(row)
    trackers.close()

    (init,) = fake_wandb.inits
    run_id = (run_dir / WANDB_RUN_ID_FILE).read_text().strip()
    assert init == {
        "project": "moe",
        "name": "run.2",
        "id": run_id,
        "resume": "allow",
        "dir": str(run_dir),
        "config": CONFIG,
    }
    run = fake_wandb.runs[0]
    assert run.logged == [(scalars(row), row["step"]) for row in rows]
    assert all(None not in values.values() for values, _ in run.logged)
    assert run.exit_code == 0


def test_wandb_resume_continues_the_stored_run_and_a_new_start_makes_a_new_one(
    tmp_path, fake_wandb
):
    Trackers.open(tmp_path, CONFIG, tensorboard=False, wandb_project="moe").close()
    first_id = fake_wandb.inits[0]["id"]

    # W&B's run holds steps up to 5; this resume starts from 3: steps 4 and 5 are not resent.
    fake_wandb.starting_step = 6
    resumed = Trackers.open(
        tmp_path, CONFIG, tensorboard=False, wandb_project="moe", resumed_from_step=3
    )
    rows = random_rows(range(4, 9), random.Random(4))
    for row in rows:
        resumed.log(row)
    resumed.close(failed=True)
    assert fake_wandb.inits[1]["id"] == first_id
    assert fake_wandb.runs[0].config == {}  # a new run: the config went with init
    assert fake_wandb.runs[1].config == CONFIG  # a resumed one: set again over the stored one
    assert [step for _, step in fake_wandb.runs[1].logged] == [6, 7, 8]
    assert fake_wandb.runs[1].exit_code == 1

    fake_wandb.starting_step = 0
    Trackers.open(tmp_path, CONFIG, tensorboard=False, wandb_project="moe").close()
    new_id = fake_wandb.inits[2]["id"]
    assert new_id != first_id
    assert (tmp_path / WANDB_RUN_ID_FILE).read_text().strip() == new_id


def test_wandb_start_failure_is_one_line(tmp_path, fake_wandb):
    def init(**kwargs):
        raise fake_wandb.errors.Error("api_key not configured (no-tty).\n call wandb.login()")

    fake_wandb.init = init
    with pytest.raises(MoeTrainError, match=r"^train\.wandb_project=moe: W&B could not start") as e:
        Trackers.open(tmp_path, CONFIG, tensorboard=False, wandb_project="moe")
    assert "\n" not in str(e.value) and "WANDB_MODE=offline" in str(e.value)


def read_wandb_log(path: Path):
    """The records of a .wandb file (W&B's transaction log: LevelDB's log format, 32 KiB
    blocks of chunks, behind a 7-byte header), as W&B's protobuf Records, up to the first
    incomplete one."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"unknown .wandb header {data[:7]}"
    block, header, pos, parts = 32768, 7, 7, b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        if pos + header + length > len(data):  # still being written
            return
        parts += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_offline_runs(run_dir: Path, count: int, timeout_s: float = 60.0) -> list[tuple]:
    """(run record, config, {key: [(step, value)]}, exit code) of the `count` offline runs W&B
    wrote under run_dir/wandb, oldest first. W&B's service may still be writing a file when
    `finish` returns: each is read again until it holds its exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [read_wandb_run(path) for path in run_dir.glob("wandb/offline-run-*/run-*.wandb")]
        if len(runs) == count and all(exit_code is not None for *_, exit_code in runs):
            return sorted(runs, key=lambda r: (r[0].start_time.seconds, r[0].start_time.nanos))
        if time.monotonic() > deadline:
            raise AssertionError(f"W&B wrote {len(runs)} complete offline runs, not {count}")
        time.sleep(0.1)


def read_wandb_run(path: Path) -> tuple:
    run, exit_code, series = None, None, {}
    for record in read_wandb_log(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "exit":
            exit_code = record.exit.exit_code
        elif kind == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    series.setdefault(key, []).append((step, json.loads(item.value_json)))
    if run is None:  # not written yet
        return None, {}, {}, None
    config = {
        u.key or "/".join(u.nested_key): json.loads(u.value_json)
        for u in run.config.update
        if not (u.key or "/".join(u.nested_key)).startswith("_")
    }
    return run, config, series, exit_code


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    home = tmp_path / "wandb_home"
    home.mkdir()
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": home,
        "WANDB_CONFIG_DIR": home / "config",
        "WANDB_CACHE_DIR": home / "cache",
        "WANDB_DATA_DIR": home / "data",
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
    }.items():
        monkeypatch.setenv(name, str(value))


def test_wandb_offline_run_holds_config_and_every_row(tmp_path, wandb_offline):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rng = random.Random(5)
    first_rows, second_rows = random_rows(range(1, 6), rng), random_rows(range(4, 8), rng)
    trackers = Trackers.open(run_dir, CONFIG, tensorboard=False, wandb_project="moe-test")
    for row in first_rows:
        trackers.log(row)
    trackers.close()
    run_id = (run_dir / WANDB_RUN_ID_FILE).read_text().strip()

    ((run, config, series, exit_code),) = wandb_offline_runs(run_dir, 1)
    assert (run.run_id, run.project, run.display_name) == (run_id, "moe-test", "run")
    assert config == CONFIG
    assert series == expected_series(first_rows)
    assert exit_code == 0

    # A resume writes a second offline run under the same id (`wandb sync` joins them).
    resumed = Trackers.open(
        run_dir, CONFIG, tensorboard=False, wandb_project="moe-test", resumed_from_step=3
    )
    for row in second_rows:
        resumed.log(row)
    resumed.close()
    _, (run, _, series, exit_code) = wandb_offline_runs(run_dir, 2)
    assert run.run_id == run_id
    assert series == expected_series(second_rows)
    assert exit_code == 0


# ---- wired into training ------------------------------------------------------------------


def metrics_series(run_dir: Path, *, float32: bool) -> dict[str, list[tuple[int, float]]]:
    """By key, the (step, value) pairs of the run's metrics.jsonl that a tracker gets."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in read_metrics(run_dir / "metrics.jsonl"):
        for key, value in scalars(row).items():
            value = float(np.float32(value)) if float32 else value
            series.setdefault(key, []).append((row["step"], value))
    return series


def test_training_writes_every_metrics_row_to_tensorboard(tmp_path, make_config):
    pytest.importorskip("tensorboard")
    result = train(make_config(tmp_path, train={"tensorboard": True}))
    got = read_tensorboard(result.run_dir / TENSORBOARD_DIR)
    assert got == metrics_series(result.run_dir, float32=True)
    assert [step for step, _ in got["loss"]] == list(range(1, 7))


def test_training_logs_to_wandb_and_a_resume_continues_the_same_run(
    tmp_path, make_config, wandb_offline
):
    auto = {"resume": "auto", "interval": 3}
    wandb = {"wandb_project": "moe-test"}
    first = train(make_config(tmp_path, train={**wandb, "max_steps": 3}, checkpoint=auto))
    run_id = (first.run_dir / WANDB_RUN_ID_FILE).read_text().strip()
    second = train(make_config(tmp_path, train=wandb, checkpoint=auto))
    assert second.run_dir == first.run_dir and second.start_step == 3

    runs = wandb_offline_runs(first.run_dir, 2)
    assert [(run.run_id, run.display_name) for run, *_ in runs] == [(run_id, "run")] * 2
    assert [config["train"]["max_steps"] for _, config, _, _ in runs] == [3, 6]
    assert [exit_code for *_, exit_code in runs] == [0, 0]
    joined: dict[str, list[tuple[int, float]]] = {}
    for _, _, series, _ in runs:
        for key, pairs in series.items():
            joined.setdefault(key, []).extend(pairs)
    assert joined == metrics_series(first.run_dir, float32=False)


def test_missing_tensorboard_stops_training_before_anything_is_written(
    tmp_path, make_config, monkeypatch
):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"^train\.tensorboard=true needs the tensorboard"):
        train(make_config(tmp_path, train={"tensorboard": True}))
    assert not (tmp_path / "run").exists()


def test_missing_wandb_is_one_cli_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    tiny = Path(__file__).parents[2] / "configs" / "tiny.yaml"
    run_dir = tmp_path / "r"
    code = main(["train", str(tiny), f"--train.run_dir={run_dir}", "--train.wandb_project=moe"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "error: train.wandb_project=moe needs the wandb package: pip install 'moestack-train[wandb]'"
    )
    assert not run_dir.exists()
