"""DistributedAdamW: the sharded optimizer takes torch.optim.AdamW's steps at every layout,
clips by the global norm, holds 1/group of the state (no master copy of FP32 parameters), and
its state round-trips between layouts (gloo on the CPU).

Gradients are multiples of 1/8 with small numerators, so their sums (and the norm) are exact
in any order. Both sides run the fused AdamW kernel, whose vector and scalar paths may round
differently where a shard cuts a tensor: updates agree to float32 rounding (`UPDATE_TOL`);
state that is only moved (saved, loaded) must be equal bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from assertions import assert_close_report
from harness.ranks import run_distributed
from moe_parallel import (
    DistributedAdamW,
    DistributedMuon,
    Layout,
    ReplicatedMuon,
    StateRequest,
    decay_matrices,
    is_expert_parameter,
    mark_expert_parameter,
    single_process_layout,
)
from world_layout import world_layout

EXPERTS = 6
HYPER = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
LRS = (1e-2, 2e-2, 5e-3)
CLIPS = (float("inf"), 1e-3, float("inf"))  # the middle step is clipped hard
KINDS = ("param", "exp_avg", "exp_avg_sq")
UPDATE_TOL = {"rtol": 1e-6, "atol": 1e-7}


class _Model(nn.Module):
    """Dense weights (a matrix, a 1-D norm, a Linear, a 2-vector, a frozen one: 55 trainable
    elements, which no group size here divides) and two expert weights of `local_experts`."""

    def __init__(self, local_experts: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(6, 5, dtype=dtype))
        self.norm = nn.Parameter(torch.zeros(5, dtype=dtype))
        self.proj = nn.Linear(5, 3, dtype=dtype)
        self.odd = nn.Parameter(torch.zeros(2, dtype=dtype))
        self.frozen = nn.Parameter(torch.zeros(4, dtype=dtype), requires_grad=False)
        self.experts_up = mark_expert_parameter(
            nn.Parameter(torch.zeros(local_experts, 5, 3, dtype=dtype))
        )
        self.experts_down = mark_expert_parameter(
            nn.Parameter(torch.zeros(local_experts, 7, 1, dtype=dtype))
        )


def _global_params(stage: int) -> dict[str, Tensor]:
    """The whole model of a pipeline stage (every expert), fresh random values."""
    generator = torch.Generator().manual_seed(1000 + stage)
    shapes = {name: p.shape for name, p in _Model(EXPERTS).named_parameters()}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _rows(ep_rank: int, ep: int) -> slice:
    local = EXPERTS // ep
    return slice(ep_rank * local, (ep_rank + 1) * local)


def _local_model(values: dict[str, Tensor], ep_rank: int, ep: int) -> _Model:
    """A rank's model: the dense weights and experts `_rows(ep_rank, ep)` of `values`."""
    model = _Model(EXPERTS // ep)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name][_rows(ep_rank, ep)] if is_expert_parameter(p) else values[name])
    return model


def _coefficients(rank: int, step: int, micro: int, model: nn.Module) -> dict[str, Tensor]:
    """This rank's gradient of one micro-batch: multiples of 1/8 (sums are exact). `odd` gets
    a gradient only on rank 0 (elsewhere it is unused: zeros)."""
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return {
        name: torch.randint(-8, 9, p.shape, generator=generator).float() / 8
        for name, p in model.named_parameters()
        if p.requires_grad and (name != "odd" or rank == 0)
    }


def _backward(model: nn.Module, coefficients: dict[str, Tensor]) -> None:
    params = dict(model.named_parameters())
    sum((params[name] * c).sum() for name, c in coefficients.items()).backward()


class _Reference:
    """Single-process torch.optim.AdamW on the whole model of every stage, fed the summed
    gradients of all ranks, clipped by the global norm (float64, the documented formula)."""

    def __init__(self, pp: int, dp: int, ep: int) -> None:
        self.pp, self.dp, self.ep = pp, dp, ep
        self.params = {
            (stage, name): nn.Parameter(value.clone())
            for stage in range(pp)
            for name, value in _global_params(stage).items()
            if name != "frozen"
        }
        groups = [
            [p for (_, name), p in self.params.items() if decay_matrices(name, p) == decays]
            for decays in (True, False)
        ]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": groups[0], "weight_decay": HYPER["weight_decay"]},
                {"params": groups[1], "weight_decay": 0.0},
            ],
            lr=LRS[0],
            betas=HYPER["betas"],
            eps=HYPER["eps"],
            fused=True,
        )

    def step(self, step: int, lr: float, max_norm: float) -> float:
        for p in self.params.values():
            p.grad = torch.zeros_like(p)
        for rank in range(self.pp * self.dp):
            stage, dp_rank = divmod(rank, self.dp)
            rows = _rows(dp_rank % self.ep, self.ep)
            model = _Model(EXPERTS // self.ep)
            for micro in range(2):
                for name, c in _coefficients(rank, step, micro, model).items():
                    grad = self.params[stage, name].grad
                    if name.startswith("experts"):
                        grad[rows] += c
                    else:
                        grad += c
        grads = [p.grad for p in self.params.values()]
        norm = sum(g.double().square().sum() for g in grads).sqrt()
        torch_norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), float("inf"))
        assert float(torch_norm) == pytest.approx(float(norm), rel=1e-6)
        if max_norm != float("inf"):
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0).float()
            for g in grads:
                g.mul_(scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return float(norm)

    def state(self, stage: int, name: str, kind: str) -> Tensor:
        p = self.params[stage, name]
        return p.detach() if kind == "param" else self.optimizer.state[p][kind]


def _global_pieces(
    optimizer: DistributedAdamW, model: nn.Module, ep_rank: int, prefix: str = ""
) -> list[tuple[str, int, dict[str, Tensor]]]:
    """This rank's state pieces as (global name, global flat start, {kind: values})."""
    params = dict(model.named_parameters())
    pieces = []
    for piece in optimizer.state_pieces():
        p = params[piece.name]
        start = piece.flat_start + (ep_rank * p.numel() if is_expert_parameter(p) else 0)
        values = {kind: getattr(piece, kind).clone() for kind in KINDS}
        pieces.append((prefix + piece.name, start, values))
    return pieces


def _run(rank: int, pp: int, ep: int, bucket_bytes: int) -> dict:
    """Three steps at this layout; returns the norms, this rank's weights after each step and
    its final state pieces, for `_compare_with_reference` (in the parent process: importing
    torch.optim's machinery costs seconds per process)."""
    layout = world_layout(pp=pp, ep=ep)
    stage = layout.pp_rank
    model = _local_model(_global_params(stage), layout.ep_rank, ep)
    optimizer = DistributedAdamW(model, layout, lr=LRS[0], bucket_bytes=bucket_bytes, **HYPER)
    norms, weights = [], []
    for step, (lr, max_norm) in enumerate(zip(LRS, CLIPS, strict=True)):
        _backward(model, _coefficients(rank, step, 0, model))
        if step > 0:  # step 0 reduces after the backward (inside clip_grad_norm_)
            optimizer.arm()
        _backward(model, _coefficients(rank, step, 1, model))
        if step > 0 and rank == 0:  # every gradient arrived: all reductions started in backward
            assert all(p.grad is None for p in model.parameters()), "a bucket waited for finish"
        if step > 0:
            optimizer.finish()
            assert all(p.grad is None for p in model.parameters()), "finish keeps .grad"
        norms.append(float(optimizer.clip_grad_norm_(max_norm)))
        optimizer.step(lr)
        optimizer.zero_grad()
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert optimizer.step_count == len(LRS)
    params = dict(model.named_parameters())
    for piece in optimizer.state_pieces():  # FP32 parameters are their own master weights
        _assert_views_parameter(piece.param, params[piece.name], piece.flat_start)
    prefix = f"stage{stage}." if pp > 1 else ""
    return {
        "layout": (pp, layout.dp, ep, stage, layout.ep_rank),
        "norms": norms,
        "weights": weights,
        "pieces": _global_pieces(optimizer, model, layout.ep_rank, prefix),
        "state_bytes": optimizer.state_bytes(),
        "pp": pp,
    }


def _assert_views_parameter(master: Tensor, param: Tensor, flat_start: int) -> None:
    """`master` is the live range of `param` that starts at element `flat_start`."""
    assert master.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
    offset = master.storage_offset() - param.storage_offset()
    assert offset == flat_start and master.is_contiguous(), (offset, flat_start)


def _compare_with_reference(results: list[dict]) -> None:
    """Every rank's norms, weights and state equal the single-process reference (norms to
    the rounding of the per-tensor fp32 norms they are summed from, updates to float32
    rounding)."""
    pp, dp, ep, *_ = results[0]["layout"]
    reference = _Reference(pp, dp, ep)
    for step, (lr, max_norm) in enumerate(zip(LRS, CLIPS, strict=True)):
        expected_norm = reference.step(step, lr, max_norm)
        for rank, result in enumerate(results):
            assert result["norms"][step] == pytest.approx(expected_norm, rel=1e-7), rank
            _, _, _, stage, ep_rank = result["layout"]
            for name, weight in result["weights"][step].items():
                if name == "frozen":
                    assert torch.equal(weight, _global_params(stage)[name])
                    continue
                want = reference.state(stage, name, "param")
                want = want[_rows(ep_rank, ep)] if name.startswith("experts") else want
                label = f"rank {rank} step {step} {name}"
                assert_close_report(weight, want, **UPDATE_TOL, name=label)
    for rank, result in enumerate(results):
        stage = result["layout"][3]
        for name, start, values in result["pieces"]:
            for kind, value in values.items():
                want = reference.state(stage, name.split(".", 1)[-1] if pp > 1 else name, kind)
                want = want.reshape(-1)[start : start + value.numel()]
                label = f"rank {rank} {kind} {name}"
                assert_close_report(value, want, **UPDATE_TOL, name=label)


def _reader(state: dict[str, dict[str, Tensor]], model: nn.Module, ep_rank: int):
    """`read` for load_state: slices of the global tensors in `state`."""
    params = dict(model.named_parameters())

    def read(requests: list[StateRequest]) -> list[Tensor]:
        out = []
        for r in requests:
            p = params[r.name]
            start = r.flat_start + (ep_rank * p.numel() if is_expert_parameter(p) else 0)
            out.append(state[r.name][r.kind].reshape(-1)[start : start + r.numel])
        return out

    return read


def _assemble(results: list[dict]) -> dict[str, dict[str, Tensor]]:
    """Global tensors from every rank's pieces, checking that the pieces cover every element
    equally often (once per replica of its reduction group)."""
    pp = results[0]["pp"]
    shapes = {
        (f"stage{stage}.{name}" if pp > 1 else name): value.shape
        for stage in range(pp)
        for name, value in _global_params(stage).items()
        if name != "frozen"
    }
    state = {n: {k: torch.full(s, float("nan")) for k in KINDS} for n, s in shapes.items()}
    counts = {n: torch.zeros(s, dtype=torch.int64).reshape(-1) for n, s in shapes.items()}
    for result in results:
        for name, start, values in result["pieces"]:
            counts[name][start : start + values["param"].numel()] += 1
            for kind, value in values.items():
                state[name][kind].view(-1)[start : start + value.numel()] = value
    for name, count in counts.items():
        assert count.min() == count.max() >= 1, f"{name}: pieces cover elements unevenly"
    return state


def _assert_same_state(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        for kind in KINDS:
            assert torch.equal(actual[name][kind], expected[name][kind]), (name, kind)


MUON_MATRICES = ("embed", "proj.weight", "experts_up", "experts_down")
"""What Muon updates in the Muon runs (AdamW: the norm, the bias, `odd`)."""


def _muon(model: nn.Module, layout: Layout, distributed: bool):
    optimizer_class = DistributedMuon if distributed else ReplicatedMuon
    return optimizer_class(
        model,
        layout,
        lr=LRS[0],
        orthogonalized=lambda name, p: name in MUON_MATRICES,
        ns_dtype=torch.float32,
        adamw_lr_ratio=0.5,
        **HYPER,
    )


def _train_muon(model: nn.Module, optimizer, ranks: range) -> None:
    """Three steps, each the sum of two micro-batches of every rank in `ranks`."""
    for step, (lr, max_norm) in enumerate(zip(LRS, CLIPS, strict=True)):
        for rank in ranks:
            for micro in range(2):
                _backward(model, _coefficients(rank, step, micro, model))
        optimizer.clip_grad_norm_(max_norm)
        optimizer.step(lr)
        optimizer.zero_grad()


def _run_muon(rank: int) -> dict:
    """DistributedMuon at dp4 (dense and expert matrices owned over four ranks): its
    weights after three steps, its state bytes and its momentum pieces."""
    layout = world_layout(pp=1, ep=1)
    model = _local_model(_global_params(0), 0, 1)
    optimizer = _muon(model, layout, distributed=True)
    _train_muon(model, optimizer, range(rank, rank + 1))
    return {
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state_bytes": optimizer.state_bytes(),
        "momentum": [
            (p.name, p.flat_start, p.momentum.clone())
            for p in optimizer.state_pieces()
            if p.momentum is not None
        ],
    }


def _world_four(rank: int, world_size: int) -> dict:
    results = {
        "muon": _run_muon(rank),
        "dp4": _run(rank, pp=1, ep=1, bucket_bytes=2**20),
        "dp4_ep2": _run(rank, pp=1, ep=2, bucket_bytes=64),
        "pp2_ep2": _run(rank, pp=2, ep=2, bucket_bytes=2**20),  # experts: groups of one
        "pp2": _run(rank, pp=2, ep=1, bucket_bytes=64),
    }
    # The dp=4 state as global tensors, loaded at dp=2 with ep=2 (in each of two stages)
    # into other weights.
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, results["dp4"])
    saved = _assemble(everyone)
    layout = world_layout(pp=2, ep=2)
    model = _local_model(_global_params(7), layout.ep_rank, 2)
    optimizer = DistributedAdamW(model, layout, lr=LRS[0], **HYPER)
    optimizer.load_state(len(LRS), _reader(saved, model, layout.ep_rank))
    assert optimizer.step_count == len(LRS)
    rows = _rows(layout.ep_rank, 2)
    for name, p in model.named_parameters():
        if p.requires_grad:
            want = saved[name]["param"]
            assert torch.equal(p, want[rows] if is_expert_parameter(p) else want), name
    results["loaded"] = {"pieces": _global_pieces(optimizer, model, layout.ep_rank), "pp": 1}
    # Replicas must hold the same structure: a parameter only rank 1 has is refused on all.
    model = _Model(EXPERTS)
    if rank == 1:
        model.extra = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="dense parameters differ between the ranks"):
        DistributedAdamW(model, world_layout(pp=1, ep=1), lr=1e-3)
    return results


