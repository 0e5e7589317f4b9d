"""The planner's predictions against what runs here: tensors saved for backward, the memory
benchmark's per-category measurements, and the bytes the process-group calls carry."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks

import memory as memory_benchmark
from harness.ranks import run_distributed
from moe_plan import (
    DEVICES,
    device_with,
    evaluate,
    format_plan,
    held_per_micro_batch,
    make_plan,
    predict_memory,
    predict_traffic,
)
from moe_plan.activations import HOST_GRAPH_BYTES_PER_BLOCK, loss_bytes
from moe_plan.config import load_config
from moe_plan.layouts import format_bytes, start_error
from moe_plan.memory import _rank_memory
from moe_train.model.training_choices import (
    apply_expert_gemm,
    apply_linear_precision,
    apply_param_dtype,
    apply_recompute,
)
from moe_train.model.transformer import Transformer

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--model.d_model=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.moe.num_experts=4",
    "--model.moe.top_k=2",
    "--model.moe.expert_hidden=96",
    "--data.seq_len=32",
    "--data.micro_batch_size=2",
    "--data.global_batch_size=4",
]


def _saved_bytes(config) -> int:
    """Bytes of the new tensors a forward keeps for backward, counted by torch's hooks."""
    torch.manual_seed(0)
    model = Transformer(config.model)
    apply_recompute(model, config.parallel.recompute)
    if config.precision.param_dtype == "bfloat16":
        apply_param_dtype(model, torch.bfloat16)
    apply_expert_gemm(model, config.precision.expert_gemm)
    apply_linear_precision(model, config.precision.linear, torch.device("cpu"))
    batch, seq = config.data.micro_batch_size, config.data.seq_len
    tokens = torch.randint(0, config.model.vocab_size, (batch, seq + 1))
    model.rope(seq)  # the rotary tables are the model's, made on first use: not activations
    existing = [*model.parameters(), *model.buffers(), tokens]
    before = {t.untyped_storage().data_ptr() for t in existing}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    bf16 = config.precision.compute_dtype == "bfloat16"
    with saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", enabled=bf16):
        model(tokens[:, :-1], targets_BS=tokens[:, 1:])
    return sum(size for ptr, size in storages.items() if ptr not in before)


# Configs whose forward makes no autocast weight copies (FP32 compute, or bf16 parameters),
# so that everything it holds is a saved tensor.
SAVED_CASES = {
    "fp32": [],
    "bf16 params": ["--precision.param_dtype=bfloat16"],
    "qk-norm, sigmoid, shared expert": [
        "--model.qk_norm=true",
        "--model.moe.router=sigmoid",
        "--model.moe.shared_experts=1",
    ],
    "dense first layer, tied": ["--model.dense_layers=1", "--model.tie_embeddings=true"],
    "capacity, alignment 8": ["--model.moe.capacity_factor=1.5", "--model.moe.group_alignment=8"],
    "full recompute": ["--parallel.recompute=full"],
    "full recompute, bf16 params": [
        "--parallel.recompute=full",
        "--precision.param_dtype=bfloat16",
    ],
}


@pytest.mark.parametrize("case", list(SAVED_CASES))
def test_activations_are_the_tensors_saved_for_backward(case):
    overrides = ["--precision.compute_dtype=float32", *SAVED_CASES[case]]
    if "--precision.param_dtype=bfloat16" in overrides:
        overrides[0] = "--precision.compute_dtype=bfloat16"
    config = load_config(None, [*SMALL, *overrides])
    layers = list(range(config.model.n_layers))
    predicted = held_per_micro_batch(config, layers, first=True, last=True)
    assert predicted == _saved_bytes(config)


# FP8 recipes quantize transient copies per GEMM and keep their bf16 inputs for backward, so
# the planner counts them as bf16 (bf16 parameters: every saved tensor is an activation).
FP8_CASES = {
    "fp8_rowwise experts and linears": [
        "--precision.expert_gemm=fp8_rowwise",
        "--precision.linear=fp8_rowwise",
    ],
    "mxfp8 experts, fp8_tensorwise linears, qk-norm, shared expert": [
        "--precision.expert_gemm=mxfp8",
        "--precision.linear=fp8_tensorwise",
        "--model.qk_norm=true",
        "--model.moe.shared_experts=1",
    ],
}


