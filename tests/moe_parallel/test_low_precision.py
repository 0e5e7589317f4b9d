"""bfloat16 parameters: both optimizers accumulate gradients in FP32, step FP32 master weights
with torch's AdamW (the parameters are the masters rounded), agree at every layout, and
checkpoint the masters so that any layout and either optimizer resumes them exactly (gloo on
the CPU).

Per-micro-batch gradients are bfloat16 values k/64 with 128 <= |k| < 256 (8 significant
bits): their FP32 sums are exact in any order, while bfloat16 sums of them are rounded.
Updates: the fused kernel's vector and scalar paths may round differently where a shard cuts
a tensor, so masters agree to float32 rounding (`UPDATE_TOL`) and parameters to one bfloat16
step (`PARAM_TOL`); state that is only moved (saved, loaded) must be equal bit for bit.
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
    GradientReducer,
    ReplicatedAdamW,
    StateRequest,
    decay_matrices,
    is_expert_parameter,
    mark_expert_parameter,
    single_process_layout,
)
from world_layout import world_layout

EXPERTS = 4
MICRO = 4
HYPER = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
LRS = (1e-3, 2e-3, 1e-3)  # below a bfloat16 step of weights near 1: masters matter
CLIPS = (float("inf"), 1.0, float("inf"))  # the middle step is clipped hard
KINDS = ("param", "exp_avg", "exp_avg_sq")
UPDATE_TOL = {"rtol": 1e-6, "atol": 1e-7}
PARAM_TOL = {"rtol": 2**-8, "atol": 1e-7}
OPTIMIZERS = {"replicated": ReplicatedAdamW, "distributed": DistributedAdamW}


class _Model(nn.Module):
    """bfloat16 dense weights (a matrix, an odd-length vector), an FP32 vector, and a bfloat16
    expert weight of `local_experts`: 32 bfloat16 + 3 FP32 dense elements, 15 per expert."""

    def __init__(self, local_experts: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(5, 5, dtype=torch.bfloat16))
        self.norm = nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))
        self.router = nn.Parameter(torch.zeros(3))
        self.experts = mark_expert_parameter(
            nn.Parameter(torch.zeros(local_experts, 5, 3, dtype=torch.bfloat16))
        )


def _global_values(seed: int = 0) -> dict[str, Tensor]:
    """Every weight of the model (every expert), fresh random values in its dtype."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(p.shape, generator=generator).to(p.dtype)
        for name, p in _Model(EXPERTS).named_parameters()
    }


def _rows(ep_rank: int, ep: int) -> slice:
    local = EXPERTS // ep
    return slice(ep_rank * local, (ep_rank + 1) * local)


