"""Expert-parallel forward outputs and every gradient equal the single-process model's."""

import pytest
import torch

from harness.ranks import run_distributed
from moe_parallel import GradientReducer, is_expert_parameter
from moe_plan.config import config_from_dict
from moe_train.model import Transformer, apply_recompute, lm_loss
from moe_train.model.exchange_worker import ExchangeWorker
from moe_train.parallelize import (
    apply_exchange_overlap,
    apply_expert_parallel,
    layer_dispatchers,
    materialize,
)
from moe_train.train.runtime import start_runtime

NUM_MICRO, MICRO, SEQ = 8, 2, 16


def _config(ep: int, dispatcher: str):
    """``dispatcher`` may name a rowwise transport, ``rowwise/symmetric_memory``, and end in
    ``+fp8`` for FP8 dispatch (model.moe.dispatch_dtype)."""
    dispatcher, _, dispatch_dtype = dispatcher.partition("+")
    dispatcher, _, transport = dispatcher.partition("/")
    parallel = {"ep": ep, "dispatcher": dispatcher, "rowwise_transport": transport or "all_to_all"}
    return config_from_dict(
        {
            "model": {
                "vocab_size": 64,
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 2,
                "dense_layers": 0,
                "moe": {
                    "num_experts": 8,
                    "top_k": 2,
                    "expert_hidden": 16,
                    "shared_experts": 1,
                    "capacity_factor": 8.0 if dispatcher == "rowwise" else None,
                    "dispatch_dtype": dispatch_dtype or "compute",
                },
            },
            "data": {
                "seq_len": SEQ,
                "global_batch_size": NUM_MICRO * MICRO,
                "micro_batch_size": MICRO,
            },
            "parallel": parallel,
            "precision": {"compute_dtype": "float32"},
        }
    )


def _tokens() -> torch.Tensor:
    return torch.randint(
        0, 64, (NUM_MICRO, MICRO, SEQ + 1), generator=torch.Generator().manual_seed(5)
    )


def _step(model: Transformer, micro_batches: torch.Tensor) -> list[torch.Tensor]:
    logits = []
    model.set_aux_loss_scale(1.0 / NUM_MICRO)
    for micro in micro_batches:
        out = model(micro[:, :-1])
        (lm_loss(out, micro[:, 1:]) / NUM_MICRO).backward()
        logits.append(out.detach())
    return logits


def _expert_parallel_step(
    rank: int,
    world_size: int,
    ep: int,
    dispatcher: str,
    recompute: str = "none",
    overlap: bool = False,
) -> dict:
    """One step of `_config(ep, dispatcher)` on this rank (`overlap`: parallel.ep_overlap)."""
    config = _config(ep, dispatcher)
    runtime = start_runtime(config)
    layout = runtime.layout
    dispatchers = layer_dispatchers(config, runtime.layout.ep_group, runtime.device)
    with torch.device("meta"):
        model = Transformer(config.model)
    apply_expert_parallel(model, dispatchers)
    materialize(model, runtime.device, seed=3)
    apply_recompute(model, recompute)
    if overlap:
        apply_exchange_overlap(model, ExchangeWorker(runtime.device))
    reducer = GradientReducer(model, layout.dp_group, layout.edp_group)
    per_rank = NUM_MICRO // layout.dp
    mine = _tokens()[layout.dp_rank * per_rank : (layout.dp_rank + 1) * per_rank]
    logits = _step(model, mine)
    reducer.finish()
    grads = {}
    for name, p in model.named_parameters():
        if is_expert_parameter(p):
            first = model.get_submodule(name.rsplit(".", 1)[0]).first_expert
            grads[name] = (first, p.grad.clone())
        else:
            grads[name] = (None, p.grad.clone())
    return {"dp_rank": layout.dp_rank, "logits": logits, "grads": grads}


@pytest.fixture(scope="module")
def single_process() -> dict[str, tuple]:
    """Logits and gradients of the single-process model, by dispatch dtype."""
    references = {}
    for dispatch_dtype in ("compute", "fp8"):
        model = Transformer(_config(1, f"local+{dispatch_dtype}").model, seed=3)
        logits = _step(model, _tokens())
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        references[dispatch_dtype] = logits, grads
    return references


def test_fp8_dispatch_rounds_the_rows_the_experts_receive(single_process):
    """The FP8 reference is not the compute-dtype one (else the FP8 cases prove nothing)."""
    compute_logits, _ = single_process["compute"]
    fp8_logits, _ = single_process["fp8"]
    difference = (fp8_logits[0] - compute_logits[0]).abs().max().item()
    assert 1e-4 < difference < 0.1, difference


def _expert_parallel_steps(rank: int, world_size: int, cases: list[tuple]) -> dict:
    return {case: _expert_parallel_step(rank, world_size, *case) for case in cases}


