"""Context-parallel attention (`moe_train.parallelize.context_parallel`) against plain float64
attention over the whole sequence: every rank of cp 1, 2 and 4 simulated in one process."""

import pytest
import torch

from harness.ranks import run_distributed
from moe_plan.config import config_from_dict
from moe_plan.config.start_check import check_start
from moe_train.errors import ConfigError
from moe_train.model import WHOLE_SEQUENCES, Documents, shift_ahead, values_ahead
from moe_train.parallelize.context_parallel import (
    ContextShard,
    attention_blocks,
    local_context_attention,
)
from training import small_config_data


def reference_attention(q, k, v, document_ids):
    """Softmax attention with an explicit mask: each position sees the earlier ones (itself
    included) of its own document. q [B, H, S, D], k and v [B, Hkv, S, D]."""
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    same_document = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    scores = scores.masked_fill(~(causal & same_document), float("-inf"))
    return scores.softmax(dim=-1) @ v


def assert_close(name, actual, expected, tol=1e-10):
    error = (actual - expected).abs()
    worst = error.flatten().argmax()
    assert error.max() <= tol, (
        f"{name}: worst element {worst.item()}: {actual.flatten()[worst].item()} vs "
        f"{expected.flatten()[worst].item()}"
    )


DOCUMENT_ROWS = {
    "none": None,
    # Row 0: a document spanning chunks of every cp; row 1: documents ending inside chunks.
    "documents": ((3, 29, 32), (1, 8, 9, 20, 32)),
}


@pytest.mark.parametrize("documents", sorted(DOCUMENT_ROWS))
def test_context_attention_matches_whole_sequence_float64(documents):
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 32, 8
    q = torch.randn(batch, heads, seq, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(batch, heads, seq, dim, dtype=torch.float64)
    ends = DOCUMENT_ROWS[documents]
    docs = Documents(ends) if ends else None
    ids = docs.ids() if docs else torch.zeros(batch, seq, dtype=torch.long)
    expected = reference_attention(q, k, v, ids)
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for cp in (1, 2, 4):
        outputs, losses = [], 0
        for rank in range(cp):
            shard = ContextShard(cp, rank)
            local_q = shard.local(q.transpose(1, 2)).transpose(1, 2)
            out = local_context_attention(local_q, k, v, shard, docs)
            local_weights = shard.local(weights.transpose(1, 2)).transpose(1, 2)
            losses = losses + (out * local_weights).sum()
            positions = shard.positions(out.shape[2])
            outputs.append((positions, out))
        whole = torch.empty_like(expected)
        for positions, out in outputs:
            whole[:, :, positions] = out.detach()
        assert_close(f"cp{cp} output", whole, expected.detach())
        grads = torch.autograd.grad(losses, (q, k, v))
        for name, got, want in zip("qkv", grads, expected_grads, strict=True):
            assert_close(f"cp{cp} grad {name}", got, want)


def test_head_tail_split_balances_causal_work():
    """Every rank of cp 4 attends over the same number of query-key pairs."""
    seq = 64
    for cp in (2, 4):
        pairs = []
        for rank in range(cp):
            blocks = attention_blocks(ContextShard(cp, rank), seq, (seq,))
            pairs.append(
                sum(
                    (qe - qs) * (ke - ks) / (2 if causal else 1)
                    for qs, qe, ks, ke, causal in blocks
                )
            )
        assert len(set(pairs)) == 1, pairs


@pytest.mark.parametrize(
    ("world", "parallel", "data", "message"),
    [
        (2, {"cp": 4}, {}, "parallel.cp=4 must divide the data-parallel size 2"),
        (4, {"cp": 2, "ep": 3}, {}, "parallel.ep=3 must divide the data-parallel size 4"),
        (
            4,
            {"cp": 2},
            {"global_batch_size": 4, "micro_batch_size": 4},
            "1 micro-batches must be a multiple of the data-parallel size 2 / parallel.cp=2",
        ),
        (2, {"cp": 2}, {"seq_len": 30}, r"data.seq_len=30 must be a multiple of 2 x parallel.cp=4"),
    ],
)
def test_layouts_context_parallelism_cannot_use_name_the_key(
    tmp_path, token_file, world, parallel, data, message
):
    with pytest.raises(ConfigError, match=message) as raised:
        config = config_from_dict(
            small_config_data(tmp_path, token_file, parallel=parallel, data=data)
        )
        check_start(config, world)
    assert "\n" not in str(raised.value)


def test_the_planner_plans_the_context_parallel_layout(tmp_path, token_file):
    from moe_plan import device_with, make_plan

    config = config_from_dict(small_config_data(tmp_path, token_file, parallel={"cp": 2}))
    plan = make_plan(config, 4, device_with("h100"))
    assert plan.own.error is None and " cp2 " in plan.own.label
    assert "cp K/V all-gather" in plan.own.traffic.payload


def _whole_on_ranks(rank: int, world_size: int) -> list[str]:
    """Body for `run_distributed`: the whole sequences each rank's chunks gather
    (`ContextShard.whole`, then `held`) and the values further along (`values_ahead`, of
    floats with their gradients and of integer targets) against the same of whole sequences
    in one process; the mismatches found."""
    import torch.distributed as dist

    shard = ContextShard(world_size, rank, dist.group.WORLD)
    torch.manual_seed(0)
    whole = torch.randn(2, 8 * world_size, 3, dtype=torch.float64)
    weights = torch.randn_like(whole)
    targets = torch.randint(0, 50, (2, 8 * world_size))
    problems = []
    if not torch.equal(shard.whole(shard.local(targets)), targets):
        problems.append("whole of integers")
    if not torch.equal(shard.held(whole), shard.local(whole)):
        problems.append("held")
    for k in (1, 2, 5):
        expected = whole.clone().requires_grad_(True)
        (shift_ahead(expected, k, 0.0) * weights).sum().backward()
        mine = shard.local(whole).clone().requires_grad_(True)
        ahead = values_ahead(shard, mine, k, 0.0)
        (ahead * shard.local(weights)).sum().backward()
        if not torch.equal(ahead, shard.local(shift_ahead(whole, k, 0.0))):
            problems.append(f"k={k}: values")
        if not torch.allclose(mine.grad, shard.local(expected.grad), rtol=0, atol=1e-12):
            problems.append(f"k={k}: gradients")
        want = shard.local(shift_ahead(targets, k, -100))
        if not torch.equal(values_ahead(shard, shard.local(targets), k, -100), want):
            problems.append(f"k={k}: integer targets")
    return problems


def test_whole_sequences_and_values_further_along_come_from_the_rank_holding_them():
    """Multi-token prediction reads the embeddings and targets k positions along the whole
    sequence, capacity counts the whole sequences' copies: at cp 2 and 4, every rank gathers
    the whole sequences exactly, its values further along equal the whole sequence moved
    back by k (the last k positions filled) taken at its positions, and their backward sends
    each gradient to the rank holding the value."""
    whole = torch.arange(12).reshape(1, 6, 2)
    moved = torch.tensor([[[4, 5], [6, 7], [8, 9], [10, 11], [-1, -1], [-1, -1]]])
    assert torch.equal(shift_ahead(whole, 2, -1), moved)
    assert torch.equal(values_ahead(WHOLE_SEQUENCES, whole, 2, -1), moved)
    for world_size in (2, 4):
        assert run_distributed(_whole_on_ranks, world_size=world_size) == [[]] * world_size