@pytest.mark.slow
def test_fp8_keeps_what_bf16_keeps_for_backward():
    """FP8 expert GEMMs (moe-kernels' rowwise and MXFP8 recipes) and FP8 linears (torchao's
    Float8Linear) keep the same bytes for backward as bf16: the planner's count, exactly."""
    pytest.importorskip("torchao.float8")
    bf16 = ["--precision.compute_dtype=bfloat16", "--precision.param_dtype=bfloat16"]
    for case, overrides in FP8_CASES.items():
        config = load_config(None, [*SMALL, *bf16, *overrides])
        layers = list(range(config.model.n_layers))
        predicted = held_per_micro_batch(config, layers, first=True, last=True)
        assert predicted == _saved_bytes(config), case
        plain = [o for o in overrides if not o.startswith("--precision.")]
        base = load_config(None, [*SMALL, *bf16, *plain])
        assert predicted == held_per_micro_batch(base, layers, first=True, last=True), case


@pytest.mark.slow  # 10 s on a loaded machine, most of it torchao's first use
def test_mxfp8_on_torchao_kernels_keeps_what_bf16_keeps(monkeypatch):
    """On SM100 the MXFP8 experts run torchao's grouped GEMM, whose own autograd function keeps
    a column-major copy of the experts' weights and block-padded copies of the inputs;
    moe-kernels' glue keeps instead what the bf16 recipe keeps (the planner's count for such a
    device). torchao's emulated kernels stand in for its SM100 ones, through that glue."""
    pytest.importorskip("torchao.prototype.moe_training")
    from moe_kernels import mxfp8

    glue = mxfp8._torchao_grouped_mm
    used = []

    def emulated(x, w, offsets, mode, _):
        used.append(x.shape)
        return glue(x, w, offsets, mode, "emulated")

    monkeypatch.setattr(mxfp8, "_use_torchao", lambda kernel, x: True)
    monkeypatch.setattr(mxfp8, "_torchao_grouped_mm", emulated)
    layers = [0, 1]
    for params in ("bfloat16", "float32"):
        overrides = ["--precision.compute_dtype=bfloat16", f"--precision.param_dtype={params}"]
        config = load_config(None, [*SMALL, *overrides, "--precision.expert_gemm=mxfp8"])
        predicted = held_per_micro_batch(config, layers, first=True, last=True)
        used.clear()
        saved = _saved_bytes(config)
        assert len(used) == 2 * len(layers), "the torchao glue ran for every expert GEMM"
        if params == "bfloat16":
            assert predicted == saved
            continue
        # FP32 parameters: autocast's copies are held but not all saved (see SAVED_CASES), so
        # the saved tensors are compared with the bf16 recipe's.
        bf16 = load_config(None, [*SMALL, *overrides, "--precision.expert_gemm=torch"])
        assert saved == _saved_bytes(bf16)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_activations_of_mtp_modules_are_the_tensors_they_save(recompute):
    """Two MTP modules on top of the model: within 0.1% of the saved tensors (attention's
    per-row statistics are counted at the full sequence length)."""
    overrides = ["--precision.compute_dtype=float32", f"--parallel.recompute={recompute}"]
    config = load_config(None, [*SMALL, *overrides, "--model.mtp_depth=2"])
    layers = list(range(config.model.n_layers))
    predicted = held_per_micro_batch(config, layers, first=True, last=True)
    without = held_per_micro_batch(
        replace(config, model=replace(config.model, mtp_depth=0)), layers, first=True, last=True
    )
    assert predicted > 1.1 * without
    assert predicted == pytest.approx(_saved_bytes(config), rel=1e-3)


def test_the_busiest_rank_and_what_a_device_must_fit():
    config = load_config(
        None, [*SMALL, "--model.n_layers=4", "--parallel.pp=2", "--data.global_batch_size=8"]
    )
    memory = predict_memory(config, world_size=2)
    first, last = (_rank_memory(config, 2, rank) for rank in (0, 1))
    # 1F1B: the first stage holds two micro-batches in flight, the last one.
    assert (first.in_flight, last.in_flight) == (2, 1)
    assert memory.total == max(first.total, last.total)
    assert memory.total > memory.weights + memory.gradients + memory.optimizer


# --- against the memory benchmark and the process-group calls, on two gloo ranks ---

COUNTED = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single")


