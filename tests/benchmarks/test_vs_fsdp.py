"""benchmarks/vs_fsdp.py, run as users run it: both designs train as one process does, and the
collective counter counts what each design moves, call for call and byte for byte."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import vs_fsdp
from moe_parallel import is_expert_parameter
from moe_train.model import Transformer
from moe_train.train import read_metrics, train
from training import assert_losses_match
from vs_fsdp_variants import Variant

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
WORLD = 4
EXPERTS = 8
CAPACITY_FACTOR = 4.0
"""Rowwise capacity: 4 x the even share is every token of a micro-batch at top-2 of 8
experts, so nothing is dropped and rowwise computes what the dropless runs compute."""
STEPS = ["--warmup", "0", "--counted-steps", "3", "--timed-steps", "1"]
"""No warmup: the first counted step also runs DTensor's first (uncached) sharding propagation,
whose collectives the counter must see as well."""


@pytest.fixture(scope="module")
def bench():
    """The benchmark's module, benchmarks/vs_fsdp.py."""
    return vs_fsdp


def _fsdp_config(setup):
    """The benchmark's config of its FSDP run: every expert local (ep=1), as one process runs."""
    fsdp = Variant("fsdp", "local")
    return setup.config(fsdp, EXPERTS)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    text = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 800).encode()
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.frombuffer(text, dtype=np.uint8).astype(np.uint16)[:20000])
    return path


def _cli_args(token_file: Path, out: Path) -> list[str]:
    return [
        "--quick",
        "--experts",
        str(EXPERTS),
        "--dtype",
        "float32",
        "--routing",
        "learned",
        *STEPS,
        "--capacity-factor",
        str(CAPACITY_FACTOR),
        "--data",
        str(token_file),
        "--json",
        str(out / "vs_fsdp.json"),
        "--plot",
        str(out / "vs_fsdp.png"),
    ]


@pytest.fixture(scope="module")
def run(bench, token_file, tmp_path_factory):
    """The benchmark's command line, fp32, one expert count, the router's own (deterministic)
    routing: (its JSON, its setup, out dir)."""
    out = tmp_path_factory.mktemp("out")
    args = _cli_args(token_file, out)
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "vs_fsdp.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all-gather" in result.stdout, result.stdout
    document = json.loads((out / "vs_fsdp.json").read_text())
    return document, bench.make_setup(bench.parse_args(args)), out


def _rows(document: dict) -> dict[str, dict]:
    rows = {r["variant"]: r for r in document["rows"] if r["experts"] == EXPERTS}
    assert set(rows) == {
        "ep/all_to_all",
        "ep/all_to_all/dist-opt",
        "ep/rowwise",
        "ep/rowwise/dist-opt",
        "fsdp",
    }
    return rows


@pytest.mark.slow
def test_both_designs_match_one_process(run, tmp_path):
    """Every variant's losses and gradient norms are the single-process trainer's."""
    document, setup, _ = run
    config = _fsdp_config(setup)
    config.train.run_dir = str(tmp_path / "one_process")
    config.checkpoint.interval, config.checkpoint.interval_minutes = 0, 0.0
    single = train(config)
    records = read_metrics(single.run_dir / "metrics.jsonl")
    grad_norms = [r["grad_norm"] for r in records]
    counted_steps = setup.warmup_steps + setup.counted_steps
    timed_steps = setup.warmup_steps + setup.timed_steps
    assert len(single.losses) == max(counted_steps, timed_steps)
    for name, row in _rows(document).items():
        counted = row["counted_run"]
        assert_losses_match(name, counted["losses"], single.losses[:counted_steps])
        # Adam is blind to a per-tensor scale of the gradients; the norm is not.
        assert_losses_match(f"{name} grad norm", counted["grad_norms"], grad_norms[:counted_steps])
        assert_losses_match(f"{name} timed", row["losses"], single.losses[:timed_steps])
        assert row["dropped_fraction"] == 0.0, name