def _local_model(values: dict[str, Tensor], ep_rank: int, ep: int) -> _Model:
    model = _Model(EXPERTS // ep)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name][_rows(ep_rank, ep)] if is_expert_parameter(p) else values[name])
    return model


def _micro_grads(rank: int, step: int, micro: int, model: nn.Module) -> dict[str, Tensor]:
    """This rank's gradient of one micro-batch, in each parameter's dtype (exactly)."""
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    grads = {}
    for name, p in model.named_parameters():
        k = torch.randint(128, 256, p.shape, generator=generator).float()
        sign = torch.randint(0, 2, p.shape, generator=generator).float() * 2 - 1
        grads[name] = (sign * k / 64).to(p.dtype)
    return grads


def _backward(model: nn.Module, grads: dict[str, Tensor]) -> None:
    params = dict(model.named_parameters())
    sum((params[name] * g).sum().float() for name, g in grads.items()).backward()


def _global_start(model: nn.Module, name: str, flat_start: int, ep_rank: int) -> int:
    p = dict(model.named_parameters())[name]
    return flat_start + (ep_rank * p.numel() if is_expert_parameter(p) else 0)


def _train(rank: int, ep: int, kind: str) -> dict:
    """Three steps of `MICRO` micro-batches; returns this rank's reduced gradients, norms,
    weights after each step, final state pieces (global coordinates) and state bytes."""
    layout = world_layout(pp=1, ep=ep)
    model = _local_model(_global_values(), layout.ep_rank, ep)
    optimizer = OPTIMIZERS[kind](model, layout, lr=LRS[0], **HYPER)
    ep_rank = layout.ep_rank
    out: dict = {"ep": ep, "ep_rank": ep_rank, "grads": [], "norms": [], "weights": []}
    out["bytes_before"] = optimizer.state_bytes()
    for step, (lr, max_norm) in enumerate(zip(LRS, CLIPS, strict=True)):
        for micro in range(MICRO):
            if micro == MICRO - 1:
                optimizer.arm()
            _backward(model, _micro_grads(rank, step, micro, model))
            # A bfloat16 gradient lives only until it is added into the FP32 buffer.
            assert all(p.grad is None for p in model.parameters() if p.dtype != torch.float32)
        optimizer.finish()
        out["grad_bytes"] = optimizer.gradient_bytes()
        out["grads"].append(
            [
                (piece.name, _global_start(model, piece.name, piece.flat_start, ep_rank), g.clone())
                for piece, g in zip(optimizer.state_pieces(), optimizer.grad_pieces(), strict=True)
            ]
        )
        out["norms"].append(float(optimizer.clip_grad_norm_(max_norm)))
        optimizer.step(lr)
        optimizer.zero_grad()
        out["weights"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    out["pieces"] = _pieces(optimizer, model, layout.ep_rank)
    out["bytes_after"] = optimizer.state_bytes()
    return out


def _pieces(optimizer, model: nn.Module, ep_rank: int) -> list[tuple[str, int, dict]]:
    """This rank's state pieces in global coordinates, after checking that each parameter
    holds its master weights rounded to its dtype."""
    params = dict(model.named_parameters())
    pieces = []
    for piece in optimizer.state_pieces():
        p = params[piece.name]
        assert piece.param.dtype == torch.float32, piece.name
        live = p.detach().reshape(-1)[piece.flat_start : piece.flat_start + piece.param.numel()]
        assert torch.equal(live, piece.param.to(p.dtype)), piece.name
        values = {kind: getattr(piece, kind).clone() for kind in KINDS}
        start = _global_start(model, piece.name, piece.flat_start, ep_rank)
        pieces.append((piece.name, start, values))
    return pieces


def _assemble(results: list[list[tuple[str, int, dict]]]) -> dict[str, dict[str, Tensor]]:
    """Global FP32 state from every rank's pieces, checking that they cover every element."""
    shapes = {name: value.shape for name, value in _global_values().items()}
    state = {n: {k: torch.full(s, float("nan")) for k in KINDS} for n, s in shapes.items()}
    counts = {n: torch.zeros(s, dtype=torch.int64).reshape(-1) for n, s in shapes.items()}
    for pieces in results:
        for name, start, values in pieces:
            counts[name][start : start + values["param"].numel()] += 1
            for kind, value in values.items():
                state[name][kind].view(-1)[start : start + value.numel()] = value
    for name, count in counts.items():
        assert count.min() == count.max() >= 1, f"{name}: pieces cover elements unevenly"
    return state


def _reader(state: dict[str, dict[str, Tensor]], model: nn.Module, ep_rank: int, log: list):
    """`read` for load_state: slices of the global tensors in `state`; logs the kinds."""

    def read(requests: list[StateRequest]) -> list[Tensor]:
        log.extend((r.name, r.kind) for r in requests)
        return [
            state[r.name][r.kind].reshape(-1)[start : start + r.numel]
            for r in requests
            for start in (_global_start(model, r.name, r.flat_start, ep_rank),)
        ]

    return read


def _load(kind: str, saved: dict, ep: int) -> dict:
    """A fresh optimizer of `kind` at ep (dp 2) over other weights, loaded from `saved`."""
    layout = world_layout(pp=1, ep=ep)
    model = _local_model(_global_values(seed=7), layout.ep_rank, ep)
    if kind == "replicated":  # it reads no FP32 weights: a trainer loads them beforehand
        with torch.no_grad():
            model.router.copy_(saved["router"]["param"])
    optimizer = OPTIMIZERS[kind](model, layout, lr=LRS[0], **HYPER)
    requested: list = []
    optimizer.load_state(len(LRS), _reader(saved, model, layout.ep_rank, requested))
    assert optimizer.step_count == len(LRS)
    return {"pieces": _pieces(optimizer, model, layout.ep_rank), "requested": requested}


def _world_two(rank: int, world_size: int) -> dict:
    gathered_dtypes: list[torch.dtype] = []
    all_gather = dist.all_gather_into_tensor

    def recording_all_gather(output, input, *args, **kwargs):
        gathered_dtypes.append(input.dtype)
        return all_gather(output, input, *args, **kwargs)

    dist.all_gather_into_tensor = recording_all_gather
    try:
        results = {(kind, ep): _train(rank, ep, kind) for kind in OPTIMIZERS for ep in (1, 2)}
    finally:
        dist.all_gather_into_tensor = all_gather
    results["gathered_dtypes"] = sorted(set(map(str, gathered_dtypes)))
    # Each optimizer's dp=2 state (ep=1) loads into the other at ep=2.
    for saver, loader in (("replicated", "distributed"), ("distributed", "replicated")):
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, results[saver, 1]["pieces"])
        results["loaded", saver, loader] = _load(loader, _assemble(everyone), ep=2)
    return results


@pytest.fixture(scope="module")
def world_two() -> list[dict]:
    return run_distributed(_world_two, world_size=2)


class _Reference:
    """torch.optim.AdamW(fused=True) on whole FP32 master weights, fed the FP32 sums of all
    ranks' bfloat16 gradients, clipped by the float64 global norm."""

    def __init__(self, ep: int, values: dict[str, Tensor], world_size: int = 2) -> None:
        self.ep, self.world_size = ep, world_size
        self.masters = {n: nn.Parameter(v.float()) for n, v in values.items()}
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for n, p in self.masters.items() if decay_matrices(n, p)]},
                {
                    "params": [p for n, p in self.masters.items() if not decay_matrices(n, p)],
                    "weight_decay": 0.0,
                },
            ],
            lr=LRS[0],
            fused=True,
            **HYPER,
        )

    def gradients(self, step: int, dtype: torch.dtype) -> dict[str, Tensor]:
        """The summed gradients, each addition rounded to `dtype`."""
        sums = {n: torch.zeros_like(p, dtype=dtype) for n, p in self.masters.items()}
        for rank in range(self.world_size):
            ep_rank = rank % self.ep
            model = _Model(EXPERTS // self.ep)
            for micro in range(MICRO):
                for name, g in _micro_grads(rank, step, micro, model).items():
                    target = (
                        sums[name][_rows(ep_rank, self.ep)] if name == "experts" else sums[name]
                    )
                    target += g.to(dtype)
        return sums

    def step(self, step: int, lr: float, max_norm: float) -> float:
        grads = self.gradients(step, torch.float32)
        norm = sum(g.double().square().sum() for g in grads.values()).sqrt()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0).float()
        for name, p in self.masters.items():
            p.grad = grads[name] * scale if max_norm != float("inf") else grads[name]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return float(norm)

    def state(self, name: str, kind: str) -> Tensor:
        p = self.masters[name]
        return p.detach() if kind == "param" else self.optimizer.state[p][kind]


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("kind", ["replicated", "distributed"])
def test_bf16_gradients_accumulate_in_fp32_and_step_fp32_masters(world_two, kind, ep):
    results = [r[kind, ep] for r in world_two]
    reference = _Reference(ep, _global_values())
    for step, (lr, max_norm) in enumerate(zip(LRS, CLIPS, strict=True)):
        exact = reference.gradients(step, torch.float32)
        in_bf16 = reference.gradients(step, torch.bfloat16)
        assert any(not torch.equal(in_bf16[n].float(), exact[n]) for n in exact), "bf16 exact"
        expected_norm = reference.step(step, lr, max_norm)
        for rank, result in enumerate(results):
            for name, start, grad in result["grads"][step]:
                want = exact[name].reshape(-1)[start : start + grad.numel()]
                assert grad.dtype == torch.float32, name
                assert torch.equal(grad, want), f"rank {rank} step {step} {name} gradient"
            assert result["norms"][step] == pytest.approx(expected_norm, rel=1e-6)
            for name, weight in result["weights"][step].items():
                want = reference.state(name, "param")
                want = want[_rows(result["ep_rank"], ep)] if name == "experts" else want
                label = f"rank {rank} step {step} {name}"
                assert_close_report(weight.float(), want, **PARAM_TOL, name=label)
    for rank, result in enumerate(results):
        for name, start, values in result["pieces"]:
            for state_kind, value in values.items():
                want = reference.state(name, state_kind).reshape(-1)[start : start + value.numel()]
                label = f"rank {rank} {state_kind} {name}"
                assert_close_report(value, want, **UPDATE_TOL, name=label)
    # Updates below a bfloat16 step accumulated in the masters, not lost.
    master = _assemble([r["pieces"] for r in results])["embed"]["param"]
    assert not torch.equal(master, master.bfloat16().float())


