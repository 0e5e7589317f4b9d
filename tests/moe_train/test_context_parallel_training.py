"""Context parallelism (parallel.cp) trains as one process does: fp32, the same global and
micro batch, each layout against the single-process losses within 1e-5 relative, with and
without document masking; resumes between cp sizes continue the uninterrupted run. All
layouts of a world size train in one spawn, evaluating as they go. The two-rank spawn also
runs cp2 with bf16 parameters, with Muon, and with the sequence-wise and global-batch
balancing losses, each against its own single-process run (shorter runs)."""

import pytest
from test_document_masking import _short_documents

from harness.ranks import run_distributed
from moe_plan.config import config_from_dict
from moe_train.train import read_metrics, train
from training import (
    FP8_CONTEXT_RTOL,
    FP8_PRECISION,
    assert_fp8_ran,
    assert_losses_match,
    small_config_data,
    train_cases,
    train_cases_with_gemms,
    train_fp8_single,
)

STEPS = 20
RESUMED_AT = 10
FP8_STEPS = 6


def _case(tmp_path, data_dir, name, parallel, masking, **train_section) -> dict:
    data = small_config_data(
        tmp_path / name,
        data_dir,
        model={"vocab_size": 320, "moe": {"bias_update_rate": 0.01}},
        data={"global_batch_size": 4, "micro_batch_size": 2, "document_masking": masking},
        train={"max_steps": STEPS, **train_section},
        parallel=parallel,
        eval={"paths": [str(data_dir)], "interval": RESUMED_AT, "batches": 1},
    )
    return data


@pytest.fixture(scope="module")
def documents_dir(tmp_path_factory):
    return _short_documents(tmp_path_factory.mktemp("cp_docs"))


@pytest.fixture(scope="module")
def single_process(documents_dir, tmp_path_factory):
    """Single-process losses without and with document masking (by masking), and the folder
    of their runs, `single_False` and `single_True`; the unmasked one saves a checkpoint
    halfway (the cp1 -> cp2 resume starts from it)."""
    root = tmp_path_factory.mktemp("cp_single")
    losses = {}
    for masking in (False, True):
        data = _case(root, documents_dir, f"single_{masking}", {}, masking)
        if not masking:
            data["checkpoint"] = SAVES_HALFWAY
        losses[masking] = train(config_from_dict(data)).losses
    return losses, root


def eval_losses(run_dir) -> list[float]:
    """The evaluation losses a run logged, in step order."""
    return [
        row["eval_loss"] for row in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in row
    ]


def assert_evaluations_match(name: str, run_dir, reference_dir) -> None:
    """The run evaluated at steps 10 and 20 as the reference did, within 1e-5 relative."""
    reference = eval_losses(reference_dir)
    assert len(reference) == STEPS // RESUMED_AT, reference
    assert_losses_match(f"{name} eval", eval_losses(run_dir), reference)


def _fp8_case(tmp_path, data_dir, name, parallel, masking=False) -> dict:
    """A case with rowwise FP8 experts and linears, 6 steps, no evaluation."""
    data = _case(tmp_path, data_dir, name, parallel, masking, max_steps=FP8_STEPS)
    data["precision"] = FP8_PRECISION
    data["eval"] = {"interval": 0}
    return data


def _resume_case(tmp_path, data_dir, name, parallel, checkpoint) -> dict:
    data = _case(tmp_path, data_dir, name, parallel, False)
    data["checkpoint"] = {"resume": str(checkpoint), "interval": 0, "interval_minutes": 0}
    return data


SAVES_HALFWAY = {"interval": RESUMED_AT, "interval_minutes": 0, "keep_last": 5}