class CollectiveBytes:
    """Counts the input bytes of each process-group call while installed, by call and group
    size; pipeline sends by their tensors."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._saved: dict[str, object] = {}

    def __enter__(self) -> CollectiveBytes:
        for name in COUNTED:
            original = getattr(dist, name)
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original))
        original_batch = dist.batch_isend_irecv
        self._saved["batch_isend_irecv"] = original_batch

        def batch(ops):
            for op in ops:
                if op.op in (dist.isend, dist.send):
                    self.bytes["send", "p2p"] += op.tensor.numel() * op.tensor.element_size()
            return original_batch(ops)

        dist.batch_isend_irecv = batch
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            tensor = args[1] if name != "all_reduce" else args[0]
            group = kwargs.get("group")
            size = dist.get_world_size(group)
            kind = "int" if not tensor.is_floating_point() else str(size)
            self.bytes[name, kind] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return counted


TOPOLOGY_CASES = ["dp2", "dp2 dist-opt", "pp2 1f1b", "ep2 all_to_all"]


def _rank_body(rank: int, world_size: int) -> dict:
    from moe_train.train.runtime import start_runtime
    from moe_train.train.step import StepRunner

    out: dict = {}
    for name, (world, overrides, modes) in memory_benchmark.TOPOLOGIES.items():
        if world != world_size:
            continue
        for mode in modes:
            config = memory_benchmark.row_config(
                [*memory_benchmark.QUICK_MODEL, *overrides], mode, Path("/unused"), 4
            )
            memory = memory_benchmark.probe_memory(config, warm_steps=2)
            out[name, mode] = {k: getattr(memory, k) for k in ("params", "grads", "optim")}
            out[name, mode]["activations"] = memory.activations
        # One step's collectives (after a warm step), the router random so that every
        # rank's expected load is even.
        random = [*memory_benchmark.QUICK_MODEL, *overrides, "--model.moe.random_routing=true"]
        config = memory_benchmark.row_config(random, "none", Path("/unused"), 4)
        runtime = start_runtime(config, torch.device("cpu"))
        runner = StepRunner(config, runtime)
        shape = (config.data.global_batch_size, config.data.seq_len + 1)
        batch = torch.randint(0, config.model.vocab_size, shape)
        runner.train_step(batch, 1e-4)
        with CollectiveBytes() as counter:
            runner.train_step(batch, 1e-4)
        out[name, "bytes"] = dict(counter.bytes)
        runtime.close(clean=True)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(_rank_body, world_size=2, timeout=600)


def _measured_config(name: str, mode: str):
    world, overrides, _ = memory_benchmark.TOPOLOGIES[name]
    return world, memory_benchmark.row_config(
        [*memory_benchmark.QUICK_MODEL, *overrides], mode, Path("/unused"), 4
    )


def _check_memory_row(name: str, mode: str, measured_by_rank: list[dict]) -> None:
    from moe_plan.config.stage_plan import plan_stages

    world, config = _measured_config(name, mode)
    dp = world // config.parallel.pp
    windows = []
    for rank, measured in enumerate(measured_by_rank):
        pp_rank = rank // dp
        predicted = _rank_memory(config, world, pp_rank)
        label = f"{name} {mode} rank {rank}"
        assert predicted.weights == measured["params"], label
        assert predicted.gradients == pytest.approx(measured["grads"], rel=0.01), label
        assert predicted.optimizer == pytest.approx(measured["optim"], rel=0.01), label
        # The benchmark reads host memory after the forward of the model (or of the stage
        # module: a pipeline's loss runs after it), where the autograd graph also lives.
        stages = plan_stages(config.model.n_layers, config.parallel.pp, pp_rank)
        window = predicted.activations + HOST_GRAPH_BYTES_PER_BLOCK * len(stages.layers)
        if config.parallel.pp > 1 and stages.has_last:
            window -= loss_bytes(config)
        windows.append((window, measured["activations"], label))
    if config.parallel.ep > 1:
        # The router decides how the copies split between the expert-parallel ranks (the
        # prediction assumes an even split); the sum over the ranks does not depend on it.
        predicted_sum = sum(w for w, _, _ in windows)
        measured_sum = sum(m for _, m, _ in windows)
        assert predicted_sum == pytest.approx(measured_sum, rel=0.10), f"{name} {mode}"
        return
    for window, measured, label in windows:
        assert window == pytest.approx(measured, rel=0.10), label


@pytest.mark.slow
def test_memory_matches_the_memory_benchmark_in_one_process():
    for mode in memory_benchmark.TOPOLOGIES["1 process"][2]:
        _, config = _measured_config("1 process", mode)
        measured = memory_benchmark.probe_memory(config, warm_steps=2)
        row = {k: getattr(measured, k) for k in ("params", "grads", "optim", "activations")}
        _check_memory_row("1 process", mode, [row])


@pytest.mark.slow
@pytest.mark.parametrize("name", TOPOLOGY_CASES)
def test_memory_matches_the_memory_benchmark_on_two_ranks(two_ranks, name):
    for mode in memory_benchmark.TOPOLOGIES[name][2]:
        _check_memory_row(name, mode, [r[name, mode] for r in two_ranks])


@pytest.mark.slow
@pytest.mark.parametrize("name", TOPOLOGY_CASES)
def test_traffic_matches_the_bytes_of_the_process_group_calls(two_ranks, name):
    world, config = _measured_config(name, "none")
    dp = world // config.parallel.pp
    for rank, result in enumerate(two_ranks):
        counted = result[name, "bytes"]
        predicted = predict_traffic(config, world, rank // dp).payload
        label = f"{name} rank {rank}: counted {counted}, predicted {predicted}"
        gradients = {k: v for k, v in predicted.items() if not k.startswith(("ep ", "pipe"))}
        by_call = {
            "all-reduce": counted.get(("all_reduce", "2"), 0),
            "reduce-scatter": counted.get(("reduce_scatter_tensor", "2"), 0),
            "all-gather": counted.get(("all_gather_into_tensor", "2"), 0),
        }
        for call, count in by_call.items():
            want = sum(v for k, v in gradients.items() if k.endswith(call))
            # Scalars (the gradient norm, step statistics) ride along with the reductions.
            assert want <= count <= want + 4096, f"{call}: {label}"
        if "pipeline" in predicted:
            assert counted["send", "p2p"] == predicted["pipeline"] / 2, label
        exchanged = counted.get(("all_to_all_single", "2"), 0)
        want = predicted.get("ep dispatch", 0) + predicted.get("ep combine", 0)
        assert exchanged == pytest.approx(want, rel=0.05), label
    if name.startswith("ep"):
        # Over both ranks every copy sent is a copy received: the sum is exact.
        total = sum(r[name, "bytes"][("all_to_all_single", "2")] for r in two_ranks)
        per_rank = predict_traffic(config, world).payload
        assert total == 2 * (per_rank["ep dispatch"] + per_rank["ep combine"])


# --- the command and the shipped configs ---


def test_plan_refuses_what_training_refuses():
    config = load_config(None, [*SMALL, "--parallel.ep=2", "--parallel.dispatcher=rowwise"])
    result = evaluate(config, 2, DEVICES["h100"])
    assert result.error is not None and "capacity_factor" in result.error
    odd = evaluate(load_config(None, [*SMALL, "--parallel.ep=2"]), 3, DEVICES["h100"])
    assert "must divide the data-parallel size 3" in odd.error


def test_device_figures_are_checked():
    assert device_with("b300").memory_gib > device_with("h100").memory_gib
    assert device_with("h100", memory_gib=40).memory_gib == 40
    with pytest.raises(ValueError, match="--gpu-tflops"):
        device_with(None, memory_gib=40, intra_node_gbps=100, inter_node_gbps=10)
    with pytest.raises(ValueError, match="'a100'"):
        device_with("a100")


def test_a_device_kinds_fp8_kernels_are_the_runtime_rule_of_its_capability(capsys):
    """The planner asks moe-devices' rule (the one moe-kernels applies at run time) about each
    device kind's capability: MXFP8 on the B200 and B300, rowwise FP8 on the H100 and H200; a
    device of figures takes --gpu-capability, or 9.0 with an FP8 rate and 8.0 without."""
    from moe_devices import kernel_paths
    from moe_plan.cli import plan_json_of
    from moe_train.cli import main

    for name, device in DEVICES.items():
        assert device.kernel_paths == kernel_paths(device.capability), name
        assert device.mxfp8 == (name in ("b200", "b300")), name
    figures = {"memory_gib": 80, "tflops": 989, "intra_node_gbps": 450, "inter_node_gbps": 50}
    assert device_with(None, **figures).capability == (8, 0)
    assert device_with(None, **figures, fp8_tflops=1979).capability == (9, 0)
    assert device_with(None, **figures, fp8_tflops=4500, capability=(10, 0)).mxfp8
    assert not device_with("b300", capability=(9, 0)).mxfp8
    tiny = str(ROOT / "configs/tiny.yaml")
    flags = ["--gpu-memory-gib", "80", "--gpu-tflops", "989", "--intra-node-gbps", "450"]
    flags += ["--inter-node-gbps", "50", "--gpu-fp8-tflops", "4500", "--gpu-capability", "10.0"]
    answer = plan_json_of([tiny, "--gpus", "1", *flags], search=False)
    assert answer["device"]["mxfp8"] and list(answer["device"]["capability"]) == [10, 0]
    capsys.readouterr()
    assert main(["plan", tiny, "--gpus", "1", "--gpu-capability", "sm_90"]) == 2
    assert capsys.readouterr().err == (
        "error: --gpu-capability 'sm_90' must be MAJOR.MINOR, e.g. 9.0 or 10.0\n"
    )


def _plan(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "moe_train.cli", "plan", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)


SHIPPED = {  # config: its world size and device, as its header says
    "configs/tiny.yaml": ("1", "h100"),
    "configs/sft-tiny.yaml": ("1", "h100"),
    "configs/medium.yaml": ("1", "h100"),
    "configs/olmoe-1b-7b.yaml": ("8", "h100"),
    "configs/moe-47b-a3b.yaml": ("8", "b300"),
    "configs/published-47b-a3b.yaml": ("8", "b300"),
    "configs/published-1t-a58b.yaml": ("512", "b300"),
    "configs/published-qwen3-30b-a3b-b200.yaml": ("8", "b200"),
    "configs/published-qwen3-30b-a3b-h100.yaml": ("16", "h100"),
    "configs/published-qwen3-235b-a22b-b200.yaml": ("256", "b200"),
    "configs/published-qwen3-235b-a22b-h100.yaml": ("256", "h100"),
}
CALIBRATION_ONLY = {path for path in SHIPPED if "qwen3" in path}
"""Published layouts the planner finds over memory (or too costly to rank here): their own
layout is evaluated by test_plan_calibration.py."""


HEADER_RANKS = re.compile(r"\((\d+) ranks?\b")
"""How a shipped config's `# Hardware:` line names the ranks it runs on: `(8 ranks: ...)`."""