@pytest.mark.parametrize("ep", [1, 2])
def test_replicated_and_distributed_masters_agree(world_two, ep):
    replicated = _assemble([r["replicated", ep]["pieces"] for r in world_two])
    distributed = _assemble([r["distributed", ep]["pieces"] for r in world_two])
    for name in replicated:
        for kind in KINDS:
            label = f"ep={ep} {kind} {name}"
            assert_close_report(
                distributed[name][kind], replicated[name][kind], **UPDATE_TOL, name=label
            )


def test_distributed_all_gather_moves_the_parameters_dtype(world_two):
    # bfloat16 buckets gather 2 bytes an element; the FP32 router gathers its own dtype.
    assert world_two[0]["gathered_dtypes"] == ["torch.bfloat16", "torch.float32"]


def test_state_bytes_count_masters(world_two):
    # ReplicatedAdamW: FP32 masters of the bfloat16 elements (4 bytes) from the start, two
    # moments (8 bytes) of every element once stepped.
    for ep, local_bf16, local_all in ((1, 32 + 60, 35 + 60), (2, 32 + 30, 35 + 30)):
        result = world_two[0]["replicated", ep]
        assert result["bytes_before"] == 4 * local_bf16
        assert result["bytes_after"] == 4 * local_bf16 + 8 * local_all
    # DistributedAdamW at dp=2: 12 bytes for each element of a bfloat16 shard (16 of the
    # 32 dense; experts: 30 of 60 at ep=1, all 30 local ones at ep=2), 8 for the FP32
    # router's shard (2 of 3, padded).
    for ep in (1, 2):
        for result in world_two:
            assert result["distributed", ep]["bytes_before"] == 12 * (16 + 30) + 8 * 2
            assert result["distributed", ep]["bytes_after"] == 12 * (16 + 30) + 8 * 2