@pytest.fixture(scope="module")
def world_four() -> list[dict]:
    return run_distributed(_world_four, world_size=4)


@pytest.mark.parametrize("key", ["dp4", "dp4_ep2", "pp2_ep2", "pp2"])
def test_every_layout_takes_the_single_process_adamw_steps(world_four, key):
    _compare_with_reference([r[key] for r in world_four])
    _assemble([r[key] for r in world_four])  # the pieces partition every tensor


def test_state_is_sharded_over_each_group(world_four):
    # FP32 parameters: 8 bytes (two moments, no master copy) for each element of a rank's
    # shards, padding included; 55 dense and 6 * 22 expert elements in all.
    assert [r["dp4"]["state_bytes"] for r in world_four] == [8 * (14 + 33)] * 4
    assert [r["pp2_ep2"]["state_bytes"] for r in world_four] == [8 * (28 + 66)] * 4


def test_state_saved_at_dp4_loads_at_dp2_with_ep2_exactly(world_four):
    saved = _assemble([r["dp4"] for r in world_four])
    for stage in range(2):  # each stage of the pp=2 layout loaded the whole state
        loaded = _assemble([r["loaded"] for r in world_four[2 * stage : 2 * stage + 2]])
        _assert_same_state(loaded, saved)


def test_state_saved_at_dp4_loads_in_one_process_and_steps_like_torch_adamw(world_four):
    saved = _assemble([r["dp4"] for r in world_four])
    model = _local_model(_global_params(7), 0, 1)
    optimizer = DistributedAdamW(model, single_process_layout(), lr=LRS[0], **HYPER)
    optimizer.load_state(len(LRS), _reader(saved, model, 0))
    pieces = optimizer.state_pieces()
    assert sorted(p.name for p in pieces) == sorted(saved)
    for piece in pieces:  # one process owns every parameter whole
        assert piece.flat_start == 0
        for kind in KINDS:
            assert torch.equal(getattr(piece, kind), saved[piece.name][kind].reshape(-1))
    reference = _Reference(1, 1, 1)
    for (_, name), p in reference.params.items():
        with torch.no_grad():
            p.copy_(saved[name]["param"])
        assert torch.equal(dict(model.named_parameters())[name], p)
        reference.optimizer.state[p] = {
            "step": torch.tensor(float(len(LRS))),
            "exp_avg": saved[name]["exp_avg"].clone(),
            "exp_avg_sq": saved[name]["exp_avg_sq"].clone(),
        }
    step, lr = len(LRS), 3e-2
    for micro in range(2):
        _backward(model, _coefficients(0, step, micro, model))
    optimizer.step(lr)  # reduces first (no finish was called)
    reference.step(step, lr, float("inf"))
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert_close_report(p, reference.state(0, name, "param"), **UPDATE_TOL, name=name)


