"""data.document_masking: attention stays inside each document of a packed sequence, so the
loss equals running each document alone."""

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness.ranks import run_distributed
from moe_data import TokenDataset, prepare_data
from moe_plan.config import config_from_dict
from moe_train.cli import main
from moe_train.model import Documents, Transformer
from moe_train.train import train
from training import assert_losses_match, small_config_data, small_model_config, train_cases

EOS = 0


def _packed(rng, rows: int, length: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Token rows [rows, length] of documents (ids 1..63) each ended by EOS, and where each
    row's documents start."""
    tokens = torch.from_numpy(rng.integers(1, 64, (rows, length)))
    starts = []
    for row in range(rows):
        ends = np.sort(rng.choice(np.arange(1, length - 1), size=row + 1, replace=False))
        tokens[row, ends] = EOS
        starts.append([0, *(ends + 1).tolist()])
    return tokens, starts


def _each_document_alone(model, inputs, targets, starts) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token loss and logits of running every document by itself (the plain causal
    path, positions from 0), in the packed layout."""
    total = torch.zeros((), dtype=torch.float64)
    logits = torch.empty(*inputs.shape, model.config.vocab_size)
    for row, row_starts in enumerate(starts):
        bounds = [*row_starts, inputs.shape[1]]
        for begin, end in itertools.pairwise(bounds):
            if begin >= end:
                continue
            alone = model(inputs[row : row + 1, begin:end])[0].float()
            logits[row, begin:end] = alone
            total += F.cross_entropy(alone, targets[row, begin:end], reduction="sum").double()
    return total, logits


def test_masked_loss_and_logits_equal_each_document_run_alone():
    rng = np.random.default_rng(0)
    model = Transformer(small_model_config(), seed=2)
    packed, starts = _packed(rng, rows=3, length=49)
    inputs, targets = packed[:, :-1], packed[:, 1:]
    with torch.no_grad():
        documents = Documents.of(inputs, EOS)
        assert [list(e) for e in documents.ends] == [[*s[1:], 48] for s in starts]
        masked = model(inputs, targets_BS=targets, documents=documents)
        plain = model(inputs, targets_BS=targets)
        masked_logits = model(inputs, documents=documents)
        total, alone_logits = _each_document_alone(model, inputs, targets, starts)
    reference = total / inputs.numel()
    assert abs(masked.double() - reference) <= 1e-5 * abs(reference), (masked, reference)
    worst = (masked_logits - alone_logits).abs().max().item()
    assert worst < 1e-4, f"logits differ from per-document runs by up to {worst}"
    assert abs(plain.double() - reference) > 1e-4, "the documents did not see each other anyway"


def _short_documents(tmp_path):
    """A prepared directory of short JSON Lines documents (byte tokenizer, eos 256)."""
    rng = np.random.default_rng(1)
    words = [
        "the",
        "of",
        "model",
        "data",
        "expert",
        "router",
        "token",
        "layer",
        "loss",
        "train",
        "a",
        "to",
        "is",
    ]
    lines = [
        json.dumps({"text": " ".join(rng.choice(words, rng.integers(1, 9)))}) for _ in range(600)
    ]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    prepare_data([corpus], tmp_path / "docs")
    return tmp_path / "docs"


def test_a_training_step_with_masking_has_the_loss_of_documents_alone(tmp_path):
    data_dir = _short_documents(tmp_path)
    sections = {"train": {"max_steps": 1}, "model": {"vocab_size": 320, "init_std": 0.3}}
    masked_data = small_config_data(tmp_path / "masked", data_dir, **sections)
    masked_data["data"]["document_masking"] = True
    config = config_from_dict(masked_data)
    masked = train(config).losses[0]
    plain = train(config_from_dict(small_config_data(tmp_path / "plain", data_dir, **sections)))

    data = config.data
    dataset = TokenDataset(data.paths, data.seq_len)
    batch = dataset.batch(0, data.global_batch_size, config.train.seed)
    assert (batch == dataset.eos_id).sum() >= data.global_batch_size, "too few documents"
    model = Transformer(config.model, seed=config.train.seed)
    micro_losses = []
    with torch.no_grad():
        for micro in batch.split(data.micro_batch_size):
            inputs, targets = micro[:, :-1], micro[:, 1:]
            starts = [
                [0, *((row == dataset.eos_id).nonzero().flatten() + 1).tolist()] for row in inputs
            ]
            total, _ = _each_document_alone(model, inputs, targets, starts)
            micro_losses.append(total.item() / inputs.numel())
    reference = float(np.mean(micro_losses))
    assert abs(masked - reference) <= 1e-5 * reference, (masked, reference)
    assert abs(plain.losses[0] - reference) > 1e-3 * reference


def test_evaluation_masks_documents_as_training_does(tmp_path):
    data_dir = _short_documents(tmp_path)
    data = small_config_data(
        tmp_path / "run", data_dir, train={"max_steps": 1}, model={"vocab_size": 320}
    )
    data["data"]["document_masking"] = True
    data["eval"] = {"paths": [str(data_dir)], "interval": 1, "batches": 1}
    config = config_from_dict(data)
    result = train(config)
    eval_loss = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[-1])[
        "eval_loss"
    ]
    # Eval batch 0 is the data's first sequences in order, in micro-batches.
    dataset = TokenDataset(config.data.paths, config.data.seq_len)
    batch = torch.stack([torch.from_numpy(dataset.sequence(i)) for i in range(8)])
    micro_losses = []
    with torch.no_grad():
        for micro in batch.split(config.data.micro_batch_size):
            inputs, targets = micro[:, :-1], micro[:, 1:]
            starts = [
                [0, *((row == dataset.eos_id).nonzero().flatten() + 1).tolist()] for row in inputs
            ]
            total, _ = _each_document_alone(result.model, inputs, targets, starts)
            micro_losses.append(total.item() / inputs.numel())
    assert eval_loss == pytest.approx(float(np.mean(micro_losses)), rel=1e-5)


def test_masking_without_an_end_of_document_id_is_one_line(tmp_path, token_file, capsys):
    data = small_config_data(tmp_path / "r", token_file)
    data["data"]["document_masking"] = True
    config_file = tmp_path / "c.yaml"
    config_file.write_text(json.dumps(data))
    assert main(["train", str(config_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "data.document_masking=true needs documents that end at an end-of-document id" in err
    assert str(token_file) in err
    assert not (tmp_path / "r").exists()


def test_masking_trains_alike_on_pipeline_and_expert_parallel_layouts(tmp_path):
    """fp32, 6 steps on short documents: pp2 (1f1b, and interleaved with recompute) and dp2 x
    ep2 give the single-process losses; evaluation under the pipeline masks as training does."""
    data_dir = _short_documents(tmp_path)
    sections = {"model": {"vocab_size": 320, "n_layers": 4}, "data": {"document_masking": True}}
    eval_section = {"paths": [str(data_dir)], "interval": 3, "batches": 1}
    single_data = small_config_data(tmp_path / "single", data_dir, **sections)
    single_data["eval"] = eval_section
    single = train(config_from_dict(single_data))
    layouts = {
        "pp2": {"pp": 2},
        "pp2_interleaved_recompute": {
            "pp": 2,
            "pp_schedule": "interleaved_1f1b",
            "virtual_stages": 2,
            "recompute": "full",
        },
        "dp2_ep2": {"ep": 2},
    }
    cases = {}
    for name, parallel in layouts.items():
        cases[name] = small_config_data(tmp_path / name, data_dir, parallel=parallel, **sections)
        cases[name]["eval"] = eval_section
    per_rank = run_distributed(train_cases, world_size=2, args=(cases,), timeout=600)
    for name in layouts:
        assert_losses_match(f"masked {name}", per_rank[0][name], single.losses)
        evals = [
            json.loads(line).get("eval_loss")
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        single_evals = [
            json.loads(line).get("eval_loss")
            for line in (single.run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        assert [e for e in evals if e] == pytest.approx([e for e in single_evals if e], rel=1e-5)


def test_masking_allocates_nothing_quadratic_in_the_sequence_length():
    """Forward and backward at 8,192 positions (4 documents): no tensor has S x S elements
    (the attention scores, or a mask, of one head would)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seq_len = 8192

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    LargestOutput.largest = max(LargestOutput.largest, t.numel())
            return out

    model = Transformer(small_model_config(n_layers=1), seed=0)
    tokens = torch.randint(1, 64, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    tokens[0, [1000, 3000, 6000]] = EOS
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    documents = Documents.of(inputs, EOS)
    with LargestOutput():
        model(inputs, targets_BS=targets, documents=documents).backward()
    assert LargestOutput.largest < seq_len * seq_len // 16, LargestOutput.largest
    # The probe sees quadratic tensors where they exist: a boolean mask of the same rows.
    with LargestOutput():
        torch.ones(seq_len, seq_len // 16, dtype=torch.bool).tril()
    assert LargestOutput.largest == seq_len * seq_len // 16