def test_distributed_gradients_take_four_bytes_per_bf16_element(world_two):
    # After the reduction: the FP32 sums of the bfloat16 elements (32 dense, 60 experts at
    # ep=1, 30 local at ep=2), reduce-scattered in place (no separate shard), and the FP32
    # router's reduced shard (2 of 3 elements, padded).
    for ep, local_bf16 in ((1, 32 + 60), (2, 32 + 30)):
        for result in world_two:
            assert result["distributed", ep]["grad_bytes"] == 4 * local_bf16 + 4 * 2


@pytest.mark.parametrize(
    ("saver", "loader"), [("replicated", "distributed"), ("distributed", "replicated")]
)
def test_masters_saved_by_one_optimizer_load_into_the_other_exactly(world_two, saver, loader):
    saved = _assemble([r[saver, 1]["pieces"] for r in world_two])
    loaded = _assemble([r["loaded", saver, loader]["pieces"] for r in world_two])
    for name in saved:
        for kind in KINDS:
            assert torch.equal(loaded[name][kind], saved[name][kind]), (name, kind)
    # ReplicatedAdamW reads the masters of bfloat16 parameters, only moments of FP32 ones.
    if loader == "replicated":
        kinds = {
            name: {k for n, k in world_two[0]["loaded", saver, loader]["requested"] if n == name}
            for name in saved
        }
        assert kinds == {
            "embed": set(KINDS),
            "norm": set(KINDS),
            "experts": set(KINDS),
            "router": {"exp_avg", "exp_avg_sq"},
        }