def test_low_precision_parameters_keep_fp32_masters():
    model = _local_model(_global_params(0), 0, 1).to(torch.bfloat16)
    optimizer = DistributedAdamW(model, single_process_layout(), lr=1e-2, **HYPER)
    assert optimizer.state_bytes() == 12 * (55 + 6 * 22)  # master weights and two moments
    masters = {p.name: p.param.clone() for p in optimizer.state_pieces()}
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(masters[name], p.detach().float().reshape(-1))
    for _ in range(2):
        _backward(model, {n: c.bfloat16() for n, c in _coefficients(0, 0, 0, model).items()})
        optimizer.step()
        optimizer.zero_grad()
    params = dict(model.named_parameters())
    for piece in optimizer.state_pieces():
        assert piece.param.dtype == torch.float32
        assert torch.equal(params[piece.name].detach().reshape(-1), piece.param.bfloat16())
        # Updates below bf16 resolution accumulate in the master, not in the parameter.
    assert any(
        not torch.equal(p.param, p.param.bfloat16().float()) for p in optimizer.state_pieces()
    )


def test_fp32_parameters_are_updated_in_place_without_master_copies():
    model = _local_model(_global_params(0), 0, 1)
    optimizer = DistributedAdamW(model, single_process_layout(), lr=LRS[0], **HYPER)
    assert optimizer.state_bytes() == 8 * (55 + 6 * 22)  # two moments, no master weights
    params = dict(model.named_parameters())
    storages = {name: p.untyped_storage().data_ptr() for name, p in params.items()}
    reference = _Reference(1, 1, 1)
    for step, (lr, max_norm) in enumerate(zip(LRS, CLIPS, strict=True)):
        for micro in range(2):
            _backward(model, _coefficients(0, step, micro, model))
        optimizer.clip_grad_norm_(max_norm)
        optimizer.step(lr)
        optimizer.zero_grad()
        reference.step(step, lr, max_norm)
    for piece in optimizer.state_pieces():
        _assert_views_parameter(piece.param, params[piece.name], piece.flat_start)
        for kind in KINDS:
            want = reference.state(0, piece.name, kind).reshape(-1)
            assert_close_report(getattr(piece, kind), want, **UPDATE_TOL, name=piece.name)
    assert all(p.untyped_storage().data_ptr() == storages[n] for n, p in params.items())
    # Writing a piece's master weights writes the parameter.
    piece = optimizer.state_pieces()[0]
    piece.param.fill_(0.25)
    assert torch.all(params[piece.name].reshape(-1)[: piece.param.numel()] == 0.25)


