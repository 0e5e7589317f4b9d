"""RMSNorm, rotary position embeddings and causal grouped-query attention, optionally kept
inside each document of a packed sequence (`moe_train.model.documents`).

B batch, S positions of this call (T of the keys where they differ), L positions of a KV
cache (its capacity), H heads (query or key/value), D channels per head (the whole model
width where named so).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_plan.config import RopeScalingConfig
from moe_train.model.documents import Documents
from moe_train.model.fused import rms_norm, rotary

QKKernel = Callable[[Tensor, Tensor | None, float, Tensor, Tensor], Tensor]
"""(x_BHSD, norm weight or None, eps, cos_SD, sin_SD) -> normed and rotated x_BHSD."""

AttentionCore = Callable[[Tensor, Tensor, Tensor, Documents | None], Tensor]
"""(q_BHSD, k_BHSD, v_BHSD, documents or None) -> attended [B, H, S, D]: causal attention of
a call's queries to its keys (which may have fewer heads), within each document when
documents are given."""


def causal_attention(
    q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, documents: Documents | None = None
) -> Tensor:
    """The `AttentionCore` of whole sequences: each position attends to the earlier ones (of
    its own document, with `documents`)."""
    gqa = k_BHSD.shape[1] != q_BHSD.shape[1]
    if documents is not None:
        return documents.attend(q_BHSD, k_BHSD, v_BHSD, gqa=gqa)
    return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True, enable_gqa=gqa)


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-channel scale, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel: Callable[[Tensor, Tensor, float], Tensor] = rms_norm
        """The normalisation (a compiled one after `apply_compile`)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel(x, self.weight, self.eps)