def header_ranks(path: Path) -> tuple[int, str]:
    """The rank count a shipped config's `# Hardware:` line names, and its header comment."""
    header = re.match(r"(?:#.*\n)*", path.read_text()).group(0)
    lines = [line for line in header.splitlines() if line.startswith("# Hardware:")]
    assert len(lines) == 1, f"{path.name}: one '# Hardware:' line in its header, not {lines}"
    counts = HEADER_RANKS.findall(lines[0])
    assert len(counts) == 1, f"{path.name}: its Hardware line names '(N ranks)' once: {lines[0]}"
    return int(counts[0]), header


def test_every_shipped_configs_own_layout_starts_on_the_ranks_its_header_names():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        ranks, header = header_ranks(path)
        # The rest of the header, and the table the slow test plans from, say the same count.
        assert set(re.findall(r"--gpus (\d+)", header)) <= {str(ranks)}, path.name
        assert set(re.findall(r"^# Calibration: (\d+) x", header, re.M)) <= {str(ranks)}
        assert SHIPPED[f"configs/{path.name}"][0] == str(ranks), path.name
        error = start_error(load_config(path), ranks)  # the trainer's and planner's check
        assert error is None, f"{path.name} on {ranks} ranks: {error}"


@pytest.mark.slow
def test_every_shipped_config_passes_plan_at_its_world_size():
    from moe_train.cli import run

    assert sorted(SHIPPED) == sorted(f"configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml"))
    for path, (gpus, gpu) in SHIPPED.items():
        if path in CALIBRATION_ONLY:
            continue
        # In this process (the command's own entry point), sparing an interpreter each.
        assert run(["plan", str(ROOT / path), "--gpus", gpus, "--gpu", gpu, "--top", "3"]) == 0
    result = _plan("configs/olmoe-1b-7b.yaml", "--gpus", "8", "--gpu", "h100", "--top", "3")
    assert result.returncode == 0 and "fits" in result.stdout, result.stdout[-2000:]
    bad = _plan("configs/tiny.yaml", "--gpus", "3", "--parallel.ep=2")
    assert bad.returncode == 1 and "cannot start" in bad.stdout
    missing = _plan("configs/tiny.yaml", "--gpus", "2", "--gpu-memory-gib", "40", "--gpu", "x")
    assert missing.returncode == 2