@pytest.mark.parametrize(
    ("world_size", "cases"),
    [
        # Recompute reruns the token exchange in backward, on every rank in the same order.
        (
            2,
            [
                (2, "all_to_all"),
                (2, "rowwise"),
                (2, "all_to_all", "full"),
                (2, "rowwise", "selective"),
                (2, "rowwise/symmetric_memory", "selective"),
                (2, "all_to_all+fp8"),
                (2, "rowwise+fp8"),
                (2, "rowwise/symmetric_memory+fp8"),
                (2, "all_to_all_dedup+fp8"),
                (2, "all_to_all", "none", True),
                (2, "rowwise", "none", True),
                (2, "rowwise/symmetric_memory", "none", True),
                (2, "all_to_all_dedup", "none", True),
                (2, "rowwise/symmetric_memory+fp8", "none", True),
            ],
        ),
        (
            4,
            [
                (2, "all_to_all"),
                (2, "rowwise"),
                (2, "rowwise/symmetric_memory"),
                (4, "all_to_all"),
                (4, "rowwise"),
                (4, "rowwise/symmetric_memory"),
                (2, "all_to_all_dedup"),
                (4, "all_to_all_dedup"),
            ],
        ),
        (8, [(4, "all_to_all"), (4, "rowwise"), (4, "rowwise/symmetric_memory")]),
    ],
    ids=["world2", "world4", "world8"],
)
def test_outputs_and_gradients_match_single_process(single_process, world_size, cases):
    """ep in {2, 4} with dp in {ep, 2 x ep}, the backends (rowwise over both transports,
    all_to_all_dedup at ep 2 and 4 in the world-4 launch); recompute at ep 2; FP8 dispatch
    with every backend that carries it at ep 2."""
    per_case = run_distributed(_expert_parallel_steps, world_size, args=(cases,), timeout=600)
    per_rank = NUM_MICRO // world_size
    for case in cases:
        fp8 = case[1].endswith("+fp8")
        reference_logits, reference_grads = single_process["fp8" if fp8 else "compute"]
        for result in (r[case] for r in per_case):
            for i, logits in enumerate(result["logits"]):
                expected = reference_logits[result["dp_rank"] * per_rank + i]
                torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
            for name, (first, grad) in result["grads"].items():
                expected = reference_grads[name]
                if first is not None:
                    expected = expected[first : first + grad.shape[0]]
                torch.testing.assert_close(
                    grad,
                    expected,
                    rtol=1e-5,
                    atol=1e-7,
                    msg=lambda m, n=name, c=case: f"{c} {n}: {m}",
                )


def _config_error_of_training(dispatcher: str, run_dir: str) -> str:
    """The ConfigError that training on the built-in data at ep 2 stops with, as text."""
    from moe_train.errors import ConfigError
    from moe_train.train import train

    config = _config(2, dispatcher)
    config.data.paths = ["builtin:stdlib"]
    config.train.run_dir = run_dir
    config.model.vocab_size = 320  # the byte-level built-in data
    try:
        train(config)
    except ConfigError as e:
        return str(e)
    return "no error"


def _symmetric_memory_across_hosts(run_dir: str) -> str:
    """Each rank sees only its own shared-memory folder, as ranks on two hosts would."""
    import tempfile
    from pathlib import Path
    from unittest import mock

    import moe_dispatch.transport_symm as transport_symm

    own_folder = Path(tempfile.mkdtemp(prefix="moe-shm-test-"))
    with mock.patch.object(transport_symm, "_shared_memory_folder", lambda: own_folder):
        return _config_error_of_training("rowwise/symmetric_memory", run_dir)


def _dispatch_across_hosts(dispatcher: str) -> tuple:
    """With parallel.rowwise_transport=auto, when the shared memory of the two ranks is not
    the same (two hosts): what runs, why, and the dispatcher class the layers get."""
    import tempfile
    from pathlib import Path
    from unittest import mock

    import moe_dispatch.transport_symm as transport_symm

    config = _config(2, dispatcher)
    config.model.moe.capacity_factor = 8.0
    config.parallel.rowwise_transport = "auto"
    runtime = start_runtime(config)
    own_folder = Path(tempfile.mkdtemp(prefix="moe-shm-test-"))
    with mock.patch.object(transport_symm, "_shared_memory_folder", lambda: own_folder):
        made = layer_dispatchers(config, runtime.layout.ep_group, runtime.device)
    choice = made.choice
    layer = made(0)
    transport = getattr(layer, "transport", None)
    transport_name = transport.name if transport is not None else None
    return choice.dispatcher, choice.transport, choice.why, type(layer).__name__, transport_name


def _deepep_installed() -> bool:
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return False
    return True


def _errors_of_training(rank: int, world_size: int, run_root: str) -> dict[str, str]:
    """Body for `run_distributed`: the errors of the layouts these two ranks cannot run."""
    errors = {"symmetric_memory": _symmetric_memory_across_hosts(f"{run_root}/symmetric_memory")}
    for dispatcher in ("auto", "rowwise"):
        errors[f"{dispatcher} across hosts"] = _dispatch_across_hosts(dispatcher)
    if not _deepep_installed():
        errors["deepep"] = _config_error_of_training("deepep", f"{run_root}/deepep")
    return errors


