"""Context parallelism: each sequence split over `cp` ranks, attention over the whole of it.

B batch, H heads, S positions (of the whole sequence where named so), C positions of one
chunk, D channels per head.

A sequence of S positions is cut into 2 x cp chunks of C = S / (2 cp); rank r holds chunks r
and 2 cp - 1 - r (the head-tail split), so that under a causal mask every rank attends over
the same number of query-key pairs. Everything but attention runs on the rank's 2 C tokens;
RoPE uses their global positions. Multi-token prediction, which reads the embeddings and
targets further along, and capacity, which keeps the copies one process holding whole
sequences would keep, gather what they need of the whole sequences (`ContextShard.whole`, an
all-gather whose backward sums each gradient back to the rank holding the value).

Attention gathers the keys and values of every rank (one all-gather per layer, the Llama 3
recipe; its backward is a reduce-scatter of their gradients) and runs, for each local query
chunk, two flash-attention calls: to the keys strictly before the chunk (no mask) and to the
chunk's own keys (causal). The two partial results are merged by their log-sum-exp, so no
S x S tensor exists. Backward calls the kernel's backward per call with the merged output and
log-sum-exp, which gives exact gradients (as ring flash attention does). With documents each
document runs the same two calls, within its own positions.

The kernels are the private flash-attention ops that return the log-sum-exp:
`_scaled_dot_product_flash_attention_for_cpu` on the CPU (tested, any float dtype) and
`_scaled_dot_product_flash_attention` on CUDA (bf16 or fp16 only; written to the same contract,
not yet run on a GPU).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from moe_parallel import Layout
from moe_train.model import Documents


@dataclass(frozen=True)
class ContextShard:
    """Which part of each sequence this rank holds: the `SequencePart` of a context-parallel
    model (`moe_train.model.SequencePart`)."""

    cp: int
    """Ranks a sequence is split over."""
    rank: int
    """This rank's place among them."""
    group: ProcessGroup | None = None
    """The ranks a sequence is split over (None: attention is simulated in one process)."""

    @property
    def parts(self) -> int:
        """Ranks a sequence is split over (`SequencePart.parts`)."""
        return self.cp

    def sum(self, x: Tensor) -> Tensor:
        """`x` summed over the ranks of `group` (`x` itself at cp = 1 or without a group)."""
        if self.cp == 1 or self.group is None:
            return x
        x = x.clone()
        dist.all_reduce(x, group=self.group)
        return x

    def attend(
        self, q_BHCD: Tensor, k_BHCD: Tensor, v_BHCD: Tensor, documents: Documents | None = None
    ) -> Tensor:
        """`context_attention` of this shard: the attention core of a context-parallel model
        (`moe_train.model.AttentionCore`)."""
        return context_attention(q_BHCD, k_BHCD, v_BHCD, self, documents)

    def chunks(self) -> tuple[int, int]:
        """The global indices of the two chunks this rank holds, in the order it holds them."""
        return self.rank, 2 * self.cp - 1 - self.rank

    def local(self, x_BS: Tensor) -> Tensor:
        """This rank's positions [B, 2 C, ...] of whole sequences [B, S, ...]."""
        chunk = chunk_length(x_BS.shape[1], self.cp)
        return torch.cat([x_BS[:, c * chunk : (c + 1) * chunk] for c in self.chunks()], dim=1)

    def rows(self, table: Tensor, local_length: int) -> Tensor:
        """The rows of a per-position `table` for this rank's `local_length` positions."""
        return table[self.positions(local_length, table.device)]

    def whole(self, x_BL: Tensor) -> Tensor:
        """The whole sequences [B, S, ...] of a value per local position ([B, 2 C, ...]),
        gathered from the group's ranks (`SequencePart.whole`)."""
        x_B1LX = x_BL.reshape(*x_BL.shape[:2], -1).unsqueeze(1)  # one "head", values flat
        whole_BS = gather_sequence(x_B1LX, self).squeeze(1)
        return whole_BS.reshape(whole_BS.shape[0], -1, *x_BL.shape[2:])

    def held(self, x_BS: Tensor) -> Tensor:
        """This rank's positions of whole sequences (`SequencePart.held`)."""
        return self.local(x_BS)

    def positions(self, local_length: int, device: torch.device | None = None) -> Tensor:
        """The global positions of this rank's `local_length` positions (int64)."""
        chunk = local_length // 2
        return torch.cat(
            [torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in self.chunks()]
        )