def test_bytes_across_nodes():
    from moe_plan.traffic import across_nodes

    def config(ep: int, cp: int = 1):
        return load_config(
            None,
            [*SMALL, "--model.moe.num_experts=16", f"--parallel.ep={ep}", f"--parallel.cp={cp}"],
        )

    # An EP group of 16 over nodes of 8: 8 of a rank's 15 peers are on another node.
    assert across_nodes(config(16), 16, "ep dispatch", 15.0, per_node=8) == 8.0
    assert across_nodes(config(8), 16, "ep combine", 15.0, per_node=8) == 0.0
    assert across_nodes(config(8), 16, "dp all-reduce", 3.0, per_node=8) == 3.0
    assert across_nodes(config(1), 8, "dp all-reduce", 3.0, per_node=8) == 0.0
    # A cp group of consecutive ranks within a node stays there, whatever dp spans.
    assert across_nodes(config(1, cp=2), 16, "cp K/V all-gather", 5.0, per_node=8) == 0.0
    assert across_nodes(config(1, cp=4), 16, "cp K/V all-gather", 5.0, per_node=2) == 5.0


# --- what the command says when nothing fits, and how it says it ---


def _small_plan(memory_gib: float, world_size: int, per_node: int = 2, extra=()):
    from moe_plan import make_plan

    config = load_config(None, [*SMALL, "--data.global_batch_size=8", *extra])
    device = device_with("h100", memory_gib=memory_gib, gpus_per_node=per_node)
    return config, device, make_plan(config, world_size, device)


