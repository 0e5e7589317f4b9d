"""Context parallelism (parallel.cp) trains as one process does: fp32, the same global and
micro batch, each layout against the single-process losses within 1e-5 relative, with and
without document masking; resumes between cp sizes continue the uninterrupted run. All
layouts of a world size train in one spawn."""

import pytest

from harness.ranks import run_distributed
from moe_train.config import config_from_dict
from moe_train.train import train
from test_document_masking import _short_documents
from training import assert_losses_match, small_config_data, train_cases

STEPS = 20
RESUMED_AT = 10


def _case(tmp_path, data_dir, name, parallel, masking, **train_section) -> dict:
    data = small_config_data(
        tmp_path / name,
        data_dir,
        model={"vocab_size": 320, "n_layers": 4, "moe": {"bias_update_rate": 0.01}},
        data={"micro_batch_size": 2, "document_masking": masking},
        train={"max_steps": STEPS, **train_section},
        parallel=parallel,
    )
    return data


@pytest.fixture(scope="module")
def documents_dir(tmp_path_factory):
    return _short_documents(tmp_path_factory.mktemp("cp_docs"))


@pytest.fixture(scope="module")
def single_process(documents_dir, tmp_path_factory):
    """Single-process losses without and with document masking, and a checkpoint halfway
    through the unmasked run (the cp1 -> cp2 resume starts from it)."""
    root = tmp_path_factory.mktemp("cp_single")
    losses = {}
    for masking in (False, True):
        data = _case(root, documents_dir, f"single_{masking}", {}, masking)
        if not masking:
            data["checkpoint"] = {"interval": RESUMED_AT, "interval_minutes": 0, "keep_last": 5}
        losses[masking] = train(config_from_dict(data)).losses
    return losses, root / "single_False" / "checkpoints" / f"step_{RESUMED_AT:08d}"


def _resume_case(tmp_path, data_dir, name, parallel, checkpoint) -> dict:
    data = _case(tmp_path, data_dir, name, parallel, False)
    data["checkpoint"] = {"resume": str(checkpoint), "interval": 0, "interval_minutes": 0}
    return data


@pytest.mark.slow
def test_cp2_on_two_ranks_matches_single_process(documents_dir, single_process, tmp_path):
    (single, single_masked), single_checkpoint = single_process[0].values(), single_process[1]
    cases = {}
    for masking in (False, True):
        cases[f"cp2_{masking}"] = _case(
            tmp_path, documents_dir, f"cp2_{masking}", {"cp": 2}, masking
        )
    # cp1 -> cp2: a cp2 run resumes the single-process run's checkpoint.
    cases["resume_cp2"] = _resume_case(
        tmp_path, documents_dir, "resume_cp2", {"cp": 2}, single_checkpoint
    )
    per_rank = run_distributed(train_cases, world_size=2, args=(cases,), timeout=600)
    losses = per_rank[0]
    assert_losses_match("cp2", losses["cp2_False"], single)
    assert_losses_match("cp2 masked", losses["cp2_True"], single_masked)
    assert_losses_match("cp1 -> cp2", losses["resume_cp2"], single[RESUMED_AT:])