@pytest.mark.parametrize("kind", ["replicated", "distributed"])
def test_state_saved_at_dp2_resumes_in_one_process_like_the_reference(world_two, kind):
    saved = _assemble([r["distributed", 2]["pieces"] for r in world_two])
    model = _local_model(_global_values(seed=7), 0, 1)
    for name, p in model.named_parameters():  # FP32 parameters are loaded beforehand
        if p.dtype == torch.float32:
            with torch.no_grad():
                p.copy_(saved[name]["param"])
    optimizer = OPTIMIZERS[kind](model, single_process_layout(), lr=LRS[0], **HYPER)
    optimizer.load_state(len(LRS), _reader(saved, model, 0, []))
    reference = _Reference(1, _global_values(), world_size=1)
    for name, p in reference.masters.items():
        with torch.no_grad():
            p.copy_(saved[name]["param"])
        reference.optimizer.state[p] = {
            "step": torch.tensor(float(len(LRS))),
            "exp_avg": saved[name]["exp_avg"].clone(),
            "exp_avg_sq": saved[name]["exp_avg_sq"].clone(),
        }
    step = len(LRS)
    for micro in range(MICRO):
        _backward(model, _micro_grads(0, step, micro, model))
    optimizer.finish()
    optimizer.clip_grad_norm_(1.0)
    optimizer.step(3e-3)
    reference.step(step, 3e-3, 1.0)
    for piece in optimizer.state_pieces():
        for state_kind in KINDS:
            want = reference.state(piece.name, state_kind).reshape(-1)
            assert_close_report(
                getattr(piece, state_kind),
                want,
                **UPDATE_TOL,
                name=f"{kind} {state_kind} {piece.name}",
            )


@pytest.mark.parametrize("kind", ["replicated", "distributed", "reducer"])
def test_one_rank_accumulates_bf16_gradients_in_fp32(kind):
    model = _local_model(_global_values(), 0, 1)
    if kind == "reducer":
        reducer = GradientReducer(model, None, None)
    else:
        optimizer = OPTIMIZERS[kind](model, single_process_layout(), lr=LRS[0], **HYPER)
    for step in range(2):  # the second step starts from zeroed buffers
        exact = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
        in_bf16 = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for micro in range(6):
            grads = _micro_grads(0, step, micro, model)
            _backward(model, grads)
            for name, g in grads.items():
                exact[name] += g.float()
                in_bf16[name] += g
        assert model.embed.grad is None and model.experts.grad is None
        if kind == "reducer":
            reducer.finish()
            got = {n: g.clone() for (_, g), n in zip(reducer.gradients(), exact, strict=True)}
            assert torch.equal(model.router.grad, exact["router"])  # FP32: plain `.grad`
            reducer.zero_grad()
        else:
            optimizer.finish()
            pieces = optimizer.state_pieces()
            grads = optimizer.grad_pieces()
            got = {pc.name: g.clone() for pc, g in zip(pieces, grads, strict=True)}
            optimizer.zero_grad()
        for name, want in exact.items():
            assert got[name].dtype == torch.float32
            assert torch.equal(got[name].reshape(want.shape), want), (step, name)
        assert not torch.equal(in_bf16["embed"].float(), exact["embed"])  # bf16 sums round
    if kind == "reducer":
        assert all(g.abs().sum() == 0 for _, g in reducer.gradients()), "zero_grad"


def test_distributed_refuses_bf16_gradients_after_the_reduction():
    model = _local_model(_global_values(), 0, 1)
    optimizer = DistributedAdamW(model, single_process_layout(), lr=LRS[0], **HYPER)
    _backward(model, _micro_grads(0, 0, 0, model))
    optimizer.step()
    reduced = optimizer.grad_pieces()[0].clone()
    _backward(model, _micro_grads(0, 1, 0, model))  # not added into the reduced buffer
    assert torch.equal(optimizer.grad_pieces()[0], reduced)
    with pytest.raises(ValueError, match=re.escape("call zero_grad() after each step")):
        optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(ValueError, match=re.escape("call finish() first")):
        optimizer.grad_pieces()


def test_sliced_fp32_accumulation_equals_one_add():
    from moe_parallel.grad_sync import CONVERTED_ADD_SLICE, add_converted_

    generator = torch.Generator().manual_seed(0)
    numel = 3 * CONVERTED_ADD_SLICE + 12345  # several slices and a ragged last one
    for shape in [(numel,), (3, numel // 3)]:
        total = torch.randn(shape, generator=generator)
        addend = torch.randn(shape, generator=generator).bfloat16()
        want = total + addend.float()
        add_converted_(total, addend)
        assert torch.equal(total, want)
    small = torch.randn(10, generator=generator)
    want = small + torch.ones(10, dtype=torch.bfloat16).float()
    add_converted_(small, torch.ones(10, dtype=torch.bfloat16))
    assert torch.equal(small, want)