def test_when_nothing_fits_the_closest_layouts_and_the_smallest_count_that_fits():
    from moe_plan import make_plan
    from moe_plan.search import allowed_counts

    # A device smaller than any layout of 1 rank needs, but not than some on more ranks.
    config, device, plan = _small_plan(0.0015, 1, per_node=2)
    assert not plan.fitting and plan.closest
    limit = device.memory_gib * 2**30
    totals = [r.memory.total for r in plan.closest]
    least = min(r.memory.total for r in plan.rejected if r.error is None)
    assert totals == sorted(totals) and totals[0] == least > limit
    # Whole nodes of 2 beyond the first, each pp (at most 2 layers) x dp (dividing the 8
    # sequences): 3 is not a whole number of nodes, 6 = 2 x 3 has no such split.
    assert list(allowed_counts(config, 1, device)) == [2, 4, 8, 16]
    # Tiny (4 layers, 16 sequences) on nodes of 8: 6 = 3 x 2 within a node, 12 = 3 x 4 is not
    # a whole number of nodes.
    tiny = load_config(ROOT / "configs/tiny.yaml")
    assert list(allowed_counts(tiny, 4, DEVICES["h100"])) == [6, 8, 16, 24, 32, 48, 64]
    found = plan.smallest.best
    assert found is not None and found.fits and found.world_size == plan.smallest.world_size
    # The same answer by the full planner at each allowed count in turn.
    for count in allowed_counts(config, 1, device):
        full = make_plan(config, count, device, search=False)
        if full.fitting:
            assert count == found.world_size
            assert full.fitting[0].tokens_per_s == found.tokens_per_s
            break
        assert full.closest, f"nothing starts on {count}"
    text = format_plan(plan)
    assert f"fits on {found.world_size} x H100 SXM: {found.label} (" in text
    over = f"+{format_bytes(plan.closest[0].memory.total - limit)}"
    assert over in text.split("the closest")[1].splitlines()[3]
    # A device no count fits.
    hopeless = _small_plan(0.0002, 1)[2]
    assert hopeless.smallest.best is None
    assert f"no count up to {hopeless.smallest.tried_to} x H100 SXM fits" in format_plan(hopeless)


def test_beyond_the_counts_tried_one_by_one_doubling_and_halving_find_the_same(monkeypatch):
    from moe_plan import search

    # Six layers and twelve sequences: counts 2, 3, 4, 6 and 8 take at least 44, 30, 24, 16 and
    # 13 MiB per device; 5 and the counts past 8 start no layout.
    shape = ["--model.n_layers=6", "--data.global_batch_size=12", "--data.micro_batch_size=2"]
    small = load_config(ROOT / "configs/tiny.yaml", shape)
    counts = search.allowed_counts(small, 1, DEVICES["h100"])
    assert counts == [2, 3, 4, 5, 6, 8, 16, 24, 48, 72]
    for mib, expected in ((27, 4), (20, 6), (14, 8), (10, None)):
        device = device_with("h100", memory_gib=mib / 1024)
        one_by_one = search.smallest_fitting(small, 1, device)
        monkeypatch.setattr(search, "EVERY_COUNT", 1)
        doubling = search.smallest_fitting(small, 1, device)
        monkeypatch.undo()
        assert doubling.world_size == one_by_one.world_size == expected, mib
        if expected is None:  # up to the largest count
            assert doubling.tried_to == 72 and one_by_one.searched_to == 72
            continue
        assert (doubling.searched_to, doubling.every_count_below) == (2, False)
        assert one_by_one.every_count_below and doubling.best.label == one_by_one.best.label
        plan = make_plan(small, 1, device, search=False)
        line = format_plan(replace(plan, smallest=doubling)).split("\nfits on ")[1]
        assert f"a count between 2 and {doubling.world_size} may also fit" in line