def context_shard(layout: Layout) -> ContextShard | None:
    """This rank's part of each sequence, or None without context parallelism."""
    return ContextShard(layout.cp, layout.cp_rank, layout.cp_group) if layout.cp > 1 else None


def chunk_length(seq_len: int, cp: int) -> int:
    """C: positions of one of the 2 x cp chunks of a sequence."""
    if seq_len % (2 * cp):
        raise ValueError(f"{seq_len} positions do not split into 2 x {cp} equal chunks")
    return seq_len // (2 * cp)


def context_attention(
    q_BHCD: Tensor,
    k_BHCD: Tensor,
    v_BHCD: Tensor,
    shard: ContextShard,
    documents: Documents | None = None,
) -> Tensor:
    """Causal attention of this rank's queries to the keys of the whole sequence, gathered
    from the ranks of `shard.group`; [B, H, 2 C, D] like `q_BHCD`. Keys and values may have
    fewer heads than queries (grouped-query attention): they are gathered, and kept for
    backward, with their own heads. With `documents` (of the whole sequences) each position
    sees only the earlier ones of its own document."""
    k_BHSD = gather_sequence(k_BHCD, shard)
    v_BHSD = gather_sequence(v_BHCD, shard)
    return local_context_attention(q_BHCD, k_BHSD, v_BHSD, shard, documents)


def local_context_attention(
    q_BHCD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    shard: ContextShard,
    documents: Documents | None = None,
) -> Tensor:
    """`context_attention` given the keys and values of the whole sequences (in position
    order): the part without communication."""
    seq_len = k_BHSD.shape[2]
    if documents is None or len(set(documents.ends)) == 1:
        ends = (seq_len,) if documents is None else documents.ends[0]
        blocks = attention_blocks(shard, seq_len, ends)
        return BlockAttention.apply(q_BHCD, k_BHSD, v_BHSD, blocks)
    rows = [
        BlockAttention.apply(
            q_BHCD[b : b + 1],
            k_BHSD[b : b + 1],
            v_BHSD[b : b + 1],
            attention_blocks(shard, seq_len, ends),
        )
        for b, ends in enumerate(documents.ends)
    ]
    return torch.cat(rows)


Block = tuple[int, int, int, int, bool]
"""(query start, query end, key start, key end, causal): local query rows attending to a
range of the whole sequence's keys; a causal block's queries and keys are the same positions."""


def attention_blocks(shard: ContextShard, seq_len: int, ends: tuple[int, ...]) -> tuple[Block, ...]:
    """The kernel calls of this rank's queries: per local chunk and per document in it, the
    keys of the document before the chunk (no mask) and the chunk's own (causal). `ends`:
    where the documents end (exclusive, ascending, the last one `seq_len`)."""
    chunk = chunk_length(seq_len, shard.cp)
    blocks: list[Block] = []
    for slot, index in enumerate(shard.chunks()):
        low, high = index * chunk, (index + 1) * chunk
        for start, end in itertools.pairwise((0, *ends)):
            first, last = max(start, low), min(end, high)
            if first >= last:
                continue
            local = first - low + slot * chunk
            if start < low:
                blocks.append((local, local + last - first, start, low, False))
            blocks.append((local, local + last - first, first, last, True))
    return tuple(blocks)