@pytest.fixture(scope="module")
def errors_on_two_ranks(tmp_path_factory) -> tuple:
    """Run directories root and each rank's errors, from one spawn."""
    root = tmp_path_factory.mktemp("errors")
    return root, run_distributed(_errors_of_training, world_size=2, args=(str(root),))


def test_deepep_without_deepep_is_one_clear_error_on_every_rank(errors_on_two_ranks):
    if _deepep_installed():
        pytest.skip("DeepEP is installed here")
    root, errors = errors_on_two_ranks
    messages = [e["deepep"] for e in errors]
    assert messages[0] == messages[1]
    assert not (root / "deepep").exists()
    assert "DeepEP" in messages[0] and "all_to_all or rowwise" in messages[0]


def test_auto_transport_across_hosts_falls_back_to_the_all_to_all_exchange(errors_on_two_ranks):
    """No peer-memory transport connects: auto dispatch runs all_to_all, rowwise its padded
    all-to-all transport; every rank agrees, and the reason names what failed."""
    _, errors = errors_on_two_ranks
    auto = [e["auto across hosts"] for e in errors]
    rowwise = [e["rowwise across hosts"] for e in errors]
    assert auto[0][:2] == auto[1][:2] == ("all_to_all", None)
    assert auto[0][3] == "AllToAllDispatcher"
    assert auto[0][2].startswith("parallel.dispatcher=auto fell back to all_to_all: no ")
    assert "symmetric_memory: " in auto[0][2] and "share one host" in auto[0][2]
    assert rowwise[0][:2] == rowwise[1][:2] == ("rowwise", "all_to_all")
    assert rowwise[0][3:] == ("RowwiseDispatcher", "all_to_all")
    assert "parallel.rowwise_transport=auto: all_to_all, as no transport" in rowwise[0][2]


def test_symmetric_memory_across_hosts_is_one_clear_error_on_every_rank(errors_on_two_ranks):
    root, errors = errors_on_two_ranks
    messages = [e["symmetric_memory"] for e in errors]
    assert messages[0] == messages[1]
    assert "\n" not in messages[0]
    for words in ("parallel.rowwise_transport", "share one host", "use the all_to_all transport"):
        assert words in messages[0], messages[0]
    assert not (root / "symmetric_memory").exists()


def _overlap_against_one_call(rank: int, world_size: int, dispatchers: list[str]) -> dict:
    """Per dispatcher, at a capacity that drops copies: one step without and with
    parallel.ep_overlap (logits, gradients, and the routing statistics of the MoE layers)."""
    from moe_train.model import Transformer as Model

    out = {}
    for dispatcher in dispatchers:
        for overlap in (False, True):
            config = _config(2, dispatcher)
            config.model.moe.capacity_factor = 0.5
            runtime = start_runtime(config)
            with torch.device("meta"):
                model = Model(config.model)
            apply_expert_parallel(
                model, layer_dispatchers(config, runtime.layout.ep_group, runtime.device)
            )
            materialize(model, runtime.device, seed=3)
            if overlap:
                apply_exchange_overlap(model, ExchangeWorker(runtime.device))
            per_rank = NUM_MICRO // runtime.layout.dp
            rank_rows = slice(
                runtime.layout.dp_rank * per_rank, (runtime.layout.dp_rank + 1) * per_rank
            )
            logits = _step(model, _tokens()[rank_rows])
            stats = [layer.take_stats() for layer in model.moe_layers().values()]
            out[dispatcher, overlap] = {
                "logits": logits,
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "kept": [s.kept_per_expert for s in stats],
                "dropped": [float(s.dropped_copies) for s in stats],
                "routed": [float(s.routed_copies) for s in stats],
            }
    return out


OVERLAP_DISPATCHERS = ["all_to_all", "rowwise", "rowwise/symmetric_memory", "all_to_all_dedup"]


def test_overlap_keeps_and_drops_the_copies_one_call_does():
    """A capacity of half the even share drops copies: with the layer cut into chunks
    (rowwise by slots, the others by tokens) the same copies are kept, the logits and
    gradients agree to fp32 rounding (expert weight gradients summed over two GEMMs)."""
    per_rank = run_distributed(
        _overlap_against_one_call, 2, args=(OVERLAP_DISPATCHERS,), timeout=600
    )
    for result in per_rank:
        for dispatcher in OVERLAP_DISPATCHERS:
            one, chunked = result[dispatcher, False], result[dispatcher, True]
            assert sum(one["dropped"]) > 0, dispatcher
            assert chunked["dropped"] == one["dropped"], dispatcher
            assert chunked["routed"] == one["routed"], dispatcher
            for kept, expected in zip(chunked["kept"], one["kept"], strict=True):
                assert torch.equal(kept, expected), dispatcher
            for got, expected in zip(chunked["logits"], one["logits"], strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            for name, grad in chunked["grads"].items():
                torch.testing.assert_close(
                    grad,
                    one["grads"][name],
                    rtol=1e-5,
                    atol=1e-7,
                    msg=lambda m, n=name, d=dispatcher: f"{d} {n}: {m}",
                )
