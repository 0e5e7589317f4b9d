"""data.label_mask: the step's loss is the mean over the trained tokens of the global batch."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from masked_data import conversation_like, save_masked_tokens

from moe_data import TokenDataset
from moe_data.labels import IGNORE_INDEX, encode_masked, inputs_and_targets
from moe_plan.config import config_from_dict
from moe_train.errors import DataError
from moe_train.model import head_lm_loss
from moe_train.model import loss as loss_module
from moe_train.train.evaluate import Evaluator
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner
from training import small_config_data


@pytest.mark.parametrize("chunk_logits", [10**9, 7 * 50])  # one chunk; chunks of 7 tokens
def test_masked_head_loss_is_a_sum_over_trained_targets(monkeypatch, chunk_logits):
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", chunk_logits)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11), generator=generator)
    ignored = torch.rand(3, 11, generator=generator) < 0.6
    targets[ignored] = IGNORE_INDEX
    normalizer = torch.tensor(7.5)
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    want = (
        F.cross_entropy((hidden64 @ weight64.T).flatten(0, 1), targets.flatten(), reduction="sum")
        / normalizer.double()
    )
    want.backward()
    loss = head_lm_loss(hidden, weight, targets, normalizer)
    (2.5 * loss).backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(hidden.grad.double(), 2.5 * hidden64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), 2.5 * weight64.grad, rtol=1e-5, atol=1e-6)
    assert (hidden.grad[ignored] == 0).all(), "ignored targets give no gradient"
    assert (hidden.grad[~ignored] != 0).any()


def _config(data_dir, run_dir, micro_batch_size):
    return config_from_dict(
        small_config_data(
            run_dir,
            data_dir,
            data={"label_mask": True, "micro_batch_size": micro_batch_size},
            train={"max_steps": 1},
            eval={"paths": [str(data_dir)], "interval": 1, "batches": 2},
        )
    )


def _reference_loss(runner, batch):
    """The global batch's loss by hand: cross-entropy summed over trained targets, float64,
    divided by their count; and the mean of the per-micro-batch means (what it must not be)."""
    inputs, targets = inputs_and_targets(batch)
    with torch.no_grad():
        logits = runner.model(inputs).double()
    per_token = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view_as(targets)
    trained = targets != IGNORE_INDEX
    mbs = runner.config.data.micro_batch_size
    micro_means = [
        per_token[i : i + mbs].sum() / trained[i : i + mbs].sum() for i in range(0, len(batch), mbs)
    ]
    return per_token.sum().item() / trained.sum().item(), torch.stack(micro_means).mean().item()


def test_step_loss_is_the_global_token_mean_whatever_the_micro_batch(tmp_path):
    ids, mask = conversation_like(4000)
    data_dir = save_masked_tokens(tmp_path / "chat", ids, mask)
    losses = {}
    for mbs in (1, 2, 4):
        config = _config(data_dir, tmp_path / f"run{mbs}", mbs)
        dataset = TokenDataset(config.data.paths, config.data.seq_len, label_mask=True)
        batch = dataset.batch(0, config.data.global_batch_size, config.train.seed)
        trained = int((batch[:, 1:] >= 0).sum())
        assert 0 < trained < batch[:, 1:].numel()
        runtime = start_runtime(config, torch.device("cpu"))
        runner = StepRunner(config, runtime)
        evaluator = Evaluator(config, runner, runtime)
        eval_batch = torch.cat([evaluator.batch(0), evaluator.batch(1)])
        want_eval, _ = _reference_loss(runner, eval_batch)
        got_eval = evaluator.evaluate()
        assert abs(got_eval - want_eval) <= 1e-6 * want_eval, (mbs, got_eval, want_eval)
        want, mean_of_means = _reference_loss(runner, batch)
        result = runner.train_step(batch, lr=1e-3)
        assert result.stats.trained_tokens == trained
        assert abs(result.stats.lm_loss - want) <= 1e-6 * want, (mbs, result.stats.lm_loss, want)
        # (NaN where a micro-batch has no trained target: another way it must not be done)
        assert not abs(mean_of_means - want) <= 1e-4, "the batch must tell the two means apart"
        losses[mbs] = result.stats.lm_loss
    assert max(losses.values()) - min(losses.values()) <= 1e-6 * losses[1], losses


def test_a_mixture_of_masked_sources_carries_the_masks(tmp_path):
    from moe_data import MixedDataset, MixtureSource

    sources = []
    for index in range(2):
        ids, mask = conversation_like(1500, seed=index)
        path = save_masked_tokens(tmp_path / f"chat{index}", ids, mask)
        sources.append(MixtureSource(f"s{index}", [str(path)], 1.0))
    mixed = MixedDataset(sources, 32, label_mask=True)
    rows = mixed.batch(0, 8, 0)
    assert (rows < 0).any() and (rows >= 0).any()
    assert [part.packed is not None for part in mixed.parts] == [True, True]


def test_label_mask_needs_masked_data(tmp_path):
    plain = tmp_path / "plain.npy"
    np.save(plain, np.arange(200, dtype=np.uint16) % 50)
    with pytest.raises(DataError, match=r"data.label_mask=true but data.paths entry .*plain.npy"):
        TokenDataset([str(plain)], 16, label_mask=True)


def test_mask_file_that_does_not_match_its_tokens_is_named(tmp_path):
    ids, mask = conversation_like(500)
    data_dir = save_masked_tokens(tmp_path / "chat", ids, mask[:-3])
    with pytest.raises(DataError) as error:
        TokenDataset([str(data_dir)], 16, label_mask=True)
    message = str(error.value)
    assert "mask-000000.bin holds 497 bytes" in message and "500 tokens" in message, message


def test_a_mask_with_nothing_to_train_on_is_refused_before_any_step(tmp_path, capsys):
    """A data.paths or eval.paths directory whose label mask marks no token (all zeros, or
    no tokens at all: a chat file without rows, as earlier releases prepared it) stops
    `train` with one line naming it and exit 2; the run directory stays as it was."""
    from moe_train.cli import main
    from training import save_config

    ids, mask = conversation_like(1000)
    good = save_masked_tokens(tmp_path / "chat", ids, mask)
    zeros = save_masked_tokens(tmp_path / "zeros", ids, np.zeros_like(mask))
    empty = save_masked_tokens(tmp_path / "empty", ids[:0], mask[:0])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = '{"step": 3, "loss": 1.5}\n'
    (run_dir / "metrics.jsonl").write_text(metrics)
    for data_dir, eval_dir, bad, why in [
        (zeros, good, zeros, "its label mask marks none of its 1,000 tokens"),
        (good, zeros, zeros, "its label mask marks none of its 1,000 tokens"),
        (empty, good, empty, "it holds no tokens"),
    ]:
        sections = {
            "data": {"label_mask": True},
            "eval": {"paths": [str(eval_dir)], "interval": 1, "batches": 1},
        }
        config = save_config(
            tmp_path / "run.yaml", small_config_data(run_dir, data_dir, **sections)
        )
        assert main(["train", str(config)]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: data.label_mask=true but {bad} has no token to train on ({why}); prepare "
            "it again from rows with assistant replies (or with --train-on all)"
        ]
        assert [p.name for p in run_dir.iterdir()] == ["metrics.jsonl"]
        assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_windows_pack_whole_documents_with_their_mask(tmp_path):
    ids, mask = conversation_like(3000, long_every=7)
    data_dir = save_masked_tokens(tmp_path / "chat", ids, mask)
    ends = np.append(np.flatnonzero(ids == 0) + 1, len(ids) if ids[-1] else [])
    lengths = np.diff(ends, prepend=0)
    long_documents = int((lengths > 33).sum())
    assert long_documents > 5
    plain = TokenDataset([str(data_dir)], 32)
    assert plain.sequence(3).tolist() == ids[3 * 32 : 4 * 32 + 1].tolist(), "no mask: as before"
    for split in (False, True):
        dataset = TokenDataset([str(data_dir)], 32, label_mask=True, split_long_examples=split)
        want_counts = (0, long_documents) if split else (long_documents, 0)
        assert (dataset.skipped_long, dataset.split_long) == want_counts
        packed = dataset.packed[0]
        assert (packed.lengths <= 33).all()
        if not split:  # every window begins and ends at document boundaries
            assert set(packed.starts.tolist()) <= set((ends - lengths).tolist())
            assert set((packed.starts + packed.lengths).tolist()) <= set(ends.tolist())
        kept = lengths.sum() if split else lengths[lengths <= 33].sum()
        assert packed.lengths.sum() == kept
        for index, (start, length) in enumerate(zip(packed.starts, packed.lengths, strict=True)):
            padding = np.zeros(33 - length, dtype=np.int64)
            want = encode_masked(
                np.concatenate([ids[start : start + length], padding]),
                np.concatenate([mask[start : start + length], padding]),
            )
            assert dataset.sequence(index).tolist() == want.tolist()


def test_too_long_documents_only_are_refused_in_one_line(tmp_path):
    ids, mask = conversation_like(500, lengths=(40, 60))
    whole = np.flatnonzero(ids == 0)[-1] + 1
    ids, mask = ids[:whole], mask[:whole]
    data_dir = save_masked_tokens(tmp_path / "chat", ids, mask)
    with pytest.raises(DataError, match=r"every document of data.paths is longer than "):
        TokenDataset([str(data_dir)], 32, label_mask=True)
    assert TokenDataset([str(data_dir)], 32, label_mask=True, split_long_examples=True).split_long


STEPS = 20
LAYOUTS = {
    "dp2": {},
    "dp2_distributed_optimizer_recompute": {"distributed_optimizer": True, "recompute": "full"},
    "ep2": {"ep": 2, "dispatcher": "all_to_all"},
    "pp2": {"pp": 2},
    "cp2": {"cp": 2},
}


def _masked_run(data_dir, run_dir, parallel):
    return small_config_data(
        run_dir,
        data_dir,
        model={"qk_norm": False, "moe": {"bias_update_rate": 0.01}},
        data={"label_mask": True, "micro_batch_size": 2, "document_masking": True},
        train={"max_steps": STEPS},
        eval={"paths": [str(data_dir)], "interval": 10, "batches": 2},
        parallel=parallel,
    )


@pytest.mark.slow
def test_layouts_reproduce_single_process_masked_losses(tmp_path):
    """20 fp32 steps with a label mask, document masking and evaluation on dp2, ep2, pp2, cp2
    and dp2 with the distributed optimizer and recompute, all in one spawn: the single-process
    losses."""
    from harness.ranks import run_distributed
    from moe_train.train import read_metrics, train
    from training import assert_losses_match, train_cases

    ids, mask = conversation_like(20000, seed=1, long_every=11)
    data_dir = save_masked_tokens(tmp_path / "chat", ids, mask)
    single = train(config_from_dict(_masked_run(data_dir, tmp_path / "single", {})))
    cases = {
        name: _masked_run(data_dir, tmp_path / name, parallel) for name, parallel in LAYOUTS.items()
    }
    per_rank = run_distributed(train_cases, world_size=2, args=(cases,), timeout=900)
    for name in LAYOUTS:
        assert all(r[name] == per_rank[0][name] for r in per_rank), f"{name}: ranks disagree"
        assert_losses_match(name, per_rank[0][name], single.losses)
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        want = read_metrics(single.run_dir / "metrics.jsonl")
        assert [r["trained_tokens"] for r in rows] == [r["trained_tokens"] for r in want]
        evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        want_evals = [(r["step"], r["eval_loss"]) for r in want if "eval_loss" in r]
        assert [s for s, _ in evals] == [s for s, _ in want_evals] == [10, 20]
        assert_losses_match(f"{name} eval", [e for _, e in evals], [e for _, e in want_evals])
    assert single.losses[-1] < single.losses[0] - 0.5, "the masked run learns"


def test_split_long_examples_needs_the_label_mask(tmp_path):
    from moe_train.errors import ConfigError

    data = small_config_data(
        tmp_path / "run", tmp_path / "x.npy", data={"split_long_examples": True}
    )
    with pytest.raises(ConfigError, match=r"^data.split_long_examples=true applies to packed"):
        config_from_dict(data)