class BlockAttention(torch.autograd.Function):
    """Attention of query rows to key ranges (`Block`s), the results of the blocks that share
    query rows merged by log-sum-exp; every query row must be in at least one block."""

    @staticmethod
    def forward(
        ctx, q_BHCD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, blocks: tuple[Block, ...]
    ) -> Tensor:  # type: ignore[override]
        scale = q_BHCD.shape[-1] ** -0.5
        merge_dtype = torch.promote_types(q_BHCD.dtype, torch.float32)  # fp32 at least
        out_BHCD = torch.empty_like(q_BHCD)
        lse_BHC = torch.empty(q_BHCD.shape[:3], dtype=merge_dtype, device=q_BHCD.device)
        rows = sorted({(b[0], b[1]) for b in blocks})
        for q_start, q_end in rows:
            outs, lses = [], []
            for _, _, k_start, k_end, causal in (b for b in blocks if b[:2] == (q_start, q_end)):
                out, lse = _grouped_forward(
                    q_BHCD[:, :, q_start:q_end],
                    k_BHSD[:, :, k_start:k_end],
                    v_BHSD[:, :, k_start:k_end],
                    causal,
                    scale,
                )
                outs.append(out)
                lses.append(lse.to(merge_dtype))
            lse = torch.stack(lses).logsumexp(dim=0)
            merged = sum(
                out.to(merge_dtype) * (part_lse - lse).exp().unsqueeze(-1)
                for out, part_lse in zip(outs, lses, strict=True)
            )
            out_BHCD[:, :, q_start:q_end] = merged
            lse_BHC[:, :, q_start:q_end] = lse
        ctx.save_for_backward(q_BHCD, k_BHSD, v_BHSD, out_BHCD, lse_BHC)
        ctx.blocks, ctx.scale = blocks, scale
        return out_BHCD

    @staticmethod
    def backward(ctx, grad_BHCD: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:  # type: ignore[override]
        q_BHCD, k_BHSD, v_BHSD, out_BHCD, lse_BHC = ctx.saved_tensors
        grad_q, grad_k, grad_v = (torch.zeros_like(t) for t in (q_BHCD, k_BHSD, v_BHSD))
        for q_start, q_end, k_start, k_end, causal in ctx.blocks:
            gq, gk, gv = _grouped_backward(
                grad_BHCD[:, :, q_start:q_end],
                q_BHCD[:, :, q_start:q_end],
                k_BHSD[:, :, k_start:k_end],
                v_BHSD[:, :, k_start:k_end],
                out_BHCD[:, :, q_start:q_end],
                lse_BHC[:, :, q_start:q_end],
                causal,
                ctx.scale,
            )
            grad_q[:, :, q_start:q_end] += gq
            grad_k[:, :, k_start:k_end] += gk
            grad_v[:, :, k_start:k_end] += gv
        return grad_q, grad_k, grad_v, None


def _grouped_forward(
    q_BHCD: Tensor, k_BGSD: Tensor, v_BGSD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """`_flash_forward` of H query heads to G <= H key/value heads (query head h reads key
    head h // (H / G)). A block without mask folds each group's query heads into rows, so
    the keys are not copied; a causal one (its keys are the chunk's own) repeats its keys."""
    batch, heads, rows, dim = q_BHCD.shape
    groups = k_BGSD.shape[1]
    if groups == heads:
        return _flash_forward(q_BHCD, k_BGSD, v_BGSD, causal, scale)
    if causal:
        repeats = heads // groups
        k_BHSD = k_BGSD.repeat_interleave(repeats, dim=1)
        v_BHSD = v_BGSD.repeat_interleave(repeats, dim=1)
        return _flash_forward(q_BHCD, k_BHSD, v_BHSD, causal, scale)
    out, lse = _flash_forward(_fold(q_BHCD, groups), k_BGSD, v_BGSD, causal, scale)
    return out.reshape(batch, heads, rows, dim), lse.reshape(batch, heads, rows)


def _grouped_backward(
    grad_BHCD: Tensor,
    q_BHCD: Tensor,
    k_BGSD: Tensor,
    v_BGSD: Tensor,
    out_BHCD: Tensor,
    lse_BHC: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """`_flash_backward` of `_grouped_forward`: the gradients of the G key/value heads sum
    those of the query heads that read them."""
    batch, heads, rows, dim = q_BHCD.shape
    groups = k_BGSD.shape[1]
    if groups == heads:
        return _flash_backward(grad_BHCD, q_BHCD, k_BGSD, v_BGSD, out_BHCD, lse_BHC, causal, scale)
    repeats = heads // groups
    if causal:
        k_BHSD = k_BGSD.repeat_interleave(repeats, dim=1)
        v_BHSD = v_BGSD.repeat_interleave(repeats, dim=1)
        gq, gk, gv = _flash_backward(
            grad_BHCD, q_BHCD, k_BHSD, v_BHSD, out_BHCD, lse_BHC, causal, scale
        )
        keys = k_BGSD.shape[2]
        return (
            gq,
            gk.view(batch, groups, repeats, keys, dim).sum(2),
            gv.view(batch, groups, repeats, keys, dim).sum(2),
        )
    folded = (_fold(t, groups) for t in (grad_BHCD, q_BHCD))
    gq, gk, gv = _flash_backward(
        *folded,
        k_BGSD,
        v_BGSD,
        _fold(out_BHCD, groups),
        lse_BHC.reshape(batch, groups, repeats * rows),
        causal,
        scale,
    )
    return gq.reshape(batch, heads, rows, dim), gk, gv


def _fold(x_BHCD: Tensor, groups: int) -> Tensor:
    """[B, G, (H / G) x C, D]: the query heads of each key/value head as rows of one."""
    batch, heads, rows, dim = x_BHCD.shape
    return x_BHCD.reshape(batch, groups, heads // groups * rows, dim)


def _flash_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """(output, log-sum-exp [B, H, rows]) of one flash-attention call."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if q.device.type == "cuda":
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"context-parallel attention on CUDA runs the flash kernel, which takes bf16 or "
                f"fp16 inputs, not {q.dtype}; compute in bfloat16"
            )
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


def _flash_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v of one flash-attention call, given the output and log-sum-exp of
    the whole (merged) attention of its query rows."""
    grad, q, k, v, out, lse = (t.contiguous() for t in (grad, q, k, v, out, lse))
    if q.device.type == "cuda":
        empty = torch.empty(0, dtype=torch.int32, device=q.device)
        seed = torch.empty((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad,
            q,
            k,
            v,
            out,
            lse,
            empty,
            empty,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            seed,
            seed,
            scale=scale,
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def gather_sequence(x_BHCD: Tensor, shard: ContextShard) -> Tensor:
    """The whole sequences [B, H, S, D] in position order, from each rank's two chunks."""
    if shard.cp == 1 or shard.group is None:
        return x_BHCD
    return _GatherSequence.apply(x_BHCD, shard)


class _GatherSequence(torch.autograd.Function):
    """All-gather of each rank's chunks in position order; backward reduce-scatters the
    gradients (sums every rank's gradient of a chunk on the rank holding it)."""

    @staticmethod
    def forward(ctx, x_BHCD: Tensor, shard: ContextShard) -> Tensor:  # type: ignore[override]
        ctx.shard = shard
        parts = [torch.empty_like(x_BHCD) for _ in range(shard.cp)]
        dist.all_gather(parts, x_BHCD.contiguous(), group=shard.group)
        return _to_position_order(parts)

    @staticmethod
    def backward(ctx, grad_BHSD: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        shard: ContextShard = ctx.shard
        chunk = grad_BHSD.shape[2] // (2 * shard.cp)
        by_rank = [
            torch.cat(
                [grad_BHSD[:, :, c * chunk : (c + 1) * chunk] for c in (r, 2 * shard.cp - 1 - r)],
                dim=2,
            )
            for r in range(shard.cp)
        ]
        if dist.get_backend(shard.group) == "gloo":  # gloo has no reduce-scatter
            summed = torch.stack(by_rank)
            dist.all_reduce(summed, group=shard.group)
            return summed[shard.rank], None
        mine = torch.empty_like(by_rank[0])
        dist.reduce_scatter(mine, [g.contiguous() for g in by_rank], group=shard.group)
        return mine, None


def _to_position_order(parts: list[Tensor]) -> Tensor:
    """Chunks held as rank r's (r, 2 cp - 1 - r) joined in position order."""
    heads = [p.chunk(2, dim=2)[0] for p in parts]
    tails = [p.chunk(2, dim=2)[1] for p in reversed(parts)]
    return torch.cat(heads + tails, dim=2)