def _columns(lines: list[str]) -> tuple[list[tuple[int, int]], list[str]]:
    """The header's column spans and the table's value rows, from a printed plan."""
    start = next(i for i, line in enumerate(lines) if line.startswith("#  "))
    header = lines[start]
    spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", header)]
    rows = []
    for line in lines[start + 2 :]:
        if not line[:1].isdigit():
            break
        rows.append(line)
    return spans, rows


@pytest.mark.parametrize(("memory_gib", "world_size"), [(80.0, 4), (0.0015, 1)])
def test_columns_line_up_with_their_headers(memory_gib, world_size):
    plan = _small_plan(memory_gib, world_size)[2]
    spans, rows = _columns(format_plan(plan, top=50).splitlines())
    assert rows
    _, (layout_start, _), *figures = spans
    for row in rows:
        # Row number and layout begin under their headers; figures end under theirs.
        assert row[0].isdigit() and row[layout_start - 1] == " " and row[layout_start] == "p"
        for _, end in figures:
            assert row[end - 1] != " " and (end == len(row) or row[end] == " "), (row, end)
        cells = re.split(r"\s{2,}", row)
        assert len(cells) == len(spans), row


def test_rejection_reasons_are_grouped_with_their_counts():
    plan = _small_plan(0.0015, 4)[2]
    text = format_plan(plan)
    section = text.split("layouts that do not fit or cannot start")[1].splitlines()[1:]
    lines = [line for line in section if line.startswith("  ") and "layout" in line]
    counts = [int(line.split()[0]) for line in lines]
    assert sum(counts) == len(plan.rejected) and len(lines) < len(plan.rejected)
    assert counts == sorted(counts, reverse=True)
    assert any("largest part: " in line for line in lines)


def test_printed_overrides_give_the_same_layout_through_trains_config_loading():
    from moe_plan import make_plan
    from moe_plan.layouts import layout_overrides, with_figures

    path = ROOT / "configs/tiny.yaml"
    cases = [
        ([], "h100"),  # dispatcher auto, FP32 parameters
        (["--parallel.dispatcher=local", "--parallel.ep=1"], "b300"),  # MXFP8 rows too
    ]
    for given, gpu in cases:
        base = load_config(path, given)
        plan = make_plan(base, 8, DEVICES[gpu])
        rejected = [with_figures(r, DEVICES[gpu]) for r in plan.rejected if r.error is None]
        rows = plan.fitting + rejected
        assert len(rows) > 100
        rows = rows[
            ::3
        ]  # every kind of row, at a third of the cost and any("mxfp8" in r.label for r in rows) == (gpu == "b300")
        for row in rows:
            again = evaluate(
                load_config(path, [*given, *layout_overrides(row.config, base)]), 8, DEVICES[gpu]
            )
            assert again.error is None, (row.label, again.error)
            assert again.label == row.label
            assert again.memory.total == row.memory.total
            assert again.tokens_per_s == row.tokens_per_s


def test_a_small_model_in_mebibytes_at_a_speed_its_operators_allow():
    from moe_plan import make_plan
    from moe_plan.config.layout_shape import layout_shape
    from moe_plan.roofline import operator_floor_s

    config = load_config(ROOT / "configs/tiny.yaml")
    plan = make_plan(config, 8, DEVICES["h100"])
    text = format_plan(plan)
    assert " 0.0 GiB" not in text and " MiB " in text.split("fastest first")[1]
    tokens = config.data.global_batch_size * config.data.seq_len
    for row in plan.fitting:
        # Not faster than its blocks' operators can be issued, one after another.
        floor = operator_floor_s(row.config, layout_shape(row.config, 8))
        assert row.time.compute_s >= floor
        assert row.tokens_per_s <= tokens / floor / 8
    assert format_bytes(0.5 * 2**30) == "512.0 MiB" and format_bytes(3 * 2**30) == "3.0 GiB"


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_operators_per_block_are_what_a_block_runs(recompute):
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_plan.roofline import OPERATORS_PER_BLOCK

    class Operators(TorchDispatchMode):
        """Counts the operators that do work (views excluded)."""

        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not (torch.Tag.view_copy in func.tags or func.is_view or "view" in func.__name__):
                Operators.count += 1
            return func(*args, **(kwargs or {}))

    def operators(layers: int) -> int:
        config = load_config(
            ROOT / "configs/tiny.yaml",
            [f"--model.n_layers={layers}", f"--parallel.recompute={recompute}"],
        )
        model = Transformer(config.model)
        apply_recompute(model, recompute)
        tokens = torch.randint(0, config.model.vocab_size, (1, config.data.seq_len + 1))
        Operators.count = 0
        with Operators(), torch.autocast("cpu"):
            model(tokens[:, :-1], targets_BS=tokens[:, 1:]).backward()
        return Operators.count

    per_block = (operators(3) - operators(1)) / 2
    assert 0.75 < OPERATORS_PER_BLOCK[recompute] / per_block < 1.33, per_block