def _padded_bytes(shape: tuple[int, ...], world: int) -> int:
    """FP32 bytes of a parameter sharded on dim 0 over `world` ranks, padded to equal shards."""
    rows = -(-shape[0] // world) * world
    return rows * math.prod(shape[1:]) * 4


@dataclass(frozen=True)
class Shapes:
    """What the benchmark's model and batch imply for the collectives, per rank and step."""

    block_bytes: list[int]
    """Padded FP32 bytes of each block's parameters (one FSDP unit each)."""
    root_bytes: int
    """Padded FP32 bytes of the root unit (embedding, final norm, head)."""
    num_params: int
    dense_numel: int
    """Parameters not marked as expert parameters (all-reduced over the 4 replicas)."""
    micro: int
    """Micro-batches per rank and step."""
    tokens: int
    """Tokens per micro-batch."""
    row_bytes: int
    """Bytes of one token row sent between ranks (fp32 compute: tokens travel in fp32)."""
    moe_layers: int
    top_k: int


def _shapes(setup) -> Shapes:
    config = _fsdp_config(setup)
    named = list(Transformer(config.model).named_parameters())
    blocks = sorted({n.split(".")[1] for n, _ in named if n.startswith("blocks.")})
    data, model = config.data, config.model
    return Shapes(
        block_bytes=[
            sum(_padded_bytes(p.shape, WORLD) for n, p in named if n.startswith(f"blocks.{b}."))
            for b in blocks
        ],
        root_bytes=sum(
            _padded_bytes(p.shape, WORLD) for n, p in named if not n.startswith("blocks.")
        ),
        num_params=len(named),
        dense_numel=sum(p.numel() for _, p in named if not is_expert_parameter(p)),
        micro=data.global_batch_size // data.micro_batch_size // WORLD,
        tokens=data.micro_batch_size * data.seq_len,
        row_bytes=model.d_model * 4,
        moe_layers=model.n_layers - model.dense_layers,
        top_k=model.moe.top_k,
    )


def _step_statistics_bytes(rows: dict[str, dict]) -> float:
    """The all-reduce of the step statistics (losses, expert loads), the same in every design:
    with the distributed optimizer the only other all-reduce is the gradient norm's (one
    float64)."""
    stats = rows["ep/all_to_all/dist-opt"]["bytes_per_step"]["all_reduce"] - 8
    assert stats > 0
    return stats


@pytest.mark.slow
def test_fsdp_counts_every_gather_and_reduction(run):
    """FSDP gathers every weight for each micro-batch's forward and (but the root's) again for
    its backward, and reduce-scatters every gradient after each micro-batch; the payload of
    an all-gather is the rank's shard."""
    document, setup, _ = run
    shapes, rows = _shapes(setup), _rows(document)
    fsdp, blocks = rows["fsdp"], shapes.block_bytes
    assert fsdp["bytes_per_step"]["all_gather"] == (
        shapes.micro * (2 * sum(blocks) + shapes.root_bytes) / WORLD
    )
    assert fsdp["calls_per_step"]["all_gather"] == shapes.micro * (2 * len(blocks) + 1)
    assert fsdp["bytes_per_step"]["reduce_scatter"] == (
        shapes.micro * (sum(blocks) + shapes.root_bytes)
    )
    assert fsdp["calls_per_step"]["reduce_scatter"] == shapes.micro * (len(blocks) + 1)
    # torch's clip_grad_norm_ reduces the sharded (DTensor) gradients' norms, one fp32 value per
    # parameter, in one functional all-reduce: seen only if the counter lets DTensor dispatch.
    stats = _step_statistics_bytes(rows)
    assert fsdp["bytes_per_step"]["all_reduce"] == stats + 4 * shapes.num_params
    assert fsdp["collective_ops"].get("_c10d_functional::all_reduce", 0) > 0
    for kind in ("all_to_all", "broadcast", "other"):
        assert fsdp["bytes_per_step"][kind] == 0, kind


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["all_to_all", "rowwise"])
def test_ep_counts_dense_reductions_and_token_exchanges(run, dispatcher):
    """Ours all-reduces the dense gradients (or reduce-scatters them and gathers the updated
    shards) and nothing of the experts (no replica: dp / ep = 1), and moves tokens all-to-all:
    dropless rows (all_to_all) or every capacity slot (rowwise's CPU transport)."""
    document, setup, _ = run
    shapes, rows = _shapes(setup), _rows(document)
    stats = _step_statistics_bytes(rows)
    plain, sharded = rows[f"ep/{dispatcher}"], rows[f"ep/{dispatcher}/dist-opt"]
    assert plain["bytes_per_step"]["all_reduce"] == shapes.dense_numel * 4 + 8 + stats
    assert plain["bytes_per_step"]["all_gather"] == plain["bytes_per_step"]["reduce_scatter"] == 0
    padded_dense = -(-shapes.dense_numel // WORLD) * WORLD * 4
    assert sharded["bytes_per_step"]["reduce_scatter"] == padded_dense
    assert sharded["bytes_per_step"]["all_gather"] == padded_dense / WORLD
    exchanges = shapes.moe_layers * shapes.micro
    capacity = math.ceil(CAPACITY_FACTOR * shapes.tokens * shapes.top_k / EXPERTS)
    for row in (plain, sharded):
        for kind in ("broadcast", "other"):
            assert row["bytes_per_step"][kind] == 0, kind
        sent = [r["all_to_all"] for r in row["bytes_per_step_by_rank"]]
        if dispatcher == "all_to_all":
            # The copies' rows out and back, forward and backward, and the [E] int64 counts;
            # uneven over ranks, exact in their sum.
            copies = WORLD * shapes.tokens * shapes.top_k * shapes.row_bytes
            expected = exchanges * (4 * copies + WORLD * EXPERTS * 8)
            assert sum(sent) == pytest.approx(expected, rel=1e-12)
            assert row["calls_per_step"]["all_to_all"] == exchanges * 5
        else:
            block = EXPERTS * capacity * shapes.row_bytes
            assert sent == [exchanges * 4 * block] * WORLD
            assert row["calls_per_step"]["all_to_all"] == exchanges * 4


@pytest.mark.slow
def test_wire_bytes_follow_from_the_payload(run):
    """Every group has 4 ranks: a ring all-gather sends 3 shards, a reduce-scatter 3/4 of its
    input, an all-reduce 2 x 3/4 of its tensor; an all-to-all all but the rank's own block."""
    document, _, _ = run
    for name, row in _rows(document).items():
        payload, wire = row["bytes_per_step"], row["wire_bytes_per_step"]
        for kind, factor in (("all_gather", 3), ("reduce_scatter", 0.75), ("all_reduce", 1.5)):
            assert wire[kind] == pytest.approx(factor * payload[kind], rel=1e-12), (name, kind)
        ranks = zip(row["bytes_per_step_by_rank"], row["wire_bytes_per_step_by_rank"], strict=True)
        for rank_payload, rank_wire in ranks:
            sent, left = rank_payload["all_to_all"], rank_wire["all_to_all"]
            assert (sent == left == 0) if name == "fsdp" else 0 < left < sent, name


@pytest.mark.slow
@pytest.mark.slow
def test_table_json_and_plot(run):
    document, _, out = run
    rows = _rows(document)
    for row in rows.values():
        for key in ("design", "dispatcher", "experts", "tokens_per_s", "peak_mem_bytes"):
            assert key in row
        assert row["tokens_per_s"] > 0 and row["peak_mem_bytes"] > 0
        assert row["bytes_per_step_total"] == sum(row["bytes_per_step"].values())
        assert row["wire_bytes_per_step_total"] == sum(row["wire_bytes_per_step"].values())
    assert rows["fsdp"]["design"] == "fsdp" and rows["fsdp"]["tokens_per_s_vs_fsdp"] == 1.0
    assert rows["ep/all_to_all"]["design"] == "ep"
    assert (out / "vs_fsdp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--experts", "8", "6"],
            "--experts 6: each expert count must be a positive multiple of ep=4 (the ep design "
            "splits every MoE layer's experts over 4 ranks)",
        ),
        (
            ["--plot", "vs_fsdp.svg"],
            "--plot vs_fsdp.svg: the plot is written as PNG; give a path ending in .png",
        ),
    ],
    ids=["experts", "plot"],
)
def test_bad_arguments_are_one_line_and_write_nothing(tmp_path, args, message):
    previous = tmp_path / "vs_fsdp.json"
    previous.write_text('{"kept": true}')
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "vs_fsdp.py"), *args, "--json", str(previous)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"error: {message}"]
    assert previous.read_text() == '{"kept": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vs_fsdp.json"]