def rope_tables(
    head_dim: int, max_len: int, theta: float, scaling: RopeScalingConfig | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin tables [max_len, head_dim // 2] of the rotary embedding, with the
    frequencies (and scale) of `scaling` (None: plain RoPE).

    Computed in fp32 in the order transformers computes them (and the trainers whose
    checkpoints it reads): the frequencies, each position times each frequency rounded to
    fp32, then its cosine and sine. Tables computed in float64 differ from those by an ulp,
    enough to move an imported model's logits by ~1e-6 relative."""
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv_freq, scale = 1.0 / powers, 1.0
    if scaling is not None and scaling.type == "yarn":
        inv_freq, scale = yarn_frequencies(powers, head_dim, theta, scaling)
    angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos() * scale, angles.sin() * scale


def yarn_frequencies(
    powers: Tensor, head_dim: int, theta: float, scaling: RopeScalingConfig
) -> tuple[Tensor, float]:
    """YaRN's frequencies, from `powers` (theta^(2i / head_dim), fp32), and the scale of cos
    and sin (Peng et al., 2023, "YaRN: Efficient Context Window Extension of Large Language
    Models"; as Hugging Face computes it, with the channel bounds rounded outwards).

    Channel pair i turns r_i = original / (2 pi powers[i]) times over the original context.
    Pairs turning more than beta_fast times keep their frequency, pairs turning fewer than
    beta_slow times are divided by `factor`, and a linear ramp over the pair index joins the
    two."""
    original = scaling.original_max_position_embeddings
    assert original is not None, "RopeScalingConfig.validate requires it for yarn"

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns so often
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_turning(scaling.beta_fast)), 0)
    high = min(math.ceil(pair_turning(scaling.beta_slow)), head_dim - 1)
    if high == low:
        high += 0.001
    pairs = torch.arange(head_dim // 2, dtype=torch.float32)
    kept = 1 - ((pairs - low) / (high - low)).clamp(0, 1)  # 1: kept, 0: divided by factor
    scaled = 1.0 / (scaling.factor * powers) * (1 - kept) + 1.0 / powers * kept
    scale = scaling.attention_factor
    if scale is None:
        scale = 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
    return scaled, scale


def rope_rows(x_BHSD: Tensor, cos_SD: Tensor, sin_SD: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """The rows of the cos and sin tables for the positions of `x_BHSD` (`start, start + 1,
    ...`), in its dtype."""
    end = start + x_BHSD.shape[-2]
    return cos_SD[start:end].to(x_BHSD.dtype), sin_SD[start:end].to(x_BHSD.dtype)


def apply_rope(x_BHSD: Tensor, cos_SD: Tensor, sin_SD: Tensor, start: int = 0) -> Tensor:
    """Rotate pairs (first half, second half) of each head's channels by position angles;
    `x_BHSD` holds positions `start, start + 1, ...`."""
    return rotary(x_BHSD, *rope_rows(x_BHSD, cos_SD, sin_SD, start))


@dataclass
class LayerKVCache:
    """One attention layer's keys and values of the positions processed so far, preallocated
    for `L` positions (after RoPE and QK-norm, as attention uses them)."""

    keys_BHLD: Tensor
    values_BHLD: Tensor

    def store(self, start: int, k_BHSD: Tensor, v_BHSD: Tensor) -> tuple[Tensor, Tensor]:
        """Write positions `start, start + 1, ...`; return keys and values of all positions up
        to the last one written."""
        end = start + k_BHSD.shape[-2]
        self.keys_BHLD[:, :, start:end] = k_BHSD
        self.values_BHLD[:, :, start:end] = v_BHSD
        return self.keys_BHLD[:, :, :end], self.values_BHLD[:, :, :end]


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads, RoPE and optional QK-norm (per head, or
    over the whole query and key projections) and q/k/v biases."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        *,
        qk_norm: bool | Literal["projection"],
        norm_eps: float,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads
        kv_dim = n_kv_heads * self.head_dim
        self.qkv = nn.Linear(d_model, d_model + 2 * kv_dim, bias=qkv_bias)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.norm_per_head = qk_norm != "projection"
        """QK-norm over each head's channels (true), else over the whole projections before
        the split into heads ("projection")."""
        q_width, k_width = (
            (self.head_dim, self.head_dim) if self.norm_per_head else (d_model, kv_dim)
        )
        self.q_norm = RMSNorm(q_width, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(k_width, norm_eps) if qk_norm else None
        self.qk_kernel: QKKernel | None = None
        """Per-head norm and rotation of queries and keys in one function (a compiled one
        after `apply_compile`); None runs `q_norm` / `k_norm`, then `rotary`."""
        self.core: AttentionCore = causal_attention
        """Attention of the queries to the keys without a KV cache: `causal_attention`, or
        one that also reads the parts of each sequence other processes hold (see
        `moe_train.parallelize.apply_context_parallel`)."""

    def forward(
        self,
        x_BSD: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: LayerKVCache | None = None,
        start: int = 0,
        documents: Documents | None = None,
    ) -> Tensor:
        """Attention over positions `0..start + S`: those of `x_BSD` (`start, start + 1, ...`)
        and, with a `cache`, the `start` earlier ones it holds (the new ones are added to it).
        With `documents` (no cache), each position sees only the earlier ones of its own
        document. `cos` and `sin` are the rows of the positions `x_BSD` holds (see
        `SequencePart`); `documents` are those of the whole sequences."""
        batch, seq_len, d_model = x_BSD.shape
        kv_dim = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x_BSD).split([d_model, kv_dim, kv_dim], dim=-1)
        head_q_norm, head_k_norm = self.q_norm, self.k_norm
        if not self.norm_per_head and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            head_q_norm = head_k_norm = None
        q = q.view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = (
            self._norm_rotate(q, head_q_norm, cos, sin, start),
            self._norm_rotate(k, head_k_norm, cos, sin, start),
        )
        if cache is None:
            attended = self.core(q, k, v, documents)
        else:
            attended = self._attend_cached(q, k, v, cache, start, documents)
        return self.out(attended.transpose(1, 2).reshape(batch, seq_len, d_model))

    def _attend_cached(
        self,
        q_BHSD: Tensor,
        k_BHSD: Tensor,
        v_BHSD: Tensor,
        cache: LayerKVCache,
        start: int,
        documents: Documents | None,
    ) -> Tensor:
        """Attention of the queries to the keys of the cache's positions and their own."""
        if self.core is not causal_attention:
            raise ValueError("a KV cache works only with attention over whole sequences")
        if documents is not None:
            raise ValueError("attention takes documents or a KV cache, not both")
        seq_len = q_BHSD.shape[2]
        k_BHTD, v_BHTD = cache.store(start, k_BHSD, v_BHSD)
        mask, causal = None, True
        if start > 0:
            # Queries sit at the end of the keys: query i sees keys 0..start + i. One query
            # sees every key, needing no mask.
            causal = False
            if seq_len > 1:
                mask = torch.ones(seq_len, start + seq_len, dtype=torch.bool, device=q_BHSD.device)
                mask = mask.tril(diagonal=start)
        return F.scaled_dot_product_attention(
            q_BHSD,
            k_BHTD,
            v_BHTD,
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )

    def _norm_rotate(
        self, x_BHSD: Tensor, norm: RMSNorm | None, cos: Tensor, sin: Tensor, start: int
    ) -> Tensor:
        if self.qk_kernel is None:
            return apply_rope(x_BHSD if norm is None else norm(x_BHSD), cos, sin, start)
        weight_D, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        return self.qk_kernel(x_BHSD, weight_D, eps, *rope_rows(x_BHSD, cos, sin, start))
