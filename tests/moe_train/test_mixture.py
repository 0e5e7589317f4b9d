"""data.mixture: sources mixed by token share, the same batches on resume, counts per source."""

import json

import numpy as np
import pytest

from moe_data import MixedDataset, MixtureSource
from moe_data.mixture import positions_in_order, samples_before
from moe_plan.config import config_from_dict
from moe_train.cli import main
from moe_train.errors import ConfigError
from moe_train.train import read_metrics, train
from moe_train.train.data_feed import TokenCounts
from training import save_config, small_config_data

# Each source holds ids from its own range, so a row's tokens tell which source it came from.
RANGES = {"web": (0, 60), "code": (60, 120), "books": (120, 180)}
SIZES = {"web": 9000, "code": 4000, "books": 1500}
WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


@pytest.fixture
def sources(tmp_path):
    """One .npy token file per source, of different lengths (books wraps many epochs)."""
    rng = np.random.default_rng(7)
    paths = {}
    for name, (low, high) in RANGES.items():
        paths[name] = tmp_path / f"{name}.npy"
        np.save(paths[name], rng.integers(low, high, SIZES[name]).astype(np.uint16))
    return paths


def mixture_entries(paths, weights=WEIGHTS):
    return [{"paths": [str(paths[n])], "weight": w, "name": n} for n, w in weights.items()]


def mixture_config(tmp_path, paths, run, **sections):
    data = small_config_data(tmp_path / run, paths["web"], **sections)
    data["data"].pop("paths")
    data["data"]["mixture"] = mixture_entries(paths)
    return data


def source_of_row(row):
    for name, (low, high) in RANGES.items():
        if low <= row.min() and row.max() < high:
            return name
    raise AssertionError(f"a row mixes sources: ids {row.min()}..{row.max()}")


def test_divisor_sequence_matches_a_brute_force_merge():
    rng = np.random.default_rng(0)
    for _ in range(50):
        weights = rng.random(rng.integers(1, 6)) + 0.01
        weights /= weights.sum()
        keys = sorted(((k + 0.5) / w, s) for s, w in enumerate(weights) for k in range(300))
        owners = [s for _, s in keys]
        for n in [*range(40), 111, 250]:
            expected = np.bincount(owners[:n], minlength=len(weights))
            assert samples_before(n, weights).tolist() == expected.tolist(), (weights, n)
        assert positions_in_order(17, 93, weights)[0].tolist() == owners[17:93]


@pytest.mark.slow
def test_a_mixture_run_takes_each_source_s_share_of_tokens(tmp_path, sources, capsys):
    """Through the CLI from a YAML file; the shares are measured from the batches' tokens."""
    data = mixture_config(
        tmp_path,
        sources,
        "run",
        data={"global_batch_size": 16, "micro_batch_size": 8},
        train={"max_steps": 10, "log_interval": 5},
    )
    config_file = tmp_path / "mix.yaml"
    save_config(config_file, data)
    assert main(["train", str(config_file)]) == 0, capsys.readouterr().err
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    config = config_from_dict(data)
    dataset = MixedDataset([MixtureSource(n, [str(sources[n])], w) for n, w in WEIGHTS.items()], 32)
    measured = dict.fromkeys(RANGES, 0)
    for step in range(10):
        for sequence in dataset.batch(step, 16, config.train.seed).numpy():
            measured[source_of_row(sequence)] += 32
    total = 10 * 16 * 32
    assert sum(measured.values()) == total
    for name, weight in WEIGHTS.items():
        assert abs(measured[name] / total - weight) < 0.01, (name, measured)
    assert rows[-1]["tokens_per_source"] == measured
    assert [r["step"] for r in rows] == [5, 10]
    first_five = [s for step in range(5) for s in dataset.batch(step, 16, config.train.seed)]
    assert rows[0]["tokens_per_source"] == {
        name: sum(source_of_row(s) == name for s in first_five) * 32 for name in RANGES
    }
    state = json.loads(
        next((tmp_path / "run" / "checkpoints").glob("step_*/trainer_state.json")).read_text()
    )
    assert state["tokens_per_source"] == {str(sources[n]): measured[n] for n in RANGES}
    assert "web (weight 0.5), code (weight 0.3), books (weight 0.2)" in capsys.readouterr().err


