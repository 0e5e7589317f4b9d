"""Multi-token prediction (model.mtp_depth): the loss, layouts, resume, export, generation."""

import dataclasses
import math

import pytest
import torch
import transformers

from harness.ranks import run_distributed
from moe_plan.config import config_from_dict
from moe_train.cli import main
from moe_train.model import Transformer
from moe_train.train import read_metrics, train
from training import small_config_data, small_model_config, train_cases

STEPS = 8
MTP = {"mtp_depth": 2, "mtp_loss_weight": 0.5}


def _config_data(token_file, run_dir, **parallel) -> dict:
    return small_config_data(
        run_dir,
        token_file,
        model={**MTP, "moe": {"bias_update_rate": 0.01}},
        data={"micro_batch_size": 2},
        train={"max_steps": STEPS},
        parallel=parallel,
        eval={"paths": [str(token_file)], "interval": STEPS // 2},
    )


def _metric(run_dir, key: str) -> list[float]:
    return [row[key] for row in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_mtp_trains_and_expert_and_pipeline_parallel_match_single_process(
    shared_token_file, tmp_path
):
    """One process, then ep2, pp2 and cp2 in one 2-rank spawn: LM and MTP losses within 1e-5
    (fp32) at every step, and the held-out loss where it is evaluated (the pipeline's
    evaluation passes the MTP embeddings between stages as training does; under context
    parallelism each module reads the embeddings and targets further along from the rank
    holding them, two modules deep); the MTP loss falls."""
    train(config_from_dict(_config_data(shared_token_file, tmp_path / "single")))
    cases = {
        "ep2": _config_data(shared_token_file, tmp_path / "ep2", ep=2),
        "pp2": _config_data(shared_token_file, tmp_path / "pp2", pp=2),
        "cp2": _config_data(shared_token_file, tmp_path / "cp2", cp=2),
    }
    run_distributed(train_cases, world_size=2, args=(cases,), timeout=600)
    for key in ("loss", "mtp_loss"):
        reference = _metric(tmp_path / "single", key)
        assert len(reference) == STEPS and all(math.isfinite(v) for v in reference)
        for name in cases:
            values = _metric(tmp_path / name, key)
            worst = max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))
            assert worst <= 1e-5, f"{name} {key}: {values} vs single process {reference}"
    evaluated = [
        r["eval_loss"]
        for r in read_metrics(tmp_path / "single" / "metrics.jsonl")
        if "eval_loss" in r
    ]
    assert len(evaluated) == 2
    for name in cases:
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        values = [r["eval_loss"] for r in rows if "eval_loss" in r]
        assert values == pytest.approx(evaluated, rel=1e-5), name
    mtp = _metric(tmp_path / "single", "mtp_loss")
    assert mtp[-1] < mtp[0] - 0.3, f"the MTP loss should fall: {mtp}"


def test_mtp_modules_change_neither_logits_nor_the_lm_loss_value():
    """The main model of a config with MTP modules is the one without them (same weights,
    same logits: generation ignores the modules); its training forward returns the same LM
    loss, and backward reaches the modules and the shared embedding through the MTP loss."""
    plain_config = small_model_config()
    with_mtp = Transformer(dataclasses.replace(plain_config, **MTP))
    plain = Transformer(plain_config)
    own = {k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")}
    assert own.keys() == plain.state_dict().keys()
    assert all(torch.equal(own[k], v) for k, v in plain.state_dict().items())
    tokens = torch.randint(
        0, plain_config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert torch.equal(with_mtp(tokens[:, :-1]), plain(tokens[:, :-1]))
    loss = with_mtp(tokens[:, :-1], targets_BS=tokens[:, 1:])
    assert torch.equal(loss.detach(), plain(tokens[:, :-1], targets_BS=tokens[:, 1:]).detach())
    assert with_mtp.last_mtp_loss is not None and with_mtp.last_mtp_loss > 0
    # Module 1 at position i: the main hidden state at i and the embedding of token i + 1
    # predict token i + 2; module 2 continues from module 1's output at i and token i + 2.
    inputs = tokens[:, :-1]
    length = inputs.shape[1]
    with torch.no_grad():
        hidden = with_mtp.run_layers(inputs, list(with_mtp.blocks), embed=True)
        cos, sin = with_mtp.rope(length)
        expected = []
        for k, module in enumerate(with_mtp.mtp.values(), start=1):
            positions = length - k
            ahead = with_mtp.embed(tokens[:, k : k + positions])
            hidden = module(hidden[:, :positions], ahead, cos, sin)
            logits = with_mtp.head(module.norm(hidden)).double()
            wanted = tokens[:, k + 1 : k + 1 + positions]
            expected.append(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), wanted.flatten())
            )
    torch.testing.assert_close(
        with_mtp.last_mtp_loss.double(), torch.stack(expected).mean(), rtol=1e-6, atol=0
    )
    loss.backward()
    for name, param in with_mtp.named_parameters():
        if name.startswith("mtp."):
            assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.slow
def test_resume_with_mtp_is_bitwise_and_export_leaves_the_modules_out(
    tmp_path, make_config, capsys
):
    """A run with MTP modules (and the global-batch balancing loss, whose routed fractions
    the checkpoint must hold) resumed from its step-2 checkpoint continues bitwise (LM, MTP
    and balancing losses); its export says it leaves the modules out, and transformers loads
    the rest with our logits."""
    model = {**MTP, "moe": {"lb_scope": "global_batch", "lb_loss_weight": 0.1}}
    uninterrupted = train(make_config(tmp_path / "a", model=model, train={"max_steps": 4}))
    first = train(
        make_config(tmp_path / "b", model=model, train={"max_steps": 4}, checkpoint={"interval": 2})
    )
    assert first.losses == uninterrupted.losses
    step2 = first.run_dir / "checkpoints" / "step_00000002"
    resumed = train(
        make_config(
            tmp_path / "c", model=model, train={"max_steps": 4}, checkpoint={"resume": str(step2)}
        )
    )
    assert resumed.losses == uninterrupted.losses[2:]
    for key in ("mtp_loss", "lb_loss"):
        assert _metric(resumed.run_dir, key) == _metric(uninterrupted.run_dir, key)[2:], key

    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", str(first.checkpoint), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("multi-token-prediction module(s) (model.mtp_depth=2) are left out") == 1
    hf_model, loading = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = first.model.eval()(tokens)
        theirs = hf_model.eval()(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_parameter_and_flop_counts_include_the_mtp_modules():
    """`count_params` counts the modules' parameters as the model holds them; the FLOPs per
    token add six per matmul parameter a module applies (head included) and its attention."""
    from moe_train.model import count_params, flops_per_token

    plain_config = small_model_config()
    config = dataclasses.replace(plain_config, **MTP)
    held = sum(p.numel() for n, p in Transformer(config).named_parameters() if n.startswith("mtp."))
    counts = count_params(config)
    assert counts.mtp == held
    assert counts.total == count_params(plain_config).total
    d, vocab = config.d_model, config.vocab_size
    kv = config.n_kv_heads * d // config.n_heads
    per_module = 2 * d * d + d * (d + 2 * kv) + d * d + 3 * d * config.dense_hidden + vocab * d
    assert counts.mtp_active == MTP["mtp_depth"] * per_module
    attention = 3 * 2 * 2 * d * (16 / 2) * MTP["mtp_depth"]
    added = flops_per_token(config, 16) - flops_per_token(plain_config, 16)
    assert added == 6 * counts.mtp_active + attention