def test_non_contiguous_fp32_parameters_keep_master_copies():
    model = nn.Module()
    model.weight_t = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(5)).t())
    assert not model.weight_t.is_contiguous()
    reference = nn.Parameter(model.weight_t.detach().contiguous())
    optimizer = DistributedAdamW(model, single_process_layout(), lr=1e-2, **HYPER)
    torch_adamw = torch.optim.AdamW([reference], lr=1e-2, fused=True, **HYPER)
    assert optimizer.state_bytes() == 12 * 12  # master weights and two moments
    gradient = torch.randint(-8, 9, (4, 3), generator=torch.Generator().manual_seed(6)) / 8
    for _ in range(2):
        (model.weight_t * gradient).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        reference.grad = gradient.clone()
        torch_adamw.step()
    assert_close_report(model.weight_t, reference, **UPDATE_TOL, name="weight_t")
    (piece,) = optimizer.state_pieces()
    assert torch.equal(piece.param, model.weight_t.detach().reshape(-1))


def test_bad_input_is_refused_clearly():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="module Linear has no parameters that require grad"):
        DistributedAdamW(frozen, single_process_layout(), lr=1e-3)
    model = _Model(EXPERTS)
    unbuilt = Layout(2, 0, 1, 2, 1, None, None, None, None)
    with pytest.raises(ValueError, match=re.escape("layout.dp=2 but layout.dp_group is None")):
        DistributedAdamW(model, unbuilt, lr=1e-3)
    layout = single_process_layout()
    for kwargs, message in (
        ({"lr": -1.0}, "lr=-1.0 must be non-negative"),
        ({"lr": 1e-3, "betas": (0.9, 1.0)}, "betas=(0.9, 1.0) must be two numbers in [0, 1)"),
        ({"lr": 1e-3, "eps": 0.0}, "eps=0.0 must be positive"),
        ({"lr": 1e-3, "weight_decay": -0.1}, "weight_decay=-0.1 must be non-negative"),
        ({"lr": 1e-3, "bucket_bytes": 0}, "bucket_bytes=0 must be at least 1"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            DistributedAdamW(model, layout, **kwargs)
    optimizer = DistributedAdamW(model, layout, lr=1e-3)
    with pytest.raises(ValueError, match=re.escape("max_norm=0.0 must be positive")):
        optimizer.clip_grad_norm_(0.0)
    with pytest.raises(ValueError, match="read returned 1 elements for StateRequest"):
        optimizer.load_state(1, lambda requests: [torch.zeros(1) for _ in requests])
    with pytest.raises(ValueError, match="read returned 0 tensors for"):
        optimizer.load_state(1, lambda requests: [])
    # A backward after the step's reduction, without zero_grad, would be lost: refused.
    _backward(model, _coefficients(0, 0, 0, model))
    optimizer.step()
    _backward(model, _coefficients(0, 1, 0, model))
    with pytest.raises(ValueError, match=re.escape("call zero_grad() after each step")):
        optimizer.step()


def test_distributed_muon_at_dp4_takes_the_replicated_steps(world_four):
    model = _local_model(_global_params(0), 0, 1)
    optimizer = _muon(model, single_process_layout(), distributed=False)
    _train_muon(model, optimizer, range(4))  # the gradients of all four ranks, summed
    for rank, result in enumerate(world_four):
        for name, p in model.named_parameters():
            label = f"rank {rank} {name}"
            assert_close_report(result["muon"]["weights"][name], p, **UPDATE_TOL, name=label)
    # Every momentum element lies on exactly one rank, and equals the replicated one.
    counts = {n: torch.zeros(dict(model.named_parameters())[n].numel()) for n in MUON_MATRICES}
    for rank, result in enumerate(world_four):
        for name, start, momentum in result["muon"]["momentum"]:
            counts[name][start : start + momentum.numel()] += 1
            want = optimizer.state_pieces()  # the replicated optimizer: whole tensors
            want = next(p.momentum for p in want if p.name == name)[
                start : start + momentum.numel()
            ]
            assert_close_report(momentum, want, **UPDATE_TOL, name=f"rank {rank} momentum {name}")
    assert all(torch.all(c == 1) for c in counts.values()), counts


def test_distributed_muon_state_per_rank_is_a_quarter_plus_the_largest_matrix(world_four):
    """At dp4 a rank holds at most 1/4 of the replicated state plus the largest Muon matrix
    (and the padding of AdamW's shards: under one element per rank and bucket)."""
    params = dict(_Model(EXPERTS).named_parameters())
    matrices = [
        p[e].numel() if is_expert_parameter(p) else p.numel()
        for name in MUON_MATRICES
        for p in (params[name],)
        for e in range(p.shape[0] if is_expert_parameter(p) else 1)
    ]
    adamw = sum(p.numel() for n, p in params.items() if n not in MUON_MATRICES and p.requires_grad)
    replicated = 4 * sum(matrices) + 8 * adamw
    largest = 4 * max(matrices)
    adamw_padding = 8 * 2  # a dense and an expert bucket
    held = [r["muon"]["state_bytes"] for r in world_four]
    assert max(held) <= replicated / 4 + largest + adamw_padding, (held, replicated, largest)
    assert min(held) > 0