@pytest.mark.slow
def test_a_resumed_mixture_run_equals_an_uninterrupted_one(tmp_path, sources):
    steps = {"max_steps": 8}
    whole = train(config_from_dict(mixture_config(tmp_path, sources, "a", train=steps)))
    first = train(
        config_from_dict(
            mixture_config(tmp_path, sources, "b", train=steps, checkpoint={"interval": 3})
        )
    )
    step3 = first.run_dir / "checkpoints" / "step_00000003"
    resumed_config = mixture_config(
        tmp_path, sources, "c", train=steps, checkpoint={"resume": str(step3)}
    )
    resumed = train(config_from_dict(resumed_config))
    assert resumed.losses == whole.losses[3:]
    final = [read_metrics(r.run_dir / "metrics.jsonl")[-1] for r in (whole, resumed)]
    assert final[0]["tokens_per_source"] == final[1]["tokens_per_source"]
    # Without the saved counts (a checkpoint of an earlier release) they are counted again.
    saved = json.loads((step3 / "trainer_state.json").read_text())["tokens_per_source"]
    config = config_from_dict(resumed_config)
    dataset = MixedDataset([MixtureSource(n, [str(sources[n])], w) for n, w in WEIGHTS.items()], 32)
    recounted = TokenCounts.before(dataset, config, 3, None)
    assert recounted.for_checkpoint() == saved
    assert sum(saved.values()) == 3 * 8 * 32
    for step in range(3, 8):
        recounted.add(dataset.tokens_per_source(step, 8, config.train.seed))
    assert recounted.for_metrics() == final[0]["tokens_per_source"]


def test_rows_read_only_the_asked_part_of_a_batch(sources):
    dataset = MixedDataset([MixtureSource(n, [str(sources[n])], w) for n, w in WEIGHTS.items()], 32)
    for step in (0, 7, 400):
        whole = dataset.batch(step, 16, seed=3)
        assert dataset.rows(step, 16, 3, 4, 12).equal(whole[4:12])
        assert not whole.equal(dataset.batch(step, 16, seed=4))


def test_a_mixture_names_each_source_s_share_once_whatever_its_paths(sources):
    two_paths = MixtureSource("web+code", [str(sources["web"]), str(sources["code"])], 3)
    dataset = MixedDataset([two_paths, MixtureSource("books", [str(sources["books"])], 1)], 32)
    assert repr(dataset) == "MixedDataset({web+code: 0.75, books: 0.25}, seq_len=32)"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight": None}, "data.mixture[1].weight is missing"),
        ({"weight": -1}, "data.mixture[1].weight=-1.0 must be a positive number"),
        ({"paths": []}, "data.mixture[1].paths is empty"),
        ({"name": "web"}, "data.mixture names the source 'web' twice"),
        ({"paths": "WEB"}, "lists"),
        ({"wieght": 1}, "unknown config key data.mixture[1].wieght; did you mean"),
        ({"paths": ["x.npy:float3"]}, "data.mixture[1].paths[0]='x.npy:float3'"),
    ],
)
def test_bad_mixtures_are_one_line(tmp_path, sources, change, message):
    entries = mixture_entries(sources)
    entries[1].update(change)
    if change.get("paths") == "WEB":
        entries[1]["paths"] = [str(sources["web"])]
    data = small_config_data(tmp_path / "r", sources["web"])
    data["data"] = {"mixture": entries}
    with pytest.raises(ConfigError) as error:
        config_from_dict(data)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_paths_and_a_mixture_together_are_refused_through_the_cli(tmp_path, sources, capsys):
    data = mixture_config(tmp_path, sources, "r")
    config_file = tmp_path / "mix.yaml"
    save_config(config_file, data)
    assert main(["train", str(config_file), f"--data.paths=[{sources['web']}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data.paths=") and "are both set" in err
    assert len(err.splitlines()) == 1