COMBINATION_STEPS = 8
BF16_RTOL = 2e-3
"""As the bf16-parameter layout tests: the layouts sum FP32 gradients in another order, which
can move a bf16 weight by one step now and then."""
COMBINATIONS = {
    "bf16_params": (
        {"precision": {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"}},
        BF16_RTOL,
    ),
    "muon": ({"optim": {"name": "muon", "muon_ns_dtype": "float32", "lr": 0.02}}, 1e-5),
    # Capacity counts the copies of whole sequences, as one process does (it counted each
    # rank's chunks, which dropped other copies).
    "capacity": ({"model": {"moe": {"capacity_factor": 1.0}}}, 1e-5),
    "lb_sequence": ({"model": {"moe": {"lb_scope": "sequence", "lb_loss_weight": 0.1}}}, 1e-5),
    "lb_global_batch": (
        {"model": {"moe": {"lb_scope": "global_batch", "lb_loss_weight": 0.1}}},
        1e-5,
    ),
}
"""cp2 with each of these (sections merged into the plain case) against one process: name:
(sections, relative tolerance of the losses and of the logged balancing loss)."""


def _combination(tmp_path, data_dir, name, parallel, sections) -> dict:
    data = _case(tmp_path, data_dir, name, parallel, False)
    data["train"]["max_steps"] = COMBINATION_STEPS
    data.pop("eval")
    for section, values in sections.items():
        for key, value in values.items():
            if isinstance(value, dict):
                data[section].setdefault(key, {}).update(value)
            else:
                data.setdefault(section, {})[key] = value
    return data


def lb_losses(run_dir) -> list[float]:
    """The balancing loss a run logged, per step."""
    return [row["lb_loss"] for row in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_cp2_on_two_ranks_matches_single_process(documents_dir, single_process, tmp_path):
    (single, single_masked), single_root = single_process[0].values(), single_process[1]
    single_checkpoint = single_root / "single_False" / "checkpoints" / f"step_{RESUMED_AT:08d}"
    cases = {}
    for masking in (False, True):
        cases[f"cp2_{masking}"] = _case(
            tmp_path, documents_dir, f"cp2_{masking}", {"cp": 2}, masking
        )
    # cp1 -> cp2: a cp2 run resumes the single-process run's checkpoint.
    cases["resume_cp2"] = _resume_case(
        tmp_path, documents_dir, "resume_cp2", {"cp": 2}, single_checkpoint
    )
    for name, (sections, _) in COMBINATIONS.items():
        cases[f"cp2_{name}"] = _combination(
            tmp_path, documents_dir, f"cp2_{name}", {"cp": 2}, sections
        )
    per_rank = run_distributed(train_cases, world_size=2, args=(cases,), timeout=900)
    losses = per_rank[0]
    for name, (sections, rtol) in COMBINATIONS.items():
        one = _combination(tmp_path, documents_dir, f"single_{name}", {}, sections)
        assert_losses_match(
            f"cp2 {name}", losses[f"cp2_{name}"], train(config_from_dict(one)).losses, rtol
        )
        assert_losses_match(
            f"cp2 {name} lb_loss",
            lb_losses(tmp_path / f"cp2_{name}"),
            lb_losses(tmp_path / f"single_{name}"),
            rtol,
        )
    assert_losses_match("cp2", losses["cp2_False"], single)
    assert_losses_match("cp2 masked", losses["cp2_True"], single_masked)
    for masking in (False, True):
        single_dir = single_root / f"single_{masking}"
        assert_evaluations_match(f"cp2 {masking}", tmp_path / f"cp2_{masking}", single_dir)
    assert_losses_match("cp1 -> cp2", losses["resume_cp2"], single[RESUMED_AT:])


@pytest.mark.slow
def test_cp2_with_experts_and_pipelines_on_four_ranks(documents_dir, single_process, tmp_path):
    """cp2 x ep2 (experts spread over the context ranks; with the distributed optimizer and
    full recompute, and with the rowwise dispatcher under masking) and cp2 x pp2 (1f1b with
    selective recompute, and gpipe), each without and with document masking; cp2 x ep2 and
    cp2 x pp2 with rowwise FP8 (experts and linears), and cp2 x ep2 over rowwise under masking
    with FP8, against the single process with FP8 (masked or not), every rank running FP8; then
    a cp1 run (dp2 x pp2) resumes the cp2 x ep2 run's checkpoint."""
    (single, single_masked), single_root = single_process[0].values(), single_process[1]
    single_fp8 = {
        masking: train_fp8_single(
            _fp8_case(tmp_path, documents_dir, f"single_fp8_{masking}", {}, masking)
        )
        for masking in (False, True)
    }
    layouts = {
        "cp2_ep2": (
            {"cp": 2, "ep": 2, "distributed_optimizer": True, "recompute": "full"},
            {"cp": 2, "ep": 2, "dispatcher": "rowwise"},
        ),
        "cp2_pp2": (
            {"cp": 2, "pp": 2, "recompute": "selective"},
            {"cp": 2, "pp": 2, "pp_schedule": "gpipe"},
        ),
    }
    cases = {}
    for name, (plain, masked) in layouts.items():
        cases[name] = _case(tmp_path, documents_dir, name, plain, False)
        cases[f"{name}_masked"] = _case(tmp_path, documents_dir, f"{name}_masked", masked, True)
    cases["cp2_ep2"]["checkpoint"] = SAVES_HALFWAY
    # Rowwise buffers: capacity 4 x the even share is more than any expert can receive.
    cases["cp2_ep2_masked"]["model"]["moe"]["capacity_factor"] = 4.0
    halfway = tmp_path / "cp2_ep2" / "checkpoints" / f"step_{RESUMED_AT:08d}"
    # Two micro-batches a step: dp2 x pp2 (gpipe) is the cp1 layout of four ranks.
    cp1 = {"pp": 2, "pp_schedule": "gpipe"}
    cases["resume_cp1"] = _resume_case(tmp_path, documents_dir, "resume_cp1", cp1, halfway)
    fp8_layouts = {  # name: (parallel, masking)
        "cp2_ep2_fp8": ({"cp": 2, "ep": 2}, False),
        "cp2_pp2_fp8": ({"cp": 2, "pp": 2}, False),
        "cp2_ep2_masked_fp8": ({"cp": 2, "ep": 2, "dispatcher": "rowwise"}, True),
    }
    for name, (parallel, masking) in fp8_layouts.items():
        cases[name] = _fp8_case(tmp_path, documents_dir, name, parallel, masking)
    cases["cp2_ep2_masked_fp8"]["model"]["moe"]["capacity_factor"] = 4.0
    per_rank, gemms_per_rank = zip(
        *run_distributed(train_cases_with_gemms, world_size=4, args=(cases,), timeout=600),
        strict=True,
    )
    losses = per_rank[0]
    assert_fp8_ran(gemms_per_rank, list(fp8_layouts))
    for name, (_, masking) in fp8_layouts.items():
        assert_losses_match(name, losses[name], single_fp8[masking], rtol=FP8_CONTEXT_RTOL)
    for name in layouts:
        assert_losses_match(name, losses[name], single)
        assert_losses_match(f"{name} masked", losses[f"{name}_masked"], single_masked)
        assert_evaluations_match(name, tmp_path / name, single_root / "single_False")
        assert_evaluations_match(
            f"{name} masked", tmp_path / f"{name}_masked", single_root / "single_True"
        )
    assert_losses_match("cp2 -> cp1", losses["resume_cp1"], single[RESUMED_AT:])