def test_plan_command_when_nothing_fits(capsys):
    """As a user runs it (in this process): the closest layouts, the count that fits, the
    legend and each row's overrides; and the same in --json, with the keys it had before."""
    from moe_train.cli import run

    # Tiny needs 59 MiB on one device and 30 MiB on two; the least on four is 16 MiB.
    args = ["plan", str(ROOT / "configs/tiny.yaml"), "--gpus", "1", "--gpu", "h100"]
    args += ["--gpu-memory-gib", "0.025", "--train.max_steps=5"]
    assert run([*args, "--overrides"]) == 1
    out = capsys.readouterr().out
    assert "the closest, least memory first" in out and "\nfits on 4 x H100 SXM: " in out
    assert "layout codes:" in out and "rc:none|selective|full" in out
    command = f"uv run moe-train train {ROOT / 'configs/tiny.yaml'} --train.max_steps=5"
    assert f"overrides of each row, to add to `{command}`:" in out
    assert "\n  1  --" in out and "\n  on 4 devices: --" in out
    assert run([*args, "--json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert {"world_size", "device", "own", "fitting", "rejected"} <= plan.keys()
    assert plan["fitting"] == [] and plan["closest"][0]["over_bytes"] > 0
    smallest = plan["smallest_fitting"]
    assert smallest["world_size"] == 4 and smallest["layout"]["fits"]
    assert all(isinstance(r["overrides"], list) for r in [*plan["rejected"], *plan["closest"]])
    assert "mbM" in plan["legend"] and plan["rejected_groups"][0]["count"] > 1


def test_a_device_of_figures_takes_an_fp8_rate_and_the_label_names_fp8_linears(capsys):
    """--gpu-fp8-tflops gives a device of figures its FP8 rate (its FP8 products then run
    faster, as on a listed device), a bad rate is one line naming the flag and exit 2; the
    layout label and its legend tell FP8 experts and FP8 linears apart."""
    from moe_plan.cli import plan_json_of
    from moe_plan.roofline import compute_seconds
    from moe_train.cli import main
    from moe_train.errors import ConfigError

    tiny = ROOT / "configs/tiny.yaml"
    figures = ["--gpu-memory-gib", "80", "--gpu-tflops", "989"]
    figures += ["--intra-node-gbps", "450", "--inter-node-gbps", "50"]
    fp8 = ["--precision.expert_gemm=fp8_rowwise", "--precision.linear=fp8_rowwise"]

    def plan(*args: str) -> dict:
        return plan_json_of([str(tiny), "--gpus", "1", *figures, *args], search=False)

    given = plan(*fp8, "--gpu-fp8-tflops", "1979")
    assert given["device"]["fp8_tflops"] == 1979.0
    assert plan()["device"]["fp8_tflops"] == 0.0, "none unless given"
    kwargs = {"memory_gib": 80, "tflops": 989, "intra_node_gbps": 450, "inter_node_gbps": 50}
    device, with_fp8 = device_with(None, **kwargs), device_with(None, **kwargs, fp8_tflops=1979)
    config, bf16 = load_config(tiny, fp8), load_config(tiny)
    assert compute_seconds(config, with_fp8)[0] * 1.2 < compute_seconds(config, device)[0]
    assert compute_seconds(bf16, with_fp8) == compute_seconds(bf16, device)
    assert device_with("h100", fp8_tflops=0.0).fp8_tflops == 0.0
    for bad in ("-1", "nan", "inf"):
        message = rf"^--gpu-fp8-tflops {float(bad)} must be a positive dense FP8 rate, or 0 "
        with pytest.raises(ConfigError, match=message):
            plan("--gpu-fp8-tflops", bad)
    capsys.readouterr()
    assert main(["plan", str(tiny), "--gpus", "1", "--gpu-fp8-tflops=-1"]) == 2
    assert capsys.readouterr().err == (
        "error: --gpu-fp8-tflops -1.0 must be a positive dense FP8 rate, "
        "or 0 for a device without native FP8\n"
    )
    assert given["own"]["layout"].endswith(" mb8 rc:none fp8 lin:fp8")
    linears = plan("--precision.linear=fp8_tensorwise")["own"]["layout"]
    assert linears.endswith(" rc:none lin:fp8-tensor"), linears
    assert plan(fp8[0])["own"]["layout"].endswith(" rc:none fp8")
    assert "lin:fp8|fp8-tensor" in given["legend"]
